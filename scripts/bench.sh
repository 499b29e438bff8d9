#!/usr/bin/env bash
# The CPU benchmark of docs/benchmarks.md: the 27M-parameter GPT, Adam, every shardopt mode and installed peer,
# at 2 and 4 ranks on CPU (gloo). Writes bench-results/bench-<N>ranks.json (and .png when
# matplotlib is installed). Run it on an otherwise idle machine: step times are wall time.
# Every mode runs in 2 interleaved rounds of 12 steps (10 counted each), pooled: a shared
# machine's speed drifts, and interleaving spreads the drift over all modes.
# Usage: scripts/bench.sh [extra shardopt bench arguments, e.g. --modes zero1,zero2]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p bench-results
plot=()
if python -c "import matplotlib" 2>/dev/null; then
  plot=(--plot)
fi
for ranks in 2 4; do
  out="bench-results/bench-${ranks}ranks"
  args=(--model 27m --world-size "$ranks" --steps 12 --rounds 2 --warmup-steps 2 --batch-size 4 --json "$out.json")
  if [ ${#plot[@]} -gt 0 ]; then
    args+=(--plot "$out.png")
  fi
  python -m shardopt bench "${args[@]}" "$@"
done
