"""Bytes sent per step by process group (world, shard group, replicate group), for ``shardopt bench``.

``/proc/self/io`` (what :class:`shardopt.memory.MemoryRecorder` reads) counts a process's
bytes, not which group they went to. Under hybrid sharding the question is how many bytes
cross the slow link, i.e. go to the replicate group. So while a run is counted,
:class:`GroupBytes` wraps shardopt's tensor collectives in :mod:`shardopt.comm` (every
collective shardopt's own modes launch goes through them) and adds what each call sends
from this rank to the group it names (Note [bytes per group]).

Note [bytes per group]
A call is charged to the kind of its group, read from the group's global ranks: ``world``
(every rank), ``shard`` (S consecutive ranks: a shard group, Note [consecutive shard groups]
in shardopt.hybrid), ``replicate`` (every S-th rank: a replicate group) or ``other``. What
a call sends from this rank, with g ranks in its group, is what the algorithm shardopt uses
on gloo sends: an all-gather sends this rank's slice to the g - 1 others; a reduce-scatter
(an all-to-all on gloo) and an all-to-all send everything but this rank's own slice, (g -
1) / g of the input; a point-to-point exchange sends its sends; a broadcast sends the
tensor from its source; an all-reduce is counted as a ring, 2 (g - 1) / g of the tensor.
DDP's gradient all-reduce runs in C++ and never passes through shardopt.comm, so for a mode
that trains under DDP its bytes are computed, not intercepted: the same ring formula over
the world on the bytes of every gradient, once per optimizer step (DDP reduces on the last
micro-batch only). Object collectives (agreement checks, a few hundred bytes) are not
counted. Peers' modes (torch-zero, fairscale, fsdp2, DeepSpeed) have no per-group figure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from shardopt import comm

__all__ = ["GROUP_KINDS", "GroupBytes", "ddp_step_bytes", "ring_all_reduce_bytes"]

GROUP_KINDS = ("world", "shard", "replicate", "other")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def ring_all_reduce_bytes(nbytes: int, ranks: int) -> float:
    """What one rank sends in a ring all-reduce of ``nbytes`` over ``ranks`` ranks: 2 (g - 1) / g of it."""
    return 2 * (ranks - 1) / ranks * nbytes


def ddp_step_bytes(params: Sequence[torch.Tensor], world_size: int) -> float:
    """DDP's gradient all-reduce per optimizer step, per rank (Note [bytes per group]): computed."""
    return ring_all_reduce_bytes(sum(_nbytes(p) for p in params if p.requires_grad), world_size)


def _sent(name: str, bound: dict[str, Any], size: int, me: int) -> float:
    """Bytes this rank sends in one call of ``comm.<name>``, its arguments by name (Note [bytes per group])."""
    if name == "all_gather_into":
        return (size - 1) * _nbytes(bound["input"])
    if name == "reduce_scatter":
        return _nbytes(bound["input"]) - _nbytes(bound["output"])
    if name == "all_reduce":
        return ring_all_reduce_bytes(_nbytes(bound["tensor"]), size)
    if name == "broadcast":
        return _nbytes(bound["tensor"]) if bound["src"] == me else 0
    if name == "all_to_all":
        element = bound["input"].element_size()
        return (sum(bound["input_splits"]) - bound["input_splits"][me]) * element
    if name == "all_to_all_pieces":
        return sum(_nbytes(t) for rank, t in enumerate(bound["inputs"]) if rank != me)
    if name == "exchange":
        return sum(_nbytes(t) for t, _ in bound["sends"])
    raise AssertionError(f"[rank {comm.group_rank(None)}] no byte rule for comm.{name}")


# The positional parameters of each wrapped collective, up to ``group`` (as in shardopt.comm).
_PARAMS: dict[str, tuple[str, ...]] = {
    "all_gather_into": ("output", "input", "group"),
    "reduce_scatter": ("output", "input", "group"),
    "all_reduce": ("tensor", "group"),
    "broadcast": ("tensor", "src", "group"),
    "all_to_all": ("output", "input", "output_splits", "input_splits", "group"),
    "all_to_all_pieces": ("outputs", "inputs", "group"),
    "exchange": ("sends", "recvs", "group"),
}


class GroupBytes:
    """Bytes this rank sends through shardopt's collectives, by group kind, while installed.

    Args:
        shard_size: S of the run's hybrid layout, or ``None`` (then only ``world`` and
            ``other``).

    Attributes:
        totals: bytes sent so far, by kind in :data:`GROUP_KINDS`.
    """

    def __init__(self, shard_size: int | None) -> None:
        self.shard_size = shard_size
        self.totals: dict[str, float] = dict.fromkeys(GROUP_KINDS, 0.0)
        self._kinds: dict[tuple[int, ...], str] = {}

    def kind(self, group: comm.ProcessGroup | None) -> str:
        """The kind of ``group`` (Note [bytes per group])."""
        world = comm.group_size(None)
        ranks = tuple(range(world)) if group is None or group is dist.group.WORLD else tuple(
            dist.get_process_group_ranks(group))
        if ranks not in self._kinds:
            s = self.shard_size
            if len(ranks) == world:
                self._kinds[ranks] = "world"
            elif s is not None and ranks == tuple(range(ranks[0], ranks[0] + s)) and ranks[0] % s == 0:
                self._kinds[ranks] = "shard"
            elif s is not None and ranks == tuple(range(ranks[0], world, s)) and ranks[0] < s:
                self._kinds[ranks] = "replicate"
            else:
                self._kinds[ranks] = "other"
        return self._kinds[ranks]

    def add(self, kind: str, nbytes: float) -> None:
        """Charge ``nbytes`` to ``kind`` (e.g. DDP's computed all-reduce to ``world``)."""
        self.totals[kind] += nbytes

    def snapshot(self) -> dict[str, float]:
        """A copy of :attr:`totals`."""
        return dict(self.totals)

    def _counting(self, name: str, call: Callable[..., comm.PendingWork]) -> Callable[..., comm.PendingWork]:
        def counted(*args: Any, **kwargs: Any) -> comm.PendingWork:
            bound = dict(zip(_PARAMS[name], args, strict=False)) | kwargs
            group = bound.get("group")
            size = comm.group_size(group)
            if size > 1:
                self.totals[self.kind(group)] += _sent(name, bound, size, comm.group_rank(group))
            return call(*args, **kwargs)

        return counted

    @contextmanager
    def installed(self) -> Iterator[GroupBytes]:
        """Count every call of shardopt's tensor collectives inside the block (any thread),
        then put the originals back."""
        saved = {name: getattr(comm, name) for name in _PARAMS}
        for name, call in saved.items():
            setattr(comm, name, self._counting(name, call))
        try:
            yield self
        finally:
            for name, call in saved.items():
                setattr(comm, name, call)
