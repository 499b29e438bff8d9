"""ShardedDataParallel's gradients outside the buckets: what the owner keeps across backward
passes, the local ``no_sync`` sums, and the routing into fp32 master gradients.

ShardedDataParallel creates one :class:`OwnerGrads` at construction and keeps it for its
life; it hands it the optimizer of each parameter whenever it (re)plans (:meth:`OwnerGrads.plan`).
In, from ShardedDataParallel's hooks: a parameter about to accumulate a gradient
(:meth:`~OwnerGrads.before_accumulate`), a local gradient accumulated under ``no_sync``
(:meth:`~OwnerGrads.keep_local`) or to be reduced now (:meth:`~OwnerGrads.take_for_bucket`);
from the :class:`~shardopt.nn.data_parallel.reduction_queue.ReductionQueue`: each reduced
gradient (:meth:`~OwnerGrads.receive`). Out: local gradients for the buckets, and on the
owner the reduced gradient in the optimizer's gradient holder for it
(:meth:`OSS.grad_holder <shardopt.optim.OSS.grad_holder>`): ``param.grad`` (added to what
was set aside), its master's fp32 ``.grad`` with a placeholder left in ``param.grad`` (Note
[placeholders for moved gradients] in :mod:`shardopt.placeholders`), or for a parameter split
across ranks the ``.grad`` of the leaf holding this rank's rows, with a placeholder too (Note
[split gradients behind placeholders]).

Note [owner's gradient across backward passes]
After a reduction the owner's ``.grad`` holds the *averaged* gradient; no other rank has
one. A later backward (gradient accumulation without no_sync) would add this rank's
*local* gradient on top, and reducing that sum would divide the earlier average by N
again (the other ranks have nothing to add to it). So just before autograd accumulates
into a parameter, a ``.grad`` that is still the tensor we wrote (same object, whatever was
done to it in place: zeroed by zero_grad, unscaled by a scaler, clipped) is moved aside;
autograd then accumulates only local gradients, the bucket sends only those, and the
owner adds the new reduced gradient to what it set aside. Zeros set aside add exactly;
a ``.grad`` set to None has nothing to set aside. Hence any zero_grad, on any object, at
any time, is safe, and an in-place edit of the reduced gradient is kept, as with DDP.
A ``.grad`` *replaced* by a new tensor is not ours and counts as a local gradient, as DDP
counts every ``.grad``: replace the owner's reduced gradient only before a step, not
before more backward passes.
Where the owner's gradient lives in another tensor than ``param.grad`` (a master's ``.grad``,
or the rows of a split parameter, Note [split parameters in buckets] in grad_buckets),
nothing is set aside: autograd's ``param.grad`` only ever holds local gradients, and each
reduction adds into the holder's ``.grad``. Dropping such a gradient takes any zero_grad,
the module's included, through the placeholder left in ``param.grad``.
The set-aside runs as a pre-hook of the parameter's AccumulateGrad node, which runs only
when a gradient is really accumulated. A tensor hook (``param.register_hook``) would also
fire for ``torch.autograd.grad(loss, params)``, which never touches ``.grad``: the owner's
reduced gradient would vanish into the set-aside table and the step would skip it.

Note [split gradients behind placeholders]
A split parameter's reduced rows live in the ``.grad`` of its owner's row view, which
``model.zero_grad()`` cannot see: zeroing the module between two backward passes of one step
would leave the rows of the first, and the step would add gradients the user discarded
(measured: 0.02 off DDP at 2 ranks). So split parameters are handled as parameters with
masters are (Note [placeholders for moved gradients] in :mod:`shardopt.placeholders`): a
placeholder stands in ``param.grad`` while a holder or a ``no_sync`` sum keeps its gradient,
on every rank; a ``no_sync`` local gradient moves into a sum in its own dtype (the same
tensor, no copy) so the placeholder can stand; a placeholder found dropped or zeroed
before the next use drops what it stood for. ``OSS`` takes the placeholder when it links or
folds the rows (``OwnedRows.link_grads``, ``MasterWeights.fold_grads``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from shardopt.nn.data_parallel.local_sums import LocalSums
from shardopt.optim.oss import OSS
from shardopt.placeholders import take_placeholder

__all__ = ["OwnerGrads"]


class OwnerGrads:
    """Gradients held outside ``param.grad`` and outside the buckets, per parameter.

    Args:
        grad_dtypes: maps a low-precision parameter dtype to its master dtype (empty without
            master weights; Note [reduce into master gradients] in ``grad_buckets``).
        rank: this process's rank, for internal errors.
        name_of: a parameter's name in the module, for internal errors.
    """

    def __init__(self, grad_dtypes: Mapping[torch.dtype, torch.dtype], rank: int,
                 name_of: Callable[[torch.Tensor], str]) -> None:
        self._grad_dtypes = dict(grad_dtypes)
        self._rank = rank
        self._name_of = name_of
        self._optim_of: dict[torch.Tensor, OSS] = {}
        self._local_sums = LocalSums(self._grad_dtypes)
        self._set_aside: dict[nn.Parameter, torch.Tensor] = {}
        self._written: dict[nn.Parameter, weakref.ref[torch.Tensor]] = {}
        self._local_pending: set[nn.Parameter] = set()
        self._elsewhere: set[torch.Tensor] = set()

    def plan(self, optim_of: Mapping[torch.Tensor, OSS]) -> None:
        """Take the optimizer of every parameter (after a (re)plan)."""
        self._optim_of = dict(optim_of)
        split = {opt.params[i] for opt in set(optim_of.values()) for i in opt.plan.split_params}
        offloaded = {p for p, opt in optim_of.items() if opt.offload is not None}  # Note [offloaded masters]
        self._elsewhere = {p for p in optim_of if p.dtype in self._grad_dtypes} | split | offloaded
        self._local_sums.keep_in_own_dtype(split | offloaded)  # Note [split gradients behind placeholders]

    @property
    def has_local(self) -> bool:
        """Whether gradients accumulated under ``no_sync`` wait for a reduction."""
        return bool(self._local_pending)

    def before_accumulate(self, param: nn.Parameter, grad_outputs: tuple[torch.Tensor | None, ...] = ()) -> None:
        """Autograd is about to accumulate into ``param``: settle its placeholder and set
        aside the owner's reduced gradient (Note [owner's gradient across backward passes]).
        Installed, bound to ``param``, as a pre-hook of its AccumulateGrad node, which
        passes ``grad_outputs`` (unused)."""
        if param in self._elsewhere:
            self._local_sums.settle(param, self._master_of(param))
        written = self._written.pop(param, None)
        if written is not None and param.grad is not None and written() is param.grad:
            self._set_aside[param] = param.grad
            param.grad = None

    def keep_local(self, param: nn.Parameter) -> None:
        """Keep ``param``'s local gradient for a later reduction (a backward under ``no_sync``)."""
        self._local_pending.add(param)
        self._local_sums.keep(param)  # Note [no_sync sums in master precision] in shardopt.nn.data_parallel.local_sums
        self._local_sums.leave(param, self._master_of(param))

    def take_for_bucket(self, param: nn.Parameter) -> torch.Tensor:
        """Take ``param``'s local gradient (plus its ``no_sync`` sum) for its bucket, freeing ``.grad``."""
        grad = self._local_sums.take(param, param.grad)
        assert grad is not None, f"[rank {self._rank}] {self._name_of(param)!r} accumulated a gradient but holds none"
        param.grad = None
        self._local_pending.discard(param)
        return grad

    def take_pending(self, param: nn.Parameter) -> torch.Tensor | None:
        """What ``param`` accumulated under ``no_sync`` and no hook took since, freeing ``.grad``."""
        if param not in self._local_pending:
            return None
        if param in self._elsewhere:  # Note [placeholders for moved gradients] in shardopt.placeholders
            self._local_sums.settle(param, self._master_of(param))
        grad = self._local_sums.take(param, param.grad)
        if grad is not None:
            param.grad = None
        return grad

    def end_flush(self) -> None:
        """Every local gradient was sent."""
        self._local_pending.clear()

    def receive(self, grads: Sequence[tuple[nn.Parameter, torch.Tensor | None]], grad_dtype: torch.dtype) -> None:
        """Give the owner each ``(param, reduced gradient)`` (``None``: no rank had one) of one bucket, in
        ``grad_dtype`` or, at one rank, narrower (widened where it lands): for a split parameter, this rank's
        rows. The ones for a master or a split parameter's rows go to their optimizer together, before their
        placeholders are left (Note [reduce into master gradients] in grad_buckets; Note [one copy per bucket]
        in :mod:`shardopt.optim.flat_masters`)."""
        held: dict[OSS, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        settled: list[tuple[nn.Parameter, torch.Tensor]] = []
        for param, reduced in grads:
            holder = self._optim_of[param].grad_holder(param)
            if holder is param:
                self._receive_own(param, reduced if reduced is None or reduced.dtype == grad_dtype
                                  else reduced.to(grad_dtype))  # Note [one rank passes gradients through]
                continue
            assert holder is not None, f"[rank {self._rank}] {self._name_of(param)!r} was reduced here, but owns no rows"
            self._local_sums.settle(param, holder)  # Note [placeholders for moved gradients] in shardopt.placeholders
            settled.append((param, holder))
            if reduced is not None:
                held.setdefault(self._optim_of[param], []).append((param, reduced))
        for opt, pairs in held.items():
            opt.add_grads(pairs)
        for param, holder in settled:
            self._local_sums.leave(param, holder)

    def _receive_own(self, param: nn.Parameter, reduced: torch.Tensor | None) -> None:
        """``param``'s reduced gradient into ``param.grad``, added to what was set aside (Note [owner's
        gradient across backward passes])."""
        kept = self._set_aside.pop(param, None)
        if reduced is None:
            if kept is not None:
                param.grad = kept
            return
        if kept is not None:
            reduced = kept.add_(reduced)
        param.grad = reduced
        self._written[param] = weakref.ref(reduced)

    def restore(self) -> None:
        """Put everything held back into ``.grad`` (the wrapper is closing) and forget it."""
        for param, kept in self._set_aside.items():  # Note [owner's gradient across backward passes]
            param.grad = kept if param.grad is None else kept.add_(param.grad)
        self._set_aside.clear()
        for p, total in self._local_sums.items():  # no_sync sums back into .grad (rounded)
            if not take_placeholder(p):  # zeroed since: the sum was discarded
                continue
            p.grad = total.to(p.dtype) if p.grad is None else p.grad.add_(total)
        self._local_sums.clear()
        self._written.clear()

    def forget(self) -> None:
        """Drop what was set aside or written and the ``no_sync`` sums (before a re-plan)."""
        self._set_aside.clear()
        self._written.clear()
        self._local_sums.clear()

    def zero(self) -> None:
        """Drop every held gradient: holders' (masters', split rows'), ``no_sync`` sums, set-aside ones."""
        for param, opt in self._optim_of.items():
            holder = opt.grad_holder(param)
            if holder is not None and holder is not param:
                holder.grad = None
        self._local_sums.clear()
        self._set_aside.clear()
        self._written.clear()
        self._local_pending.clear()

    def _master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """Where this rank holds ``param``'s gradient outside ``param.grad``: the master (of its
        rows) of a parameter that has masters, the row view of a split one; ``None`` elsewhere."""
        return self._optim_of[param].grad_holder(param) if param in self._elsewhere else None

