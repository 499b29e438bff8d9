#!/usr/bin/env bash
# The mixed-precision benchmark (docs/benchmarks.md, "Mixed-precision ZeRO-2 against DeepSpeed ZeRO-2"): the
# 27M-parameter GPT, Adam, CPU/gloo; fp32 DDP as the baseline, bf16 DDP, shardopt ZeRO-1/2
# with fp32 masters (reducing in fp32 and in bf16) and DeepSpeed ZeRO-2 bf16 when deepspeed
# is installed (a missing peer is skipped with a note). A CPU without bf16 instructions runs a
# bf16 step about 12x slower than an fp32 one (21.5 s against 1.8 s at 2 ranks on the 2-core
# development VM), so the runs are short: 2 ranks is timed over 4 steps after 2 warm-up ones;
# 4 and 8 ranks (CPU contention on 2 cores) are for memory and bytes only, 8 ranks with the
# ZeRO-2 modes alone. Writes bench-results/mixed-<N>ranks.json.
# Usage: scripts/bench_mixed.sh [world sizes, default "2 4 8"]
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p bench-results
modes=ddp,ddp-bf16,zero2,zero1-bf16m,zero2-bf16m,zero2-bf16m-bf16reduce,deepspeed-zero2-bf16m,deepspeed-zero2-bf16m-bf16reduce
for ranks in ${1:-2 4 8}; do
  case "$ranks" in
    2) args=(--steps 6 --modes "$modes") ;;
    4) args=(--steps 4 --modes "$modes") ;;
    *) args=(--steps 3 --modes ddp,zero2,zero2-bf16m,zero2-bf16m-bf16reduce,deepspeed-zero2-bf16m,deepspeed-zero2-bf16m-bf16reduce) ;;
  esac
  python -m shardopt bench --model 27m --world-size "$ranks" "${args[@]}" --warmup-steps 2 --batch-size 4 \
    --json "bench-results/mixed-${ranks}ranks.json"
done
