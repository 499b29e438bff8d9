"""Gradient buckets for ShardedDataParallel: a static plan and the per-iteration buffers.

Bookkeeping only; the one collective goes through :mod:`shardopt.comm`.

Note [reduce to owner]
ZeRO-2 needs each gradient summed onto the one rank that owns its parameter. A bucket holds
several gradients; its send buffer is laid out by destination rank: first the gradients of
the parameters rank 0 owns, then rank 1's, and so on, each destination's part followed by
one "used" flag per parameter. One ``all_to_all`` then sends every rank exactly the part it
owns, from every rank, and the owner adds the ``N`` copies in rank order. Per rank this
sends ``(N-1)/N`` of the bucket, and the post-step all-gather of the updated parameters
sends another ``(N-1)/N`` of the parameters: together the ``2(N-1)/N`` a ring all-reduce
(DDP) sends. gloo's ``reduce`` sends the whole buffer from every rank, and its
reduce-scatter costs as much as an all-reduce, so neither is used on gloo.

The flags make "unused" decisions global without another collective: a parameter whose
flags sum to zero got no gradient on any rank, and its ``.grad`` is left untouched, as DDP
does with ``find_unused_parameters=True``. Stale data cannot be sent: every slot is written
each iteration, by a gradient or by zeros with a zero flag.

The plan must be identical on every rank (the all-to-all splits must agree), so it depends
only on parameter order, shapes, dtypes and owners, never on the order gradients arrive.
Buckets are launched strictly in index order for the same reason.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardopt import comm
from shardopt.buckets import release_storage

__all__ = ["BucketSpec", "BucketState", "GradBucket", "plan_buckets"]


class BucketState(enum.Enum):
    """Where a bucket is in its iteration."""

    EMPTY = "empty"  # no buffer; nothing copied yet this iteration
    FILLING = "filling"  # buffer allocated, some gradients copied in
    IN_FLIGHT = "in_flight"  # all-to-all launched, not yet unpacked


_TRANSITIONS = {
    BucketState.EMPTY: {BucketState.FILLING},
    BucketState.FILLING: {BucketState.IN_FLIGHT},
    BucketState.IN_FLIGHT: {BucketState.EMPTY},
}


@dataclass(frozen=True)
class BucketSpec:
    """The static layout of one bucket (identical on every rank).

    Attributes:
        index: launch order.
        params: the bucket's parameters, grouped by owner (owner 0's first), each group in
            model order.
        owners: owner rank of each entry of ``params``.
        offsets: where each parameter's gradient starts in the send buffer.
        flag_offsets: where each parameter's "used" flag sits in the send buffer.
        splits: elements sent to each rank (its gradients plus its flags).
        wire_dtype: dtype on the wire.
        device: where the buffers live.
    """

    index: int
    params: tuple[torch.nn.Parameter, ...]
    owners: tuple[int, ...]
    offsets: tuple[int, ...]
    flag_offsets: tuple[int, ...]
    splits: tuple[int, ...]
    wire_dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        """Elements in the send buffer."""
        return sum(self.splits)


def plan_buckets(
    params: Sequence[torch.nn.Parameter],
    owners: Sequence[int],
    num_ranks: int,
    cap_numel: int,
    wire_dtype_of: dict[torch.dtype, torch.dtype],
) -> list[BucketSpec]:
    """Pack parameters into buckets of at most ``cap_numel`` gradient elements.

    Parameters are taken in reverse model order (gradients arrive roughly that way in
    backward) and kept apart by (device, dtype). A parameter larger than the cap gets a
    bucket of its own; ``cap_numel=0`` gives every parameter its own bucket.

    Args:
        params: trainable parameters, in model order.
        owners: owner rank of each parameter.
        num_ranks: world size.
        cap_numel: gradient elements per bucket.
        wire_dtype_of: maps a parameter dtype to the dtype it is reduced in (absent: itself).

    Returns:
        The bucket specs, in launch order.
    """
    open_buckets: dict[tuple[str, torch.dtype], list[int]] = {}
    groups: list[list[int]] = []
    for i in reversed(range(len(params))):
        key = (str(params[i].device), params[i].dtype)
        current = open_buckets.get(key)
        size = sum(params[j].numel() for j in current) if current else 0
        if current is None or size + params[i].numel() > cap_numel:
            current = []
            groups.append(current)
            open_buckets[key] = current
        current.append(i)
    specs = []
    for index, members in enumerate(groups):
        ordered = sorted(members, key=lambda j: (owners[j], j))
        offsets, flag_offsets, splits = [], [], []
        cursor = 0
        for rank in range(num_ranks):
            mine = [j for j in ordered if owners[j] == rank]
            start = cursor
            for j in mine:
                offsets.append(cursor)
                cursor += params[j].numel()
            for _ in mine:
                flag_offsets.append(cursor)
                cursor += 1
            splits.append(cursor - start)
        first = params[ordered[0]]
        specs.append(
            BucketSpec(
                index=index,
                params=tuple(params[j] for j in ordered),
                owners=tuple(owners[j] for j in ordered),
                offsets=tuple(offsets),
                flag_offsets=tuple(flag_offsets),
                splits=tuple(splits),
                wire_dtype=wire_dtype_of.get(first.dtype, first.dtype),
                device=first.device,
            )
        )
    return specs


class GradBucket:
    """One bucket's buffers and progress through an iteration.

    Args:
        spec: the static layout.
        rank: this process's rank.
        scale: factor applied to each gradient as it is copied in (``1 / world_size``).
    """

    def __init__(self, spec: BucketSpec, rank: int, scale: float) -> None:
        self.spec = spec
        self._rank = rank
        self._scale = scale
        self._position = {p: k for k, p in enumerate(spec.params)}
        self.state = BucketState.EMPTY
        self._send: torch.Tensor | None = None
        self._filled: set[int] = set()

    def _to(self, state: BucketState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise AssertionError(f"[rank {self._rank}] bucket {self.spec.index}: {self.state.name} -> {state.name}")
        self.state = state

    @property
    def complete(self) -> bool:
        """Every parameter of the bucket has its gradient copied in."""
        return len(self._filled) == len(self.spec.params)

    def holds(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param``'s gradient is already in the bucket this iteration."""
        return self._position[param] in self._filled

    def add(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Copy ``grad * scale`` into the parameter's slot and set its flag."""
        if self.state is BucketState.EMPTY:
            self._send = torch.empty(self.spec.numel, dtype=self.spec.wire_dtype, device=self.spec.device)
            self._to(BucketState.FILLING)
        if self.state is not BucketState.FILLING:
            raise AssertionError(
                f"[rank {self._rank}] a gradient for a parameter of bucket {self.spec.index} arrived after "
                "the bucket was sent: a parameter got two gradients in one backward pass"
            )
        k = self._position[param]
        if k in self._filled:
            raise AssertionError(f"[rank {self._rank}] parameter {k} of bucket {self.spec.index} filled twice")
        assert self._send is not None
        start = self.spec.offsets[k]
        torch.mul(grad.reshape(-1), self._scale, out=self._send[start : start + param.numel()])
        self._send[self.spec.flag_offsets[k]] = 1
        self._filled.add(k)

    def launch(self, group: comm.ProcessGroup | None, num_ranks: int) -> tuple[comm.PendingWork, torch.Tensor]:
        """Zero the slots nobody filled, send, and return (pending work, receive buffer)."""
        if self.state is BucketState.EMPTY:
            self._send = torch.empty(self.spec.numel, dtype=self.spec.wire_dtype, device=self.spec.device)
            self._to(BucketState.FILLING)
        assert self._send is not None
        for k, param in enumerate(self.spec.params):
            if k not in self._filled:
                start = self.spec.offsets[k]
                self._send[start : start + param.numel()].zero_()
                self._send[self.spec.flag_offsets[k]] = 0
        mine = self.spec.splits[self._rank]
        recv = torch.empty(num_ranks * mine, dtype=self.spec.wire_dtype, device=self.spec.device)
        pending = comm.all_to_all(
            recv, self._send, [mine] * num_ranks, self.spec.splits, group, label="shardopt::sdp::reduce"
        )
        self._filled.clear()
        self._to(BucketState.IN_FLIGHT)
        return pending, recv

    def unpack(self, recv: torch.Tensor, num_ranks: int) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        """Sum the received copies (rank order) into this rank's reduced gradients.

        Returns:
            ``(param, grad)`` for each parameter this rank owns in the bucket; ``grad`` is
            ``None`` when no rank had a gradient for it (see Note [reduce to owner]).
        """
        self._to(BucketState.EMPTY)
        try:
            return self._reduced(recv, num_ranks)
        finally:
            # The transfer is complete; see Note [release scratch buffers] in shardopt.buckets.
            release_storage(recv)
            if self._send is not None:
                release_storage(self._send)
                self._send = None

    def _reduced(self, recv: torch.Tensor, num_ranks: int) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
        mine = [k for k, owner in enumerate(self.spec.owners) if owner == self._rank]
        if not mine:
            return []
        width = self.spec.splits[self._rank]
        rows = recv.view(num_ranks, width)
        param_dtype = self.spec.params[mine[0]].dtype
        if rows.dtype != param_dtype:
            rows = rows.to(param_dtype)
        # One pass for the first sum (no clone), then in place; rank order either way.
        total = rows[0] + rows[1] if num_ranks > 1 else rows[0].clone()
        for r in range(2, num_ranks):
            total += rows[r]
        base = self.spec.offsets[mine[0]]
        used = total[self.spec.flag_offsets[mine[0]] - base :].tolist()
        out: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []
        for n, k in enumerate(mine):
            param = self.spec.params[k]
            start = self.spec.offsets[k] - base
            grad = total[start : start + param.numel()].view_as(param) if used[n] > 0 else None
            out.append((param, grad))
        return out
