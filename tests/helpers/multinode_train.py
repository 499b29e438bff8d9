"""A worker of the multi-node test, started by torchrun (see :mod:`tests.helpers.multinode`).

Every worker resolves the hybrid layout with one shard group per node
(``shard_size = LOCAL_WORLD_SIZE``), trains each requested mode next to DDP + Adam and
next to a one-process rank-order reference, from the same seeded model on different data per
rank, and reports its node (``GROUP_RANK``, ``LOCAL_RANK``, its agent's pid) and the largest
parameter differences of every mode. Rank 0 gathers the reports and writes the verdict as JSON to ``--out``:
``{"ok": bool, "problems": [...], "reports": [...], "steps": n}``.

Modes:

* ``hybrid_zero1``: DDP over the world + OSS planned over the shard group (exact, see
  ``tests/test_hybrid_zero1.py``);
* ``flat_zero2``: ShardedDataParallel + OSS over the whole world (exact against a one-process
  reference that sums in rank order, as the owners do; within 1e-6 relative of DDP, whose
  ring sums 4 terms in another order: :data:`BOUNDS`);
* ``hybrid_zero2``: ShardedDataParallel + OSS with ``shard_size = LOCAL_WORLD_SIZE``: reduced
  inside the node, then across the nodes (exact against a one-process reference that sums
  inside each node in rank order and then adds the two node sums; within 1e-6 relative of DDP).

Usage: ``python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 ... multinode_train.py
--out verdict.json [--modes hybrid_zero1,flat_zero2] [--steps 5]``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.hybrid import HybridLayout, resolve_layout
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp
from tests.helpers.ddp_arithmetic import reference_backward
from tests.helpers.hybrid import hybrid_reference_backward

LR = 1e-2


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """The loss every mode trains on: rank ``rank``'s batch of step ``step``."""
    return model(rank_batch(rank, step)).pow(2).mean()


def _train_against_references(model: nn.Module, step_of: Callable[[torch.Tensor], None],
                              zero_grad: Callable[[bool], None], rank: int, steps: int,
                              shard_size: int | None = None) -> dict[str, float]:
    """Train ``model`` with ``step_of`` next to DDP + Adam and next to a one-process reference
    (every rank's gradient times 1/N, summed in rank order, or with ``shard_size`` inside each
    shard group and then across groups, then Adam); the largest |parameter difference| against each."""
    world_size = dist.get_world_size()
    ddp_model, single = seeded_mlp(), seeded_mlp()
    ddp_opt, single_opt = (torch.optim.Adam(m.parameters(), lr=LR) for m in (ddp_model, single))
    ddp = DDP(ddp_model)
    for step in range(steps):
        set_to_none = step % 2 == 0
        for o in (ddp_opt, single_opt):
            o.zero_grad(set_to_none=set_to_none)
        zero_grad(set_to_none)
        x = rank_batch(rank, step)
        ddp(x).pow(2).mean().backward()
        ddp_opt.step()
        if shard_size is None:
            reference_backward(single, world_size, functools.partial(_loss, step=step))
        else:
            hybrid_reference_backward(single, world_size, shard_size, functools.partial(_loss, step=step))
        single_opt.step()
        step_of(x)
    del ddp  # freed before the process group goes (torch 2.13 + gloo can block otherwise)
    scale = max(p.detach().abs().max().item() for p in ddp_model.parameters())
    vs_ddp = max_abs_diff(model.parameters(), ddp_model.parameters())
    return {"vs_ddp": vs_ddp, "vs_ddp_relative": vs_ddp / scale,
            "vs_reference": max_abs_diff(model.parameters(), single.parameters())}


def hybrid_zero1(layout: HybridLayout, rank: int, steps: int) -> dict[str, float]:
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=layout.shard_group, lr=LR)
    ddp = DDP(model)

    def step_of(x: torch.Tensor) -> None:
        ddp(x).pow(2).mean().backward()
        opt.step()

    return _train_against_references(model, step_of, lambda none: opt.zero_grad(set_to_none=none), rank, steps)


def flat_zero2(layout: HybridLayout, rank: int, steps: int) -> dict[str, float]:
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=LR)
    sdp = ShardedDataParallel(model, opt)

    def step_of(x: torch.Tensor) -> None:
        sdp(x).pow(2).mean().backward()
        opt.step()

    return _train_against_references(model, step_of, lambda none: opt.zero_grad(set_to_none=none), rank, steps)


def hybrid_zero2(layout: HybridLayout, rank: int, steps: int) -> dict[str, float]:
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, shard_size=layout.shard_size, lr=LR)
    sdp = ShardedDataParallel(model, opt)
    if opt.layout is None or opt.layout.tiling != layout.tiling:
        raise AssertionError(f"[rank {rank}] OSS(shard_size=...) built {opt.layout}, expected {layout.tiling}")

    def step_of(x: torch.Tensor) -> None:
        sdp(x).pow(2).mean().backward()
        opt.step()

    try:
        return _train_against_references(model, step_of, lambda none: opt.zero_grad(set_to_none=none), rank, steps,
                                          shard_size=layout.shard_size)
    finally:
        sdp.close()


MODES: dict[str, Callable[[HybridLayout, int, int], dict[str, float]]] = {
    "hybrid_zero1": hybrid_zero1,
    "flat_zero2": flat_zero2,
    "hybrid_zero2": hybrid_zero2,
}


# What each mode must meet, per measure: 0.0 where the arithmetic is the reference's.
BOUNDS: dict[str, dict[str, float]] = {
    # DDP all-reduces over the world; OSS steps the same numbers elementwise: DDP's bits.
    "hybrid_zero1": {"vs_ddp": 0.0},
    # Owners sum the N copies in rank order (Note [reduce-scatter on gloo] in shardopt.comm):
    # the one-process rank-order reference's bits. gloo's ring all-reduce in DDP adds the 4
    # fp32 terms in another order, a few ulps per step (2.98e-08, 8.3e-08 relative, after 5
    # Adam steps): the relative bound of the ShardedDataParallel tests beyond 2 ranks.
    "flat_zero2": {"vs_reference": 0.0, "vs_ddp_relative": 1e-6},
    # Inside the node in rank order, then the two node sums (two terms commute): the
    # group-then-replicas reference's bits (Note [hybrid reduction] in
    # shardopt/nn/data_parallel/replicas.py); DDP's ring order as for flat_zero2.
    "hybrid_zero2": {"vs_reference": 0.0, "vs_ddp_relative": 1e-6},
}


def _problems(reports: list[dict[str, Any]], layout: HybridLayout) -> list[str]:
    """What is wrong with the gathered reports: node structure, then parity."""
    problems = []
    for shard_ranks in layout.tiling.shard_groups:
        nodes = {(reports[r]["group_rank"], reports[r]["agent_pid"]) for r in shard_ranks}
        if len(nodes) != 1:
            problems.append(f"shard group {list(shard_ranks)} spans nodes {sorted(nodes)}")
    if len({r["agent_pid"] for r in reports}) != layout.num_replicas:
        problems.append(f"expected {layout.num_replicas} agents, ranks report {[r['agent_pid'] for r in reports]}")
    for r in reports:
        for mode, diffs in r["max_abs_diff"].items():
            for key, bound in BOUNDS[mode].items():
                if not diffs[key] <= bound:
                    problems.append(f"rank {r['rank']} {mode}: {key} = {diffs[key]} > {bound}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        rank = dist.get_rank()
        layout = resolve_layout(shard_size=int(os.environ["LOCAL_WORLD_SIZE"]))
        report = {
            "rank": rank, "group_rank": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "agent_pid": os.getppid(),
            "shard_ranks": list(layout.shard_ranks), "replicate_ranks": list(layout.replicate_ranks),
            "max_abs_diff": {mode: MODES[mode](layout, rank, args.steps) for mode in args.modes.split(",")},
        }
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        if rank == 0:
            problems = _problems(reports, layout)
            with open(args.out, "w") as f:
                json.dump({"ok": not problems, "problems": problems, "reports": reports, "steps": args.steps}, f)
        for r in reports if rank == 0 else []:
            print(f"rank {r['rank']}: node {r['group_rank']} local rank {r['local_rank']} agent {r['agent_pid']} "
                  f"shard group {r['shard_ranks']} diffs {r['max_abs_diff']}", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
