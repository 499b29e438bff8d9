"""ShardedDataParallel without buckets (``reduce_buffer_size=0``, fairscale's benchmark and
Lightning 1.x's setting) against fairscale's, on a model of many small parameters.

Usage (from the repository root, fairscale installed: ``pip install -e '.[dev]'``)::

    OMP_NUM_THREADS=1 python scripts/bench_bucketless.py [--steps 30] [--world-size 2]

The model is a ResNet-like stack of small convolutions and batch norms (fairscale's own
``benchmarks/oss.py`` uses torchvision's ResNet-101, which cannot be installed beside the
local CPU torch here; what matters is the same shape of work: hundreds of small parameters,
each its own all-to-all without buckets). Each row is the median step time over the steps
after 5 warm-up steps, worst rank, interleaved rounds so machine drift hits every row.
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

from shardopt.testing import run_ranks


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, padding=1)]
    for _ in range(48):
        layers += [nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)]
    return nn.Sequential(*layers)


def _rank(rank: int, world_size: int, which: str, bucket: int, steps: int) -> list[float]:
    model = make_model()
    if which == "shardopt":
        from shardopt.nn import ShardedDataParallel
        from shardopt.optim import OSS
    else:
        from fairscale.nn.data_parallel import ShardedDataParallel  # type: ignore[no-redef]
        from fairscale.optim import OSS  # type: ignore[no-redef]
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.01, momentum=0.9)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=bucket)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)  # fairscale needs it (stale gradients otherwise)
        nn.functional.cross_entropy(sdp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return times[5:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for which in ("fairscale", "shardopt"):
            for bucket in (0, 2**23):
                per_rank: list[Any] = run_ranks(_rank, args.world_size, which, bucket, args.steps, timeout_s=600)
                key = f"{which} reduce_buffer_size={bucket}"
                rows.setdefault(key, []).extend(max(step) for step in zip(*per_rank, strict=False))
    base = {b: statistics.median(rows[f"fairscale reduce_buffer_size={b}"]) for b in (0, 2**23)}
    print(f"{'setup':40} {'median step ms':>15} {'vs fairscale':>13}")
    for key, times in rows.items():
        bucket = int(key.rsplit("=", 1)[1])
        median = statistics.median(times)
        print(f"{key:40} {1000 * median:15.1f} {median / base[bucket]:13.2f}")


if __name__ == "__main__":
    main()
