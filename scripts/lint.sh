#!/usr/bin/env bash
# The static checks CI runs after the tests, with the tools scripts/test.sh installed into
# .venv: ruff (configured in pyproject.toml), mypy (likewise) and the module-graph rules.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check shardopt scripts
.venv/bin/python -m mypy shardopt
.venv/bin/python scripts/module_graph.py --check >/dev/null
echo "lint: ruff, mypy and the module graph are clean"
