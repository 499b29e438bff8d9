"""Runtime state and phase methods of one FSDP unit: unshard, reshard, reduce, summon.

A :class:`Unit` belongs to one ``FullyShardedDataParallel`` wrapper. It owns the flat
parameter handle (``None`` for a unit without parameters, whose phases are no-ops) and
moves it between :class:`~shardopt.nn.fsdp.state.ShardedState` values through checked
transitions. Every transfer goes through :mod:`shardopt.comm`.

Note [gradient stash]
Gradients live on the original parameters. While a unit is sharded, ``p.grad`` is a 1-D
piece of the reduced gradient shard (matching ``p.data``). Autograd must accumulate into a
*full*-shaped ``p.grad`` during backward, so every switch to full views first moves the
sharded gradients aside (the stash) and every switch back to shard views restores them.
Newly reduced gradients are then added to whatever the restored ``p.grad`` holds, which is
gradient accumulation across steps without ``no_sync``; under ``no_sync`` the full-size
local gradients are summed into :attr:`Unit.grad_accumulator` and reduced at the next
synchronised backward, in the same order DDP adds them (``g1 + g2``, then ``* (1/N)``).

Note [reduce-scatter on gloo]
gloo's reduce-scatter costs as much as an all-reduce (every rank sends the whole buffer).
On CPU tensors (gloo) the unit instead sends shard ``r`` of its gradient buffer to rank
``r`` with one ``all_to_all`` and adds the ``N`` received copies in rank order, so each rank
sends ``(N-1)/N`` of the buffer: FULL_SHARD then sends 1.5x what DDP's ring all-reduce does
per step (two all-gathers and this), SHARD_GRAD_OP 1.0x, as in the ZeRO paper. With two
ranks the sum of two copies is DDP's sum, bit for bit. CUDA tensors use the backend's
reduce-scatter.

Note [held between forward and backward]
A unit that keeps its gathered parameters from forward to backward (the root, every unit
under SHARD_GRAD_OP and NO_SHARD) used to stay UNSHARDED in between, with its sharded
gradients in the stash. Then nothing between forward and backward saw the real gradients
or parameters: ``zero_grad`` (which Lightning calls exactly there) cleared nothing and the
stash added the previous step's gradients back, and an ``optimizer.step()`` after a stray
forward (one whose output is never backpropagated) found full-shaped parameters without
gradients and skipped them. Now the post-forward puts the original parameters back on
their shard views and their sharded gradients back on them (state HELD) and keeps only
the gathered buffer. The pre-backward points them at the buffer again without a gather,
as long as no parameter changed in place since (its version counter, bumped by every
in-place update such as an optimizer step); otherwise it gathers anew. Autograd saved the
parameters themselves for backward, so they see whatever they point at when it runs.

Note [average like DDP]
DDP multiplies each local gradient by ``1/N`` (a reciprocal, not a division) and then sums
over ranks. The reduction here does exactly that before the reduce-scatter (or all-reduce),
so with two ranks in fp32 the result is bit-identical to DDP's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from shardopt import comm
from shardopt.nn.fsdp.flat_param import FlatParamHandle, ParamSlot
from shardopt.nn.fsdp.state import ShardedState, UnitConfig

__all__ = ["PendingReduce", "SummonRecord", "Unit"]

logger = logging.getLogger(__name__)


@dataclass
class PendingReduce:
    """A unit's gradient reduction in flight.

    Attributes:
        unit: the unit whose gradients are being reduced.
        work: the reduce-scatter (or all-reduce for NO_SHARD) in flight.
        reduced: where the reduced shard lands (reduce dtype); on gloo every rank's copy of
            this rank's shard, one row per rank, summed by ``finish_reduce_``.
        trainable: the parameters that required grad when the reduction started.
    """

    unit: Unit
    work: comm.PendingWork
    reduced: torch.Tensor
    trainable: list[tuple[nn.Parameter, ParamSlot]] = field(default_factory=list)
    rows: int = 1
    """How many ranks' copies of the shard ``reduced`` holds, still to be summed (gloo)."""


@dataclass
class SummonRecord:
    """What ``summon_full_params`` changed on one unit, to undo on exit.

    Attributes:
        full: the gathered flat parameter in the master dtype.
        grads: the sharded gradients moved aside while full views are in use.
        visible: whether this rank points the parameters at ``full``.
    """

    full: torch.Tensor
    grads: list[torch.Tensor | None]
    visible: bool


class Unit:
    """Per-unit runtime state with the phase methods ``unshard_``/``reshard_``/``reduce_grads_``.

    How it works: see Note [flat parameter layout] (in ``flat_param``), Note [gradient
    stash] and Note [average like DDP].

    Args:
        name: the wrapped module's qualified name, for messages and profiler labels.
        handle: the unit's flat parameter, or ``None`` when it manages no parameters.
        config: the shared unit configuration.
    """

    def __init__(self, name: str, handle: FlatParamHandle | None, config: UnitConfig) -> None:
        self.name = name
        self.handle = handle
        self.config = config
        self.sharded_state = ShardedState.SHARDED
        self.gather: comm.PendingWork | None = None
        """The prefetch all-gather in flight (state GATHERING), else ``None``."""
        self.grad_accumulator: torch.Tensor | None = None
        """Full-size local gradients summed under ``no_sync``, not yet reduced."""
        self.stash: list[torch.Tensor | None] = []
        """Sharded gradients moved aside while full views are in use (Note [gradient stash])."""
        self.held_versions: list[int] = []
        """The parameters' version counters when the unit became HELD (Note [held between
        forward and backward]); the held buffer is current while they are unchanged."""
        self.forward_calls = 0
        """Forwards with autograd on since the last backward finished."""
        self.hooked_calls = 0
        """Of those, forwards whose inputs carry the post-backward hook."""
        self.post_backward_calls = 0
        """Post-backward hooks that fired in the current backward."""
        self.reduced = False
        """Whether this step's gradients have been reduced (or accumulated under no_sync)."""
        self.backward_seen = False
        """A gradient of one of this unit's outputs arrived in the current backward (set even
        when no forward is pending, e.g. a second backward through a retained graph)."""
        self.prefetched = False
        """Gathered by a prefetch and not yet used by a forward or backward."""

    @property
    def rank(self) -> int:
        """This process's rank in the shard group (for messages)."""
        return self.config.shard_rank

    def _label(self, phase: str) -> str:
        return f"shardopt::fsdp::{phase}::{self.name or 'root'}"

    # ----------------------------------------------------------------- unshard / reshard
    def unshard_(self, async_op: bool = False) -> None:
        """Gather the full parameters and point the originals at them.

        Args:
            async_op: only start the all-gather (a prefetch); a later call completes it.
        """
        handle = self.handle
        if handle is None or self.sharded_state is ShardedState.UNSHARDED:
            return
        if self.sharded_state is ShardedState.HELD:
            if self.held_versions == [p._version for p in handle.params]:
                self._show_full()  # the forward's gathered values are still current
                return
            self.reshard_()  # a parameter changed in place since the forward: gather anew
        if self.sharded_state is ShardedState.GATHERING:
            if not async_op:
                self._complete_gather()
            return
        if handle.full_is_shard:
            self._show_full()
            return
        handle.alloc_full()
        if self.config.shard_size == 1:  # NO_SHARD in low precision: a local cast, no collective
            with torch.no_grad():
                handle.full.copy_(handle.gather_source())
            self._show_full()
            return
        self.gather = comm.all_gather_into(
            handle.full, handle.gather_source(), self.config.shard_group, label=self._label("all_gather")
        )
        self.sharded_state = self.sharded_state.advance(ShardedState.GATHERING, self.rank)
        if not async_op:
            self._complete_gather()

    def _complete_gather(self) -> None:
        if self.gather is None:
            raise AssertionError(f"[rank {self.rank}] unit {self.name!r} is GATHERING without a pending gather")
        self._wait(self.gather, "all-gather")
        self.gather = None
        self._show_full()

    def _wait(self, work: comm.PendingWork, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise RuntimeError(
                f"[rank {self.rank}] the {what} of FSDP unit {self.name or 'root'!r} did not complete: {exc}. "
                "The usual cause is ranks running different FSDP units in one step (a unit skipped on some "
                "ranks by data-dependent control flow): every rank must run the same units in the same order"
            ) from exc

    def _show_full(self) -> None:
        assert self.handle is not None
        self.stash = [p.grad for p in self.handle.params]
        for p in self.handle.params:
            p.grad = None
        self.handle.use_views(self.handle.full_views)
        self.sharded_state = self.sharded_state.advance(ShardedState.UNSHARDED, self.rank)

    def _show_shards(self) -> None:
        """Point the originals back at their shard pieces and give them their sharded gradients."""
        handle = self.handle
        assert handle is not None
        if any(p.grad is not None for p in handle.params):
            # Gradients on full views are this step's, not yet reduced (Note [gradient stash]).
            raise ValueError(
                f"[rank {self.rank}] FSDP unit {self.name or 'root'!r} holds gradients that were never reduced: a "
                "backward ran without reaching FSDP's hooks. Return tensors (or lists, tuples, dicts or "
                "dataclasses of tensors) from forward so FSDP can hook them"
            )
        handle.use_shard_views()
        for p, g in zip(handle.params, self.stash):
            p.grad = g
        self.stash = []
        self.prefetched = False

    def hold_(self) -> None:
        """After a forward: shard views again, the gathered buffer kept for the backward
        (Note [held between forward and backward]).

        Raises:
            ValueError: as :meth:`reshard_`.
        """
        if self.handle is None or self.sharded_state is not ShardedState.UNSHARDED:
            return
        self._show_shards()
        self.held_versions = [p._version for p in self.handle.params]
        self.sharded_state = self.sharded_state.advance(ShardedState.HELD, self.rank)

    def reshard_(self) -> None:
        """Point the originals back at their shard pieces, free the full buffer, restore grads.

        Raises:
            ValueError: the full views carry gradients no reduction took (a backward that
                FSDP's hooks never saw); dropping them silently would be wrong.
        """
        handle = self.handle
        if handle is None or self.sharded_state is ShardedState.SHARDED:
            return
        if self.sharded_state is ShardedState.GATHERING:
            self._complete_gather()
        if self.sharded_state is ShardedState.UNSHARDED:
            self._show_shards()
        handle.free_full()
        self.held_versions = []
        self.sharded_state = self.sharded_state.advance(ShardedState.SHARDED, self.rank)

    # ----------------------------------------------------------------- gradients
    def needs_reduction(self) -> bool:
        """Whether this step's backward still owes this unit a reduction (same on all ranks)."""
        return (self.forward_calls > 0 or self.backward_seen) and not self.reduced

    def reduce_grads_(self, no_sync: bool) -> PendingReduce | None:
        """Collect this step's local gradients, reshard, and start their reduction.

        Parameters that require grad but got none this step contribute zeros, so every rank
        issues the same collective whatever it used. Under ``no_sync`` the gradients are
        accumulated locally instead (Note [gradient stash]).

        Args:
            no_sync: accumulate without communicating.

        Returns:
            The reduction in flight, or ``None`` (no trainable parameters, or ``no_sync``).
        """
        self.reduced = True
        handle = self.handle
        if handle is None:
            return None
        trainable = handle.trainable()
        if not trainable:
            self.reshard_()
            return None
        # Only an unsharded unit can have received new gradients (Note [gradient stash]).
        fresh = {id(p): p.grad for p, _ in trainable} if self.sharded_state is ShardedState.UNSHARDED else {}
        flat = self.grad_accumulator
        if flat is None:
            # One pass: copy each gradient, zero only what has none (frozen, unused, padding).
            flat = torch.empty(handle.layout.padded_numel, dtype=handle.compute_dtype, device=handle.device)
            flat[handle.layout.total_numel :].zero_()
            for p, slot in zip(handle.params, handle.layout.slots):
                grad = fresh.get(id(p))
                piece = flat[slot.offset : slot.offset + slot.numel]
                if grad is not None:
                    piece.copy_(grad.reshape(-1))
                else:
                    piece.zero_()
        else:
            for p, slot in trainable:
                grad = fresh.get(id(p))
                if grad is not None:
                    flat[slot.offset : slot.offset + slot.numel].add_(grad.reshape(-1))
        for p, _ in trainable:
            if id(p) in fresh:
                p.grad = None
        self.reshard_()
        if no_sync:
            self.grad_accumulator = flat
            return None
        self.grad_accumulator = None
        reduce_dtype = self.config.mixed_precision.reduce_dtype or handle.compute_dtype
        send = flat if flat.dtype == reduce_dtype else flat.to(reduce_dtype)
        send.mul_(1.0 / self.config.world_size)  # Note [average like DDP]
        if self.config.shard_size == 1:
            work = comm.all_reduce(send, self.config.replicate_group, label=self._label("all_reduce"))
            return PendingReduce(self, work, send, trainable)
        if handle.device.type == "cpu":  # gloo: Note [reduce-scatter on gloo]
            shard = handle.layout.shard_numel
            recv = torch.empty_like(send)
            splits = [shard] * self.config.shard_size
            work = comm.all_to_all(
                recv, send, splits, splits, self.config.shard_group, label=self._label("reduce_scatter")
            )
            return PendingReduce(self, work, recv, trainable, rows=self.config.shard_size)
        out = torch.empty(handle.layout.shard_numel, dtype=reduce_dtype, device=handle.device)
        work = comm.reduce_scatter(out, send, self.config.shard_group, label=self._label("reduce_scatter"))
        return PendingReduce(self, work, out, trainable)

    def finish_reduce_(self, pending: PendingReduce) -> None:
        """Wait for a reduction and add the reduced shard to the parameters' gradients."""
        self._wait(pending.work, "gradient reduction")
        reduced = pending.reduced
        if pending.rows > 1:  # every rank's copy of this shard, summed in rank order
            rows = reduced.view(pending.rows, -1)
            reduced = rows[0].clone()
            for row in rows[1:]:
                reduced.add_(row)
        if self.config.shard_size > 1 and self.config.replicate_size > 1:
            comm.all_reduce(reduced, self.config.replicate_group, label=self._label("all_reduce")).wait()
        assert self.handle is not None
        keep_low = self.config.mixed_precision.keep_low_precision_grads
        master = self.handle.master_dtype
        grads = reduced if keep_low or reduced.dtype == master else reduced.to(master)
        for p, slot in pending.trainable:
            piece = grads[slot.shard_begin : slot.shard_begin + slot.piece_numel]
            if p.grad is None:
                if piece.dtype != p.dtype:
                    p.grad_dtype = None  # keep_low_precision_grads: a grad of another dtype, on purpose
                p.grad = piece
            else:
                p.grad.add_(piece)

    def reset_step_(self) -> None:
        """Forget this step's forward/backward bookkeeping (end of backward)."""
        self.forward_calls = 0
        self.hooked_calls = 0
        self.post_backward_calls = 0
        self.reduced = False
        self.backward_seen = False

    # ----------------------------------------------------------------- summon
    def summon_(self, with_grads: bool, visible: bool, offload_to_cpu: bool) -> SummonRecord | None:
        """Gather the master parameters (and optionally gradients) and show them full-shaped.

        Args:
            with_grads: also gather the sharded gradients into full-shaped ``p.grad``.
            visible: point this rank's parameters at the gathered values (False for the
                non-zero ranks under ``rank0_only``; they still take part in the gathers).
            offload_to_cpu: keep the gathered copy on the CPU.

        Returns:
            What to undo with :meth:`unsummon_`, or ``None`` for a unit without parameters.
        """
        handle = self.handle
        if handle is None:
            return None
        self.reshard_()
        full = self._gather_flat(handle.shard)
        grads: torch.Tensor | None = None
        if with_grads:
            grad_shard = torch.zeros_like(handle.shard)
            for p, slot in zip(handle.params, handle.layout.slots):
                if p.grad is not None:
                    grad_shard[slot.shard_begin : slot.shard_begin + slot.piece_numel].copy_(p.grad)
            grads = self._gather_flat(grad_shard)
        if offload_to_cpu:
            full = full.cpu()
            grads = grads.cpu() if grads is not None else None
        record = SummonRecord(full, [p.grad for p in handle.params], visible)
        if visible:
            for p in handle.params:
                p.grad = None
            handle.use_views(handle.views_into(full))
            if grads is not None:
                for p, view in zip(handle.params, handle.views_into(grads)):
                    if p.requires_grad:
                        p.grad = view
        return record

    def _gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        handle = self.handle
        assert handle is not None
        if self.config.shard_size == 1:
            return shard
        full = torch.empty(handle.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        comm.all_gather_into(full, shard, self.config.shard_group, label=self._label("summon")).wait()
        return full

    def unsummon_(self, record: SummonRecord | None, writeback: bool) -> None:
        """Undo :meth:`summon_`, copying this rank's part of the full values back first."""
        handle = self.handle
        if handle is None or record is None:
            return
        if writeback and record.visible and record.full.data_ptr() != handle.shard.data_ptr():
            lo, hi = handle.shard_range()
            with torch.no_grad():
                handle.shard.copy_(record.full[lo:hi])
        handle.use_shard_views()
        for p, g in zip(handle.params, record.grads):
            p.grad = g
