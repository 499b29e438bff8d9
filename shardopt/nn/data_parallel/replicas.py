"""Hybrid ZeRO-2: ShardedDataParallel's reduction across replicas, and which reductions a
backward runs.

ShardedDataParallel reads its :class:`~shardopt.hybrid.HybridLayout` from its ``OSS``
(:func:`layout_of`) and hands the :class:`~shardopt.nn.data_parallel.reduction_queue.ReductionQueue`
a :class:`Replicas`; the queue keeps a :class:`ReplicaReduction` for each bucket part in flight
across the replicate group and a :class:`DeferredSums` for the accumulation mode that skips
the replicate group. :class:`SyncScope` is the wrapper's accumulation state.

Note [hybrid reduction]
Under a layout of R shard groups of S ranks (N = S * R), a bucket is reduced in two stages.
First, inside the shard group, as flat ZeRO-2 does over its group (Note [reduce to owner] in
``grad_buckets``): every rank copies its gradient in multiplied by ``1/N`` (not ``1/S``:
``GradBucket``'s scale, set by ``ReductionQueue`` from ``Replicas.world_size``), and the owner
sums the S copies in shard-group rank order into its part of the bucket (``finish_sum``: its
rows, then one "used" flag per entry). Second, that part, flags included, is all-reduced
(sum) across the replicate group, the R ranks at the same position of every shard group,
which own the same rows: one ``comm.all_reduce`` per bucket, launched when the in-group sum
is done and waited in FIFO order at the end of backward, so it overlaps the next buckets'
in-group exchanges (gloo runs each group's collectives on its own thread). The owner's
gradient is then ``sum_g (sum_s g_{g,s} * (1/N))``: the mean over all N ranks, summed in
shard-group rank order and then across replicas in the backend's order (for R = 2 the two
terms commute, so every replica holds the same bits and a one-process reference that adds
``(g0/N + g1/N) + (g2/N + g3/N)`` is bit-exact). With 1/N a power of two the scaling is
exact, so at 2 groups of 2 only the order of the additions differs from DDP's ring. The
summed flags count the ranks of the whole world that used an entry, so "unused everywhere"
means what it means flat. The part travels in the gradient dtype (a master's fp32 with
``master_dtype``, whatever ``reduce_dtype`` the in-group wire uses).

Bytes: the in-group stage sends (S-1)/S of a bucket per rank inside the node; the replicate
stage all-reduces 1/S of it, a ring sending 2(R-1)/R of that per rank across nodes. Flat
ZeRO-2 over N ranks sends (N-1)/N of the bucket and gathers (N-1)/N of the parameters, all
of which may cross nodes; at N = 4, S = 2 the replicate bytes are 1/3 of flat's per step.

Accumulation (:class:`SyncScope`): ``no_sync`` runs neither stage (local sums, as flat).
``no_replicate_sync`` runs the in-group stage every micro-step but adds the owner's part
into a per-bucket sum (:class:`DeferredSums`) instead of all-reducing it; the first backward
outside the context (or ``reduce()``) adds that sum into its own in-group part and
all-reduces the total once: the replicate group is used once per window. The sums are kept
beside the optimizer's gradient holder rather than in it, so a holder only ever holds
gradients already reduced across replicas, and accumulating across windows without
``zero_grad`` stays DDP's arithmetic (the held sum is added once, before the one all-reduce).

Clipping and the scaler: after the replicate stage the R replicas of an owner hold the same
gradient, so the global norm is the norm over one shard group (OSS exchanges the per-owner
norms over its group, the shard group). ``ShardedGradScaler`` agrees on inf over the whole
world under a layout, so an inf on any rank of any replica skips the step everywhere even in
a window whose replicate stage has not run yet.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardopt import comm
from shardopt.hybrid import MESH_DIM_NAMES, HybridLayout, plan_tiling
from shardopt.nn.data_parallel.grad_buckets import GradBucket
from shardopt.optim.oss import OSS

__all__ = ["DeferredSums", "ReplicaReduction", "Replicas", "SyncScope", "layout_of", "mismatch"]


class SyncScope(enum.Enum):
    """Which reductions the next backward runs (Note [hybrid reduction])."""

    ALL = "all"
    """Inside the shard group and across replicas (the default; flat: the one group)."""
    SHARD_GROUP = "shard_group"
    """Inside the shard group only; the replicate stage waits (``no_replicate_sync``)."""
    NONE = "none"
    """Neither: local sums (``no_sync``)."""


@dataclass(frozen=True)
class Replicas:
    """The replicate stage of a hybrid layout, as the reduction queue needs it.

    Attributes:
        group: this rank's replicate group.
        world_size: N = S * R, the ranks every gradient is averaged over.
    """

    group: comm.ProcessGroup
    world_size: int


@dataclass
class ReplicaReduction:
    """One bucket's owner part being all-reduced across the replicate group.

    Attributes:
        bucket: the bucket whose part it is (its :meth:`GradBucket.items` name the entries).
        total: the part (rows then flags), summed in place; the gradients handed over are its views.
        pending: the all-reduce; after ``wait()`` it keeps nothing alive.
    """

    bucket: GradBucket
    total: torch.Tensor
    pending: comm.PendingWork


class DeferredSums:
    """Per bucket, the owner's in-group parts of a ``no_replicate_sync`` window, summed in
    micro-step order (Note [hybrid reduction])."""

    def __init__(self) -> None:
        self._sums: dict[int, torch.Tensor] = {}

    def __bool__(self) -> bool:
        return bool(self._sums)

    def add(self, index: int, total: torch.Tensor) -> None:
        """Add bucket ``index``'s in-group part of one micro-step."""
        held = self._sums.get(index)
        self._sums[index] = total if held is None else held.add_(total)

    def take(self, index: int) -> torch.Tensor | None:
        """Bucket ``index``'s sum so far, forgotten here."""
        return self._sums.pop(index, None)

    def clear(self) -> None:
        """Drop every sum (``zero_grad``, a re-plan)."""
        self._sums.clear()


def mismatch(layout: HybridLayout | None, process_group: object, device_mesh: object, shard_size: object,
             world_size: int) -> str | None:
    """What is wrong with the layout ShardedDataParallel was given next to its OSS's, or
    ``None`` (nothing given, or the same groups). Local; the caller makes every rank raise.

    Args:
        layout: the optimizers' layout (``None``: flat).
        process_group: ShardedDataParallel's ``process_group`` (a pair names a layout).
        device_mesh: its ``device_mesh``.
        shard_size: its ``shard_size``.
        world_size: ranks in the world.
    """
    pair = isinstance(process_group, (tuple, list))
    given = [name for name, value in (("process_group=(shard_group, replicate_group)", process_group if pair else None),
                                      ("device_mesh", device_mesh), ("shard_size", shard_size)) if value is not None]
    if not given:
        return None
    fix = ("pass the layout to OSS(...) once and leave ShardedDataParallel's process_group, device_mesh and shard_size "
           "unset (it takes its OSS's), or pass both the same layout")
    ours = None if layout is None else (list(map(list, layout.tiling.shard_groups)), list(layout.shard_ranks),
                                        list(layout.replicate_ranks))
    if len(given) > 1:
        return f"ShardedDataParallel got {given}: name the hybrid layout one way; {fix}"
    try:
        if shard_size is not None:
            tiling = plan_tiling(world_size, shard_size)  # type: ignore[arg-type]  # checked there
            theirs: object = list(map(list, tiling.shard_groups))
            ours_part: object = None if ours is None else ours[0]
        else:
            if device_mesh is not None:
                if not isinstance(device_mesh, DeviceMesh) or device_mesh.mesh_dim_names != MESH_DIM_NAMES:
                    return (f"ShardedDataParallel's device_mesh must be a 2-D DeviceMesh with dimensions "
                            f"{MESH_DIM_NAMES}, got {device_mesh!r}; {fix}")
                groups: list[Any] = [device_mesh.get_group("shard"), device_mesh.get_group("replicate")]
            else:
                groups = list(process_group)  # type: ignore[call-overload]  # a pair, checked above
            theirs = [dist.get_process_group_ranks(g) for g in groups]
            ours_part = None if ours is None else [ours[1], ours[2]]
    except (TypeError, ValueError, RuntimeError) as exc:
        return f"ShardedDataParallel's {given[0]} is not a layout: {exc}"
    if ours_part == theirs:
        return None
    has = "is flat (no layout)" if ours is None else f"has shard groups {ours[0]} (this rank's pair {ours[1:]})"
    return f"ShardedDataParallel was given {given[0]} naming {theirs}, but its OSS {has}; {fix}"


def layout_of(optimizers: list[OSS]) -> HybridLayout | None:
    """The one layout of ``optimizers`` (``None``: all flat).

    Raises:
        ValueError: the optimizers have different layouts (one flat, or other shard groups).
    """
    layouts = [o.layout for o in optimizers]
    described = sorted({repr(None if lay is None else lay.tiling) for lay in layouts})
    if len(described) > 1:
        raise ValueError(
            f"the sharded optimizers have different hybrid layouts ({'; '.join(described)}); the buckets are "
            "reduced over one shard group and one replicate group: build every OSS with the same device_mesh, "
            "group pair or shard_size")
    return layouts[0]
