"""The host time ShardedDataParallel spends handing reduced gradients to an owner's fp32 masters.

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python scripts/bench_hand_over.py [--steps 30] [--world-size 2] [--layers 16,128]

The model is a stack of 64 x 64 bf16 linear layers (two parameters each, every one a multiple of
64 elements) under ``OSS(master_dtype=torch.float32)`` with and without ``offload="cpu"``, one
default bucket. A row is the median, over the steps after 5 warm-up steps, of the time spent in
the reduction queue's hand-over of a finished bucket (``ReductionQueue._hand_over``: the views of
the bucket, the owner's bookkeeping and the copies into the masters' gradient buffer) per backward
pass, and of the whole backward pass, on rank 0. To compare two versions, run the script from
each checkout (``PYTHONPATH=<checkout>``) on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardopt.nn import ShardedDataParallel
from shardopt.nn.data_parallel import reduction_queue
from shardopt.optim import OSS
from shardopt.testing import run_ranks


def _rank(rank: int, world_size: int, layers: int, offload: str | None, steps: int) -> tuple[float, float, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)]).to(torch.bfloat16)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, master_dtype=torch.float32, offload=offload, lr=1e-3)
    sdp = ShardedDataParallel(model, opt)
    spent: list[float] = []
    hand_over = reduction_queue.ReductionQueue._hand_over

    def timed(self: Any, bucket: Any, total: torch.Tensor) -> None:
        start = time.perf_counter()
        hand_over(self, bucket, total)
        spent.append(time.perf_counter() - start)

    reduction_queue.ReductionQueue._hand_over = timed  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    hand_overs, backwards = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = sdp(x).float().pow(2).mean()
        spent.clear()
        start = time.perf_counter()
        loss.backward()
        backwards.append(time.perf_counter() - start)
        hand_overs.append(sum(spent))
        opt.step()
    owned = sum(1 for p in model.parameters() if opt.master_of(p) is not None)
    return statistics.median(hand_overs[5:]), statistics.median(backwards[5:]), owned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", default="16,128", help="comma-separated layer counts")
    args = parser.parse_args()
    print(f"{'layers':>6} {'offload':>8} {'owned':>6} {'hand-over us':>13} {'us per owned':>13} {'backward us':>12}")
    for layers in (int(n) for n in args.layers.split(",")):
        for offload in (None, "cpu"):
            hand_over, backward, owned = run_ranks(_rank, args.world_size, layers, offload, args.steps,
                                                   timeout_s=600)[0]
            print(f"{layers:6d} {offload or '-':>8} {owned:6d} {1e6 * hand_over:13.0f} {1e6 * hand_over / owned:13.1f} "
                  f"{1e6 * backward:12.0f}")


if __name__ == "__main__":
    main()
