"""Runtime state and phase methods of one FSDP unit: unshard, reshard, reduce, summon.

A :class:`Unit` belongs to one ``FullyShardedDataParallel`` wrapper. It owns the flat
parameter handle (``None`` for a unit without parameters, whose phases are no-ops) and
moves it between :class:`~shardopt.nn.fsdp.records.ShardedState` values through checked
transitions. Every transfer goes through :mod:`shardopt.comm`. Its wrapper calls
:meth:`Unit.pre_forward` and :meth:`Unit.post_forward` around the wrapped module; autograd
calls :meth:`Unit.pre_backward` and :meth:`Unit.post_backward`; what all units of one step
share lives in their :class:`~shardopt.nn.fsdp.context.StepContext`.

Note [hook order]
* pre-forward: unshard this unit (waiting on a prefetch), record the execution order in the
  first step, optionally prefetch the next unit, wrap the forward's tensor inputs in an
  identity autograd function whose backward is this unit's post-backward;
* post-forward: with autograd off, reshard (nothing will come back for the gathered
  parameters; the root also reshards any prefetched unit a no-grad forward left gathered);
  with autograd on, hook every output tensor that requires grad with the pre-backward
  hook, then reshard, or, where the strategy keeps parameters to the backward (the root,
  SHARD_GRAD_OP, NO_SHARD), hold: shard views and sharded gradients again, the gathered
  buffer kept (Note [held between forward and backward]), so ``zero_grad``, a
  stray forward or an optimizer step in between behave as with DDP;
* pre-backward (first gradient of any output): queue the step context's end-of-backward
  callback once, unshard, optionally prefetch the unit that runs next in backward;
* post-backward (gradients of all forward inputs computed, counted over every forward of
  the unit in this step): reduce-scatter the unit's gradients and reshard;
* a forward with autograd on while a backward runs (activation checkpointing recomputing
  a unit) only unshards: the unit stays gathered for the backward that needs it;
* end of backward (the context's callback): reduce, in module-tree order, every unit whose
  post-backward could not fire (inputs without grad, e.g. token ids into the root), wait for
  all reductions, write sharded gradients, reshard everything.
Units whose post-backward fires in a hook do so in backward order, which is the same on
every rank, and the rest follow in a fixed order, so collectives match across ranks.

Why not a post-accumulate-grad hook per parameter (the house default): its firing depends
on which parameters this rank used, so a parameter unused on one rank only would make that
rank skip or delay the unit's reduce-scatter while the others issue it (a mismatched
collective). The input hook fires when the unit's backward is done whatever was used, and
missing gradients are reduced as zeros. AccumulateGrad nodes run before other ready nodes,
so every gradient of the unit has landed when it fires.

Note [gradient stash]
Gradients live on the original parameters. While a unit is sharded, ``p.grad`` is this
rank's rows of the reduced gradient shard (matching ``p.data``). Autograd must accumulate into a
*full*-shaped ``p.grad`` during backward, so every switch to full views first moves the
sharded gradients aside (the stash) and every switch back to shard views restores them.
Newly reduced gradients are then added to whatever the restored ``p.grad`` holds, which is
gradient accumulation across steps without ``no_sync``; under ``no_sync`` the full-size
local gradients are summed into :attr:`Unit.grad_accumulator` and reduced at the next
synchronised backward, in the same order DDP adds them (``g1 + g2``, then ``* (1/N)``).

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

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from shardopt import comm
from shardopt.nn.fsdp.flat_param import FlatParamHandle, ParamSlot
from shardopt.nn.fsdp.hooks import PostBackward, has_opaque, tensors_in
from shardopt.nn.fsdp.options import BackwardPrefetch, UnitConfig
from shardopt.nn.fsdp.records import ForwardKind, ShardedState, StepCounts, TrainingState

if TYPE_CHECKING:
    from shardopt.nn.fsdp.context import StepContext

__all__ = ["PendingReduce", "SummonRecord", "Unit", "summon_units"]


@dataclass
class PendingReduce:
    """A unit's gradient reduction in flight.

    Attributes:
        unit: the unit whose gradients are being reduced.
        work: the reduce-scatter (or all-reduce for NO_SHARD) in flight.
        reduced: where the reduced shard lands (reduce dtype).
        trainable: the parameters that required grad when the reduction started.
    """

    unit: Unit
    work: comm.PendingWork
    reduced: torch.Tensor
    trainable: list[tuple[nn.Parameter, ParamSlot]] = field(default_factory=list)


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
        self.gathered: torch.Tensor | None = None
        """The rank-major buffer that all-gather fills, until unpacked (Note [flat parameter layout])."""
        self.grad_accumulator: torch.Tensor | None = None
        """Full-size local gradients summed under ``no_sync``, not yet reduced."""
        self.stash: list[torch.Tensor | None] = []
        """Sharded gradients moved aside while full views are in use (Note [gradient stash])."""
        self.held_versions: list[int] = []
        """The parameters' version counters when the unit became HELD (Note [held between
        forward and backward]); the held buffer is current while they are unchanged."""
        self.counts = StepCounts()
        """This step's forward/backward bookkeeping, reset by :meth:`reset_step_`."""
        self.training_state = TrainingState.IDLE
        self.context: StepContext | None = None
        """The per-step state shared with every unit of the root's tree (set by :meth:`attach`)."""
        self.is_root: bool | None = None
        """Whether this unit's wrapper is the root; ``None`` until the root's first forward."""
        self.prefetched = False
        """Gathered by a prefetch and not yet used by a forward or backward."""

    @property
    def rank(self) -> int:
        """This process's rank in the shard group (for messages)."""
        return self.config.shard_rank

    def _label(self, phase: str) -> str:
        return f"shardopt::fsdp::{phase}::{self.name or 'root'}"

    # ----------------------------------------------------------------- hook-driven steps
    def attach(self, context: StepContext, is_root: bool) -> None:
        """Join the root's per-step context (the root's first forward does this for every unit)."""
        self.context = context
        self.is_root = is_root

    def _ctx(self) -> StepContext:
        if self.context is None:
            raise AssertionError(f"[rank {self.rank}] FSDP unit {self.name!r} runs without a step context")
        return self.context

    def pre_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any, ForwardKind]:
        """Before the wrapped module's forward (Note [hook order]): gather, record, prefetch,
        cast inputs to ``param_dtype`` and hook them with the post-backward.

        Returns:
            The (cast, hooked) inputs and the kind of this forward call.

        Raises:
            ValueError: called inside ``summon_full_params``, or a previous backward never
                reached FSDP's hooks (root only).
        """
        if self.training_state is TrainingState.SUMMON_FULL_PARAMS:
            raise ValueError(
                f"forward of FSDP unit {self.name!r} was called inside summon_full_params; "
                "run the forward after leaving the summon_full_params context"
            )
        ctx = self._ctx()
        if self.is_root:
            self._check_unseen_backward()
        with torch.profiler.record_function("shardopt::fsdp::pre_forward"):
            ctx.record(self)
            self.unshard_()
            self.prefetched = False
            if not torch.is_grad_enabled():
                kind = ForwardKind.NO_GRAD
            elif ctx.callback_queued:
                # Its reduction comes from the original forward's hook, or from the
                # end-of-backward callback for reentrant checkpointing.
                kind = ForwardKind.RECOMPUTE
                self.counts.backward_seen = True
            else:
                kind = ForwardKind.TRAINING
                self.counts.forward_calls += 1
                self.training_state = self.training_state.advance(TrainingState.FORWARD_BACKWARD, self.rank)
            if self.config.forward_prefetch:
                ctx.prefetch(self, forward=True)
            param_dtype = self.config.mixed_precision.param_dtype
            if param_dtype is not None:
                args, kwargs = pytree.tree_map_only(
                    torch.Tensor, lambda t: t.to(param_dtype) if t.is_floating_point() else t, (args, kwargs)
                )
            if kind is ForwardKind.TRAINING:
                args, kwargs = self._hook_inputs(args, kwargs)
        return args, kwargs, kind

    def _check_unseen_backward(self) -> None:
        """Fail loudly when a backward ran that FSDP's hooks never saw (its gradients would
        stay unreduced): a unit whose outputs FSDP cannot look into stays gathered to the
        backward, so full gradients on it at the next forward mean no hook ran."""
        if self.handle is None or self.sharded_state is not ShardedState.UNSHARDED:
            return
        if any(p.grad is not None for p in self.handle.params):
            raise ValueError(
                "a backward ran through this FullyShardedDataParallel model without reaching FSDP's hooks, so "
                "its gradients were never reduced; return tensors (or lists, tuples, dicts or dataclasses of "
                "tensors) from forward so FSDP can hook them"
            )

    def _hook_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        flat, spec = pytree.tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        outs = PostBackward.apply(self.post_backward, *[flat[i] for i in idx])
        outs = (outs,) if len(idx) == 1 else outs
        for i, t in zip(idx, outs, strict=True):
            flat[i] = t
        self.counts.hooked_calls += 1
        return pytree.tree_unflatten(flat, spec)  # type: ignore[no-any-return]

    def post_forward(self, out: Any, kind: ForwardKind) -> None:
        """After the wrapped module's forward (Note [hook order]): hook the outputs with the
        pre-backward, then reshard or hold (Note [held between forward and backward])."""
        if kind is ForwardKind.RECOMPUTE:
            return  # stays gathered for the backward that recomputes it
        ctx = self._ctx()
        with torch.profiler.record_function("shardopt::fsdp::post_forward"):
            if kind is ForwardKind.NO_GRAD:
                # Nothing comes back for these parameters: never leave a unit gathered after
                # a no-grad forward, or the next forward would trust stale views (torch PR 110139).
                self.reshard_()
                if self.is_root:
                    for unit in ctx.units:
                        unit.reshard_()
                    ctx.exec_order_done = True
                return
            hooked = False
            for t in tensors_in(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    # Owned by the output tensor: it fires at most once per backward through
                    # it and dies with it, so no handle is kept (a forward without backward
                    # would otherwise leave handles behind).
                    t.register_hook(self.pre_backward)
                    hooked = True
            if self.config.reshard_after_forward and not self.is_root:
                self.reshard_()
            elif hooked or not has_opaque(out):
                self.hold_()
            # else: an output FSDP cannot look into; staying gathered lets the next forward
            # name a backward that never reached the hooks (_check_unseen_backward).
            if self.is_root:
                ctx.exec_order_done = True

    def pre_backward(self, grad: torch.Tensor) -> None:
        """Hook on the forward's outputs: the unit's backward starts (Note [hook order])."""
        ctx = self._ctx()
        ctx.queue_finish()
        with torch.profiler.record_function("shardopt::fsdp::pre_backward"):
            self.counts.backward_seen = True
            self.unshard_()
            self.prefetched = False
            if self.config.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
                ctx.prefetch(self, forward=False)

    def post_backward(self) -> None:
        """The gradients of all the forward's inputs are computed; reduce once every forward
        of this unit in the step has had its backward (Note [hook order])."""
        c = self.counts
        c.post_backward_calls += 1
        if c.reduced or c.hooked_calls < c.forward_calls or c.post_backward_calls < c.forward_calls:
            return  # another forward of this unit still has its backward to run
        with torch.profiler.record_function("shardopt::fsdp::post_backward"):
            self.reduce_()
            if self.config.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
                self._ctx().prefetch(self, forward=False)

    def reduce_(self) -> None:
        """Start this step's gradient reduction and keep it in flight in the step context."""
        ctx = self._ctx()
        ctx.track(self.reduce_grads_(ctx.no_sync))

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
        if self.config.shard_size == 1:  # NO_SHARD in low precision: a local cast, no collective
            handle.alloc_full()
            with torch.no_grad():
                handle.full.copy_(handle.gather_source())
            self._show_full()
            return
        # Rank-major, unpacked into the full buffer when complete (Note [flat parameter layout]).
        self.gathered = torch.empty(handle.layout.padded_numel, dtype=handle.compute_dtype, device=handle.device)
        self.gather = comm.all_gather_into(
            self.gathered, handle.gather_source(), self.config.shard_group, label=self._label("all_gather")
        )
        self.sharded_state = self.sharded_state.advance(ShardedState.GATHERING, self.rank)
        if not async_op:
            self._complete_gather()

    def _complete_gather(self) -> None:
        if self.gather is None:
            raise AssertionError(f"[rank {self.rank}] unit {self.name!r} is GATHERING without a pending gather")
        self._wait(self.gather, "all-gather")
        self.gather = None
        assert self.handle is not None and self.gathered is not None
        self.handle.alloc_full()
        self.handle.unpack(self.gathered, self.handle.full)
        self.gathered = None
        self._show_full()

    def _wait(self, work: comm.PendingWork, what: str) -> None:
        try:
            work.wait()
        except comm.CollectiveError as exc:
            if exc.failed:
                raise  # a rank reported its own failure: that is the cause
            raise exc.with_hint(
                f"If no rank crashed, the usual cause of a failed {what} of FSDP unit {self.name or 'root'!r} is "
                "ranks running different FSDP units in one step (a unit skipped on some ranks by data-dependent "
                "control flow): every rank must run the same units in the same order"
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
        for p, g in zip(handle.params, self.stash, strict=True):
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
        c = self.counts
        return (c.forward_calls > 0 or c.backward_seen) and not c.reduced

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
        self.counts.reduced = True
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
        grads = [fresh.get(id(p)) for p in handle.params]
        if flat is None:
            # One pass into rank-major order: copy each gradient, zeros where there is none
            # (frozen, unused, padding rows), Note [flat parameter layout].
            flat = torch.empty(handle.layout.padded_numel, dtype=handle.compute_dtype, device=handle.device)
            handle.pack(grads, flat, accumulate=False)
        else:
            handle.pack(grads, flat, accumulate=True)
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
        out = torch.empty(handle.layout.shard_numel, dtype=reduce_dtype, device=handle.device)
        # Note [reduce-scatter on gloo] in comm
        work = comm.reduce_scatter(out, send, self.config.shard_group, label=self._label("reduce_scatter"))
        return PendingReduce(self, work, out, trainable)

    def finish_reduce_(self, pending: PendingReduce) -> None:
        """Wait for a reduction and give the reduced shard to the parameters' gradients (set,
        or added to the ones they hold)."""
        self._wait(pending.work, "gradient reduction")
        reduced = pending.reduced
        if self.config.shard_size > 1 and self.config.replicate_size > 1:
            comm.all_reduce(reduced, self.config.replicate_group, label=self._label("all_reduce")).wait()
        assert self.handle is not None
        keep_low = self.config.mixed_precision.keep_low_precision_grads
        master = self.handle.master_dtype
        grads = reduced if keep_low or reduced.dtype == master else reduced.to(master)
        # An offloaded shard's gradients land at the end of backward (Note [offloaded shards] in offload).
        self._ctx().track_download(self.handle.land_grads(grads, pending.trainable))

    def reset_step_(self) -> None:
        """Forget this step's forward/backward bookkeeping (end of backward)."""
        self.counts.reset()

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
        full = handle.unpack(self._gather_flat(handle.shard))
        grads: torch.Tensor | None = None
        if with_grads:
            grad_shard = torch.zeros_like(handle.shard)
            for p, slot in zip(handle.params, handle.layout.slots, strict=True):
                if p.grad is not None:
                    handle.local_of(grad_shard, slot).copy_(p.grad)
            grads = handle.unpack(self._gather_flat(grad_shard))
        if offload_to_cpu:
            full = full.cpu()
            grads = grads.cpu() if grads is not None else None
        record = SummonRecord(full, [p.grad for p in handle.params], visible)
        if visible:
            for p in handle.params:
                p.grad = None
            handle.use_views(handle.views_into(full))
            if grads is not None:
                for p, view in zip(handle.params, handle.views_into(grads), strict=True):
                    if p.requires_grad:
                        p.grad = view
        return record

    def _gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        handle = self.handle
        assert handle is not None
        shard = handle.on_compute(shard)  # an offloaded shard is gathered on the compute device
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
            handle.write_local(record.full, handle.shard)
        handle.use_shard_views()
        for p, g in zip(handle.params, record.grads, strict=True):
            p.grad = g


@contextlib.contextmanager
def summon_units(units: list[Unit], with_grads: bool, visible: bool, offload_to_cpu: bool,
                 writeback: bool) -> Iterator[None]:
    """Summon every unit of ``units`` not already summoned by an enclosing call (in order),
    undo on exit (``summon_full_params``; arguments as :meth:`Unit.summon_` and
    :meth:`Unit.unsummon_`)."""
    entered: list[tuple[Unit, SummonRecord | None]] = []
    try:
        for unit in units:
            if unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
                continue
            record = unit.summon_(with_grads, visible, offload_to_cpu)
            unit.training_state = unit.training_state.advance(TrainingState.SUMMON_FULL_PARAMS, unit.rank)
            entered.append((unit, record))
        yield
    finally:
        for unit, record in entered:
            unit.unsummon_(record, writeback)
            unit.training_state = unit.training_state.advance(TrainingState.IDLE, unit.rank)
