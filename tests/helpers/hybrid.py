"""Shared by the hybrid ZeRO-2 tests: the one-process reference that sums as hybrid
ShardedDataParallel does (Note [hybrid reduction] in shardopt/nn/data_parallel/replicas.py),
and a per-process-group byte count of the collectives a rank starts."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardopt import comm
from tests.helpers.ddp_arithmetic import add_to_grads


def group_then_replicas(per_rank: Sequence[Sequence[torch.Tensor | None]], shard_size: int) -> list[torch.Tensor | None]:
    """Each rank's gradient times 1/N, summed in rank order inside each shard group of
    ``shard_size`` consecutive ranks, then the group sums added in group order: hybrid
    ZeRO-2's arithmetic (bit-exact when the replicate all-reduce adds in group order, as any
    order does for 2 replicas)."""
    world_size = len(per_rank)
    out: list[torch.Tensor | None] = []
    for i in range(len(per_rank[0])):
        if all(grads[i] is None for grads in per_rank):
            out.append(None)
            continue
        total: torch.Tensor | None = None
        for start in range(0, world_size, shard_size):
            rows = [g[i] if g[i] is not None else torch.zeros_like(next(h[i] for h in per_rank if h[i] is not None))
                    for g in per_rank[start : start + shard_size]]
            part = rows[0] * (1.0 / world_size)
            for row in rows[1:]:
                part = part + row * (1.0 / world_size)
            total = part if total is None else total + part
        out.append(total)
    return out


def hybrid_reference_backward(model: nn.Module, world_size: int, shard_size: int,
                              loss_of: Callable[[nn.Module, int], torch.Tensor]) -> None:
    """One hybrid ZeRO-2 backward in one process, added to ``.grad``."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_rank = [list(torch.autograd.grad(loss_of(model, r), params, allow_unused=True)) for r in range(world_size)]
    add_to_grads(params, group_then_replicas(per_rank, shard_size))


def _group_key(group: comm.ProcessGroup | None) -> tuple[int, ...]:
    return tuple(range(dist.get_world_size())) if group in (None, dist.group.WORLD) else tuple(
        dist.get_process_group_ranks(group))


@contextlib.contextmanager
def bytes_by_group() -> Iterator[dict[tuple[int, ...], float]]:
    """Count, per process group (its global ranks), the bytes this rank sends in the bulk
    collectives shardopt starts: an all-to-all sends every piece but its own; a point-to-point
    exchange its sends; an all-gather its slice to every peer; an all-reduce is counted as a
    ring, 2(n-1)/n of the tensor (what NCCL's ring and gloo's ring algorithms send per rank)."""
    sent: dict[tuple[int, ...], float] = defaultdict(float)
    saved = {name: getattr(comm, name) for name in ("all_to_all_pieces", "all_reduce", "exchange", "all_gather_into")}

    def all_to_all_pieces(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                          group: comm.ProcessGroup | None, *args: Any, **kwargs: Any) -> comm.PendingWork:
        me = comm.group_rank(group)
        sent[_group_key(group)] += sum(t.numel() * t.element_size() for r, t in enumerate(inputs) if r != me)
        return saved["all_to_all_pieces"](outputs, inputs, group, *args, **kwargs)

    def all_reduce(tensor: torch.Tensor, group: comm.ProcessGroup | None, *args: Any, **kwargs: Any) -> comm.PendingWork:
        n = comm.group_size(group)
        sent[_group_key(group)] += 2 * (n - 1) / n * tensor.numel() * tensor.element_size()
        return saved["all_reduce"](tensor, group, *args, **kwargs)

    def exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Any, group: comm.ProcessGroup | None,
                 *args: Any, **kwargs: Any) -> comm.PendingWork:
        sent[_group_key(group)] += sum(t.numel() * t.element_size() for t, _ in sends)
        return saved["exchange"](sends, recvs, group, *args, **kwargs)

    def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: comm.ProcessGroup | None,
                        *args: Any, **kwargs: Any) -> comm.PendingWork:
        sent[_group_key(group)] += (comm.group_size(group) - 1) * input.numel() * input.element_size()
        return saved["all_gather_into"](output, input, group, *args, **kwargs)

    counters = {"all_to_all_pieces": all_to_all_pieces, "all_reduce": all_reduce, "exchange": exchange,
                "all_gather_into": all_gather_into}
    for name, fn in counters.items():
        setattr(comm, name, fn)
    try:
        yield sent
    finally:
        for name, fn in saved.items():
            setattr(comm, name, fn)
