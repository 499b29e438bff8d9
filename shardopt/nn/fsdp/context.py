"""What every unit of one FSDP model shares during a step: the :class:`StepContext`.

The root wrapper (the outermost one, at its first forward) creates one context and attaches
every unit of its tree to it (Note [hook order] in ``unit``). Units then record
themselves in the execution order, prefetch their successor, hand their reductions in
flight to the context and queue its end-of-backward callback, without any unit or wrapper
reaching into another's attributes.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch

from shardopt.nn.fsdp.records import ShardedState, TrainingState

if TYPE_CHECKING:
    from shardopt.nn.fsdp.offload import PendingDownload
    from shardopt.nn.fsdp.unit import PendingReduce, Unit

__all__ = ["StepContext"]

MAX_REDUCES_IN_FLIGHT = 2
"""Gradient reductions a backward keeps in flight before waiting for the oldest."""


class StepContext:
    """Per-step state shared by all units of one root.

    Args:
        units: every unit of the root's tree, in module order (root first).
    """

    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        """Every unit, in module order: the order of the end-of-backward reductions."""
        self.exec_order: list[Unit] = []
        """Units in the order their forwards ran in the first training step (prefetch order)."""
        self.exec_order_done = False
        """Whether the first forward finished, freezing :attr:`exec_order`."""
        self.callback_queued = False
        """The end-of-backward callback is queued: a backward is running."""
        self.pending: deque[PendingReduce] = deque()
        """Gradient reductions in flight, oldest first."""
        self.no_sync = False
        """Accumulate gradients locally instead of reducing them (``no_sync()``)."""
        self.downloads: deque[PendingDownload] = deque()
        """Offloaded units' reduced gradients on their way to the host, oldest first
        (Note [offloaded shards] in ``offload``), landed at the end of backward."""

    def record(self, unit: Unit) -> None:
        """Add ``unit`` to the execution order while the first forward runs."""
        if not self.exec_order_done and unit not in self.exec_order:
            self.exec_order.append(unit)

    def queue_finish(self) -> None:
        """Queue :meth:`finish_backward` with autograd once per backward."""
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def track(self, pending: PendingReduce | None) -> None:
        """Keep a reduction in flight, finishing the oldest beyond :data:`MAX_REDUCES_IN_FLIGHT`."""
        if pending is None:
            return
        self.pending.append(pending)
        while len(self.pending) > MAX_REDUCES_IN_FLIGHT:
            done = self.pending.popleft()
            done.unit.finish_reduce_(done)

    def track_download(self, pending: PendingDownload | None) -> None:
        """Keep a gradient download until the end of backward; the device buffers of the
        earlier ones go back to the allocator once their copies are done (device-side wait)."""
        if pending is None:
            return
        for earlier in self.downloads:
            earlier.release_source()
        self.downloads.append(pending)

    def prefetch(self, current: Unit, forward: bool) -> None:
        """Start gathering the unit that runs after ``current`` (before it, in backward)."""
        if not self.exec_order_done or current not in self.exec_order:
            return
        i = self.exec_order.index(current) + (1 if forward else -1)
        if not 0 <= i < len(self.exec_order):
            return
        target = self.exec_order[i]
        if target.handle is None or target.sharded_state is not ShardedState.SHARDED:
            return
        if not forward and (target.counts.forward_calls == 0 or target.counts.reduced):
            return  # it did not run forward in this step, or its backward is done
        if current.config.limit_all_gathers and any(u.prefetched for u in self.exec_order):
            return
        target.unshard_(async_op=True)
        target.prefetched = True

    def finish_backward(self) -> None:
        """End of backward: reduce what no hook reduced, wait for every reduction, reshard all."""
        with torch.profiler.record_function("shardopt::fsdp::finish_backward"):
            for unit in reversed(self.units):
                if unit.needs_reduction():
                    unit.reduce_()
            while self.pending:
                done = self.pending.popleft()
                done.unit.finish_reduce_(done)
            if self.downloads:  # the optimizer reads the offloaded gradients on the host next
                while self.downloads:
                    self.downloads.popleft().land()
                for unit in self.units:  # and may write the shards an upload after them reads
                    if unit.handle is not None:
                        unit.handle.settle()
            for unit in self.units:
                unit.reshard_()
                unit.reset_step_()
                unit.training_state = unit.training_state.advance(TrainingState.IDLE, unit.rank)
            self.callback_queued = False
