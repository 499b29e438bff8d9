#!/usr/bin/env bash
# Set up a virtual environment (CPU torch from the local wheel cache, versions from constraints.txt,
# as scripts/test.sh does; no trainers or benchmark peers)
# and run `shardopt demo`: the built-in GPT on 2 local CPU ranks with ZeRO-2, printing memory,
# bytes sent and step time per rank. Extra arguments go to the demo, e.g.
#   bash scripts/demo.sh --mode zero3 --steps 100 --checkpoint out/demo.pt
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
PIP_CONSTRAINT="$PWD/constraints.txt" .venv/bin/python -m pip install -q --disable-pip-version-check \
  torch==2.13.0 -e . </dev/null
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec .venv/bin/shardopt demo "$@"
