"""Print shardopt's module graph from its imports: modules, import edges, layers, cycles.

Usage (from the repository root)::

    python scripts/module_graph.py            # the table and the edges
    python scripts/module_graph.py --check    # also exit 1 on a broken rule
    python scripts/module_graph.py --root DIR # another checkout's shardopt/ (e.g. an old commit)

Edges are the ``shardopt`` imports a module executes (imports under ``if TYPE_CHECKING:``
are listed apart and do not count for cycles or layers; imports inside a function count,
and are also checked as below). A module's layer is 0 when it imports no other shardopt
module, else one more than the highest layer it imports.

Each module also belongs to a declared *level* (:data:`LEVELS`: the longest entry naming it
or a package above it); imports must point down the levels. The rules ``--check`` enforces:

- no import cycle, and no module over ``--max-lines`` lines;
- no upward arrow: a module imports only modules of a lower level or of its own component
  (the :data:`LEVELS` entry it belongs to). Importing a module of a higher level, or of
  another component at the same level (``nn.fsdp`` importing ``nn.data_parallel``), is
  flagged; a package's ``__init__`` re-exporting its own submodules is not an arrow;
- every module has a level (a new top-level module or subpackage is added to :data:`LEVELS`);
- no import inside a function that dodges a cycle: one that, written at the top of its
  module, would close an import cycle (counting the package ``__init__`` files an import
  runs first);
- the library (everything outside ``shardopt.app``) imports neither ``shardopt.app`` nor
  ``rich`` (``shardopt/__main__.py``, the command's entry point for ``python -m shardopt``,
  belongs to the application).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

APP = "shardopt.app"
ENTRY = "shardopt.__main__"  # ``python -m shardopt``: the application's entry point

# The declared layering, lowest first. A module belongs to the longest entry that is its own
# name or a package above it (``shardopt`` itself names only the package's ``__init__``).
LEVELS: dict[str, int] = {
    # pure helpers, no shardopt imports
    "shardopt.failures": 0, "shardopt.files": 0, "shardopt.partition": 0,
    "shardopt.placeholders": 0, "shardopt.state_checks": 0,
    # host buffers on huge pages at staggered offsets (Note [host buffer placement])
    "shardopt.host_memory": 0,
    # the ZeRO formulas next to the real ownership plans (reads partition)
    "shardopt.memory": 1,
    # process groups formed on a store namespace of their own torchrun attempt (reads failures)
    "shardopt.elastic": 1,
    # where each rank is in its collectives (the flight recorder), and the waits that read it
    "shardopt.flight": 1,
    # stream operations behind one interface (a CUDA side stream, or host order), for the optimizers and the wrappers
    "shardopt.streams": 1,
    "shardopt.waiting": 2,
    # the one module of collectives, and the test launcher
    "shardopt.comm": 3, "shardopt.testing": 3,
    # what both the optimizers and the wrappers use
    "shardopt.agreement": 4, "shardopt.checkpoint": 4, "shardopt.clipping": 4,
    # the hybrid layout (shard group x replicate group), checked with agreement, for all three stages
    "shardopt.hybrid": 5,
    "shardopt.optim": 6,  # ZeRO-1
    "shardopt.nn": 7,  # what both wrappers share (nn/module_checks.py)
    "shardopt.nn.data_parallel": 8, "shardopt.nn.fsdp": 8,  # ZeRO-2 and ZeRO-3: neither imports the other
    "shardopt": 9,  # the package's re-exports
    # per-parameter gradient norms over every rank, under any stage (reads OSS and both wrappers)
    "shardopt.param_norms": 9,
    # one rank of N built in one process under torch's fake group (the estimate command's --measure)
    "shardopt.fake_ranks": 9,
    "shardopt.integrations": 10,  # Lightning, Hugging Face: above the library
    "shardopt.app": 11,  # the ``shardopt`` command
    ENTRY: 12,
}


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


def component_of(name: str) -> str | None:
    """The :data:`LEVELS` entry ``name`` belongs to (``None``: undeclared)."""
    if name == "shardopt":
        return name
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        prefix = ".".join(parts[:end])
        if prefix in LEVELS and prefix != "shardopt":
            return prefix
    return None


def imports_of(
    tree: ast.Module, name: str, is_package: bool, known: set[str]
) -> tuple[set[str], set[str], set[str]]:
    """(runtime imports, TYPE_CHECKING-only imports, imports inside a function): module
    names, ``known`` telling the project's modules from names imported out of a package. The
    third set is a subset of the first."""
    runtime: set[str] = set()
    typing_only: set[str] = set()
    deferred: set[str] = set()

    def visit(node: ast.AST, into: set[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for grandchild in child.body:
                    visit_stmt(grandchild, typing_only, in_function)
                for grandchild in child.orelse:
                    visit_stmt(grandchild, into, in_function)
            else:
                visit_stmt(child, into, in_function)

    def visit_stmt(node: ast.AST, into: set[str], in_function: bool) -> None:
        found: set[str] = set()
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                # ``from pkg import mod`` depends on pkg.mod; ``from pkg import name`` on pkg
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        else:
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(node, into, inner)
        into.update(found)
        if in_function and into is runtime:
            deferred.update(found)

    visit(tree, runtime, False)
    return runtime, typing_only, deferred


def build(
    root: Path,
) -> tuple[dict[str, int], dict[str, set[str]], dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """Line counts, runtime edges, TYPE_CHECKING edges, third-party imports and the runtime
    edges made by imports inside functions, per module."""
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
    deferred_edges: dict[str, set[str]] = {}
    for name, (tree, is_package) in trees.items():
        runtime, typing_only, deferred = imports_of(tree, name, is_package, set(lines))
        # importing a submodule runs its parent packages first; that is not a design edge
        edges[name] = {m for m in runtime if m in lines and m != name and not name.startswith(m + ".")}
        typing_edges[name] = {m for m in typing_only if m in lines and m != name} - edges[name]
        external[name] = {m.split(".")[0] for m in runtime if not m.startswith("shardopt")}
        deferred_edges[name] = {m for m in deferred if m in lines and m != name}
    return lines, edges, typing_edges, external, deferred_edges


def upward_arrows(edges: dict[str, set[str]]) -> list[str]:
    """Edges that point up :data:`LEVELS` or sideways into another component of the same
    level, and modules with no declared level."""
    found: list[str] = []
    for name in sorted(edges):
        mine = component_of(name)
        if mine is None:
            found.append(f"{name} has no level: add it (or its package) to LEVELS in scripts/module_graph.py")
            continue
        for dep in sorted(edges[name]):
            theirs = component_of(dep)
            if theirs is None or theirs == mine or dep.startswith(name + "."):
                continue  # undeclared (reported above), same component, or a package re-exporting its own
            if LEVELS[theirs] > LEVELS[mine]:
                found.append(f"upward arrow: {name} (level {LEVELS[mine]}) imports {dep} (level {LEVELS[theirs]})")
            elif LEVELS[theirs] == LEVELS[mine]:
                found.append(f"sideways arrow: {name} ({mine}) imports {dep} of {theirs}, at the same level "
                             f"{LEVELS[mine]}: move what both need below both")
    return found


def _runs_first(target: str, importer: str, lines: dict[str, int]) -> list[str]:
    """What ``importer`` importing ``target`` runs: the packages above ``target`` not already
    running (those above ``importer``), then ``target``."""
    parts = target.split(".")
    ancestors = [".".join(parts[:end]) for end in range(1, len(parts))]
    return [a for a in ancestors if a in lines and not importer.startswith(a + ".") and a != importer] + [target]


def dodged_cycles(lines: dict[str, int], edges: dict[str, set[str]], deferred: dict[str, set[str]]) -> list[str]:
    """Imports inside a function that would close an import cycle if written at the top of
    their module (package ``__init__`` files that an import runs first included)."""
    at_import: dict[str, set[str]] = {
        name: {m for dep in edges[name] - deferred[name] for m in _runs_first(dep, name, lines)} for name in edges
    }
    found: list[str] = []
    for name in sorted(deferred):
        for dep in sorted(deferred[name]):
            stack, seen = list(_runs_first(dep, name, lines)), set()
            while stack:
                v = stack.pop()
                if v == name:
                    found.append(f"{name} imports {dep} inside a function, dodging an import cycle "
                                 f"({dep} leads back to {name} at import time): move what both need below both")
                    break
                if v not in seen:
                    seen.add(v)
                    stack.extend(at_import.get(v, ()))
    return found


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
    lines, edges, typing_edges, external, deferred = build(args.root)
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
    problems += upward_arrows(edges)
    problems += dodged_cycles(lines, edges, deferred)
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
