#!/usr/bin/env bash
# Refresh constraints.txt, the exact versions scripts/test.sh, scripts/demo.sh and CI install:
# resolve the dev extras afresh (newest versions within setup.cfg's ranges) in a throwaway
# virtual environment and freeze the whole set, torch and the build tools included.
# Then run `bash scripts/test.sh` and commit constraints.txt with the result.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
DS_BUILD_OPS=0 "$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 -e '.[dev]' </dev/null
{
  echo "# Exact versions CI last passed with. Refresh: bash scripts/pin.sh (see its header)."
  "$tmp/venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -i '^shardopt[= @]' | LC_ALL=C sort -f
} > constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
