#!/usr/bin/env bash
# Set up a virtual environment with the exact versions in constraints.txt (CPU torch from the
# local wheel cache) and run the test suite. Arguments go to pytest.
# pytest's exit code 5 ("no tests collected") is a failure here, as is any other non-zero code.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# PIP_CONSTRAINT (not -c) so that the isolated build of shardopt itself is pinned too.
# DS_BUILD_OPS=0: deepspeed (the bench peer) compiles no C++ ops.
PIP_CONSTRAINT="$PWD/constraints.txt" DS_BUILD_OPS=0 .venv/bin/python -m pip install -q \
  --disable-pip-version-check torch==2.13.0 -e '.[dev]' </dev/null
export OMP_NUM_THREADS=1
# Tests run side by side, one per core up to 4 (pytest-xdist): a distributed test spends most of
# its time starting ranks and waiting in collectives, not computing: on 2 cores two workers ran
# the suite in 13-16 minutes, one process in 24. SHARDOPT_TEST_WORKERS=0 runs it in this process.
workers=${SHARDOPT_TEST_WORKERS:-$(python3 -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}
set +e
.venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" "$@"
code=$?
set -e
if [ "$code" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$code"
