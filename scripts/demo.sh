#!/usr/bin/env bash
# Set up a virtual environment (CPU torch from the local wheel cache) and run the main job:
# `shardopt demo` on its built-in defaults (extra arguments are passed through).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e . </dev/null
exec .venv/bin/shardopt demo "$@"
