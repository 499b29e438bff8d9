"""Write (or check) the "## Options" section of docs/cli.md from the command's own ``--help``.

    python scripts/cli_docs.py           # rewrite the section from `shardopt <command> --help`
    python scripts/cli_docs.py --check   # exit 1 and say so when docs/cli.md differs

The section shows ``shardopt --help`` and every subcommand's ``--help`` as
``COLUMNS=100 shardopt <command> --help`` prints them, in the order ``shardopt --help``
lists the subcommands; tests/test_cli_help.py runs the check, so a new option or subcommand
fails the tests until this script is run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardopt.app.cli import build_parser  # noqa: E402

DOC = ROOT / "docs" / "cli.md"
HEADING = "## Options"
COLUMNS = 100


def help_texts(columns: int = COLUMNS) -> dict[str, str]:
    """``{"shardopt": top-level help, "<command>": its help}`` at ``columns`` terminal columns."""
    # argparse reads the width from the terminal size (COLUMNS first); no colour (Python 3.14+)
    wanted = {"COLUMNS": str(columns), "NO_COLOR": "1", "PYTHON_COLORS": "0"}
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        parser = build_parser()
        texts = {"shardopt": parser.format_help()}
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        texts.update({name: p.format_help() for name, p in sub.choices.items()})
        return texts
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def options_section() -> str:
    """The "## Options" section, from :data:`HEADING` to the end of the file."""
    parts = [f"{HEADING}\n\nEvery option of each subcommand, as `COLUMNS={COLUMNS} shardopt <command> --help` prints it\n"
             "(written by `python scripts/cli_docs.py`; a test checks that it is current).\n"]
    for name, text in help_texts().items():
        command = "shardopt" if name == "shardopt" else f"shardopt {name}"
        parts.append(f"\n### `{command} --help`\n\n```text\n{text.rstrip()}\n```\n")
    return "".join(parts)


def render(doc: str) -> str:
    """``doc`` with its "## Options" section (to the end) replaced by :func:`options_section`."""
    start = doc.find(f"\n{HEADING}\n")
    if start < 0:
        raise SystemExit(f"{DOC}: no '{HEADING}' section to replace; add the heading at the end of the file")
    return doc[:start + 1] + options_section()


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="only check; exit 1 when docs/cli.md differs")
    check = args.parse_args(argv).check
    doc = DOC.read_text()
    wanted = render(doc)
    if check:
        if doc != wanted:
            print(f"{DOC} differs from the command's --help: run python scripts/cli_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
