#!/usr/bin/env bash
# Set up a virtual environment (CPU torch from the local wheel cache) and run the test suite.
# pytest's exit code 5 ("no tests collected") is a failure here, as is any other non-zero code.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# DS_BUILD_OPS=0: deepspeed (a dev extra, for the deepspeed-zero2 bench peer) compiles no C++ ops
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[dev]' </dev/null
export OMP_NUM_THREADS=1
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$code"
