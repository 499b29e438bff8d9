"""Iteration time of ``OSS(..., offload="cpu")`` with and without ``delay_update_after``
(Note [delayed update] in shardopt.optim.delayed_update) on CPU ranks.

Usage (from the repository root)::

    python scripts/bench_delayed_update.py [--world-size 1] [--stage zero2] [--layers 10] [--dim 512]

Each rank trains the built-in GPT (``shardopt.app.models``; 31.9M parameters at the defaults)
under ZeRO-2 (ShardedDataParallel, parameters whole) or ZeRO-1 (DDP) with torch's fused AdamW
over the host masters, and times whole iterations (``zero_grad``, forward, backward,
``step()``) after ``--warmup`` ones: with the delay, ``step()`` waits for the last host step
and launches this one, so an iteration's time is what a training loop sees. Each iteration
calls ``finish_update()`` just before ``step()`` (its first phase, timed apart: the wait for the
last host step, the write into the parameters and the gather; nothing without the delay), so
``step()`` is then the fold, the gradient copy and the launch (with the delay) or the whole
host step (without). The runs without
and with the delay alternate for ``--rounds`` rounds (a shared machine's speed drifts); the
medians are pooled over rounds and ranks (the slowest rank's median is printed too). Without
the delay the forward and backward and the ``step()`` are also timed apart, to show how much
there is to hide. The ranks share the machine's cores: a host step can only overlap the next
iteration when a core is free for its thread (``--threads`` intra-op threads per rank).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--world-size", type=int, default=1, help="CPU ranks (gloo)")
ARGS.add_argument("--stage", choices=("zero1", "zero2"), default="zero2")
ARGS.add_argument("--layers", type=int, default=10, help="transformer blocks")
ARGS.add_argument("--dim", type=int, default=512, help="model width (a multiple of 64 keeps the masters flat)")
ARGS.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
ARGS.add_argument("--seq", type=int, default=64, help="tokens per sequence")
ARGS.add_argument("--steps", type=int, default=6, help="timed iterations per run")
ARGS.add_argument("--warmup", type=int, default=2, help="untimed iterations first (the first creates the state)")
ARGS.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two runs")
ARGS.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
ARGS.add_argument("--json", default="", help="also write the numbers to this file")

if __name__ == "__main__":
    os.environ["OMP_NUM_THREADS"] = str(ARGS.parse_known_args()[0].threads)

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardopt.app.models import GPTConfig, build_model  # noqa: E402
from shardopt.nn import ShardedDataParallel  # noqa: E402
from shardopt.optim import OSS  # noqa: E402
from shardopt.testing import run_ranks  # noqa: E402


def _run(rank: int, args: argparse.Namespace, delay: int | None) -> dict[str, list[float]]:
    """One training run; the iteration times (and without delay, forward+backward and step times)."""
    config = GPTConfig(seq_len=args.seq, dim=args.dim, num_layers=args.layers, num_heads=8)
    model = build_model(config)
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, offload="cpu", delay_update_after=delay,
              split_large_params=False, lr=1e-4, fused=True)
    wrapped = ShardedDataParallel(model, opt) if args.stage == "zero2" else DDP(model)
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, list[float]] = {"iteration": [], "forward_backward": [], "step": [], "finish": []}
    for i in range(args.warmup + args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen)
        start = time.perf_counter()
        opt.zero_grad()
        wrapped(tokens[:, :-1], tokens[:, 1:]).backward()
        middle = time.perf_counter()
        opt.finish_update()  # what step() does first: wait for the last host step, write it, gather
        finished = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        if i >= args.warmup:
            out["iteration"].append(end - start)
            out["forward_backward"].append(middle - start)
            out["finish"].append(finished - middle)
            out["step"].append(end - finished)
    opt.finish_update()
    del wrapped, opt, model  # before the process group goes (a DDP freed after it can hang)
    gc.collect()
    return out


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    torch.set_num_threads(args.threads)
    pooled: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    for _ in range(args.rounds):
        for name, delay in (("off", None), ("on", 0)):
            for key, values in _run(rank, args, delay).items():
                pooled[name].setdefault(key, []).extend(values)
    return pooled


def main() -> None:
    args = ARGS.parse_args()
    params = GPTConfig(seq_len=args.seq, dim=args.dim, num_layers=args.layers, num_heads=8).num_params()
    results = run_ranks(_rank, args.world_size, args, timeout_s=1800, threads_per_rank=args.threads)
    ms = {name: {key: 1e3 * statistics.median([v for r in results for v in r[name][key]])
                 for key in results[0][name]} for name in ("off", "on")}
    slowest = {name: max(1e3 * statistics.median(r[name]["iteration"]) for r in results) for name in ("off", "on")}
    load = os.getloadavg()[0]
    print(f"{params / 1e6:.1f}M parameters, {args.stage} + offload='cpu', fused AdamW, {args.world_size} rank(s) x "
          f"{args.threads} thread(s), batch {args.batch} x {args.seq} tokens, {args.steps} timed iterations x "
          f"{args.rounds} rounds, load average {load:.1f}")
    for name, label in (("off", "without delay"), ("on", "with delay   ")):
        print(f"  {label}: iteration {ms[name]['iteration']:.1f} ms median (forward+backward "
              f"{ms[name]['forward_backward']:.1f}, finish_update() {ms[name]['finish']:.1f}, step() "
              f"{ms[name]['step']:.1f}); slowest rank {slowest[name]:.1f}")
    print(f"  ratio with/without delay: {ms['on']['iteration'] / ms['off']['iteration']:.3f} "
          f"(slowest ranks: {slowest['on'] / slowest['off']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "params": params, "median_ms": ms,
                                               "slowest_rank_ms": slowest, "load_average": load}, indent=1))


if __name__ == "__main__":
    main()
