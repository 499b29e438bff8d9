"""Print shardopt's module graph from its imports: modules, import edges, layers, cycles.

Usage (from the repository root)::

    python scripts/module_graph.py            # the table and the edges
    python scripts/module_graph.py --check    # also exit 1 on a broken rule
    python scripts/module_graph.py --root DIR # another checkout's shardopt/ (e.g. an old commit)

Edges are the ``shardopt`` imports a module executes at import time (imports under
``if TYPE_CHECKING:`` are listed apart and do not count for cycles or layers). A module's
layer is 0 when it imports no other shardopt module, else one more than the highest layer
it imports. The rules ``--check`` enforces: no import cycle, no module over
``--max-lines`` lines, and the library (everything outside ``shardopt.app``) imports neither
``shardopt.app`` nor ``rich`` (``shardopt/__main__.py``, the command's entry point for
``python -m shardopt``, belongs to the application).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

APP = "shardopt.app"
ENTRY = "shardopt.__main__"  # ``python -m shardopt``: the application's entry point


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> tuple[set[str], set[str]]:
    """(runtime imports, TYPE_CHECKING-only imports): module names, ``known`` telling the
    project's modules from names imported out of a package."""
    runtime: set[str] = set()
    typing_only: set[str] = set()

    def visit(node: ast.AST, into: set[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for grandchild in child.body:
                    visit_stmt(grandchild, typing_only)
                for grandchild in child.orelse:
                    visit_stmt(grandchild, into)
            else:
                visit_stmt(child, into)

    def visit_stmt(node: ast.AST, into: set[str]) -> None:
        if isinstance(node, ast.Import):
            into.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                # ``from pkg import mod`` depends on pkg.mod; ``from pkg import name`` on pkg
                into.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        else:
            visit(node, into)

    visit(tree, runtime)
    return runtime, typing_only


def build(root: Path) -> tuple[dict[str, int], dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """Line counts, runtime edges, TYPE_CHECKING edges and third-party imports per module."""
    lines: dict[str, int] = {}
    trees: dict[str, tuple[ast.Module, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        text = path.read_text()
        lines[name] = len(text.splitlines())
        trees[name] = (ast.parse(text), path.name == "__init__.py")
    edges: dict[str, set[str]] = {}
    typing_edges: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, (tree, is_package) in trees.items():
        runtime, typing_only = imports_of(tree, name, is_package, set(lines))
        # importing a submodule runs its parent packages first; that is not a design edge
        edges[name] = {m for m in runtime if m in lines and m != name and not name.startswith(m + ".")}
        typing_edges[name] = {m for m in typing_only if m in lines and m != name} - edges[name]
        external[name] = {m.split(".")[0] for m in runtime if not m.startswith("shardopt")}
    return lines, edges, typing_edges, external


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(edges):
        if v not in index:
            strongconnect(v)
    return found


def layers(edges: dict[str, set[str]]) -> dict[str, int]:
    """0 for a module importing no shardopt module, else 1 + the highest layer it imports
    (an edge back into a cycle is not followed)."""
    memo: dict[str, int] = {}

    def layer(v: str, seen: frozenset[str]) -> int:
        if v in memo:
            return memo[v]
        deps = [w for w in edges[v] if w not in seen]
        memo[v] = 0 if not deps else 1 + max(layer(w, seen | {v}) for w in deps)
        return memo[v]

    return {v: layer(v, frozenset()) for v in edges}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent / "shardopt")
    parser.add_argument("--check", action="store_true", help="exit 1 when a rule is broken")
    parser.add_argument("--max-lines", type=int, default=600)
    parser.add_argument("--edges", action="store_true", help="also print every import edge")
    args = parser.parse_args(argv)
    lines, edges, typing_edges, external = build(args.root)
    layer = layers(edges)
    n_edges = sum(len(e) for e in edges.values())
    found = cycles(edges)
    longest = max(lines, key=lambda m: lines[m])
    print(f"{len(lines)} modules, {n_edges} import edges ({sum(len(e) for e in typing_edges.values())} "
          f"more for type checking only), {max(layer.values()) + 1} layers, {sum(lines.values())} lines")
    print(f"longest: {longest} ({lines[longest]} lines); import cycles: {len(found)}")
    print(f"{'layer':>5}  {'lines':>5}  module  <- imports")
    for name in sorted(lines, key=lambda m: (layer[m], m)):
        deps = ", ".join(sorted(d.removeprefix("shardopt.") for d in edges[name]))
        print(f"{layer[name]:>5}  {lines[name]:>5}  {name}" + (f"  <- {deps}" if deps and args.edges else ""))
    problems = [f"import cycle: {' -> '.join(c)}" for c in found]
    problems += [f"{m} has {n} lines (more than {args.max_lines})" for m, n in lines.items() if n > args.max_lines]
    for name in lines:
        if name == APP or name.startswith(APP + ".") or name == ENTRY:
            continue
        wrong = sorted(d for d in edges[name] if d == APP or d.startswith(APP + "."))
        if wrong:
            problems.append(f"library module {name} imports the application: {', '.join(wrong)}")
        if "rich" in external[name]:
            problems.append(f"library module {name} imports rich")
    for problem in problems:
        print("problem:", problem)
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
