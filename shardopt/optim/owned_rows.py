"""The rows of each parameter one rank owns under OSS's plan, and what its optimizer steps.

Note [row views]
A parameter split across ranks (Note [split plan] in :mod:`shardopt.partition`) is stepped by
each owner on its rows only. The wrapped ``torch.optim`` optimizer is given, for that
parameter, a leaf ``nn.Parameter`` that is a view of those rows of the parameter's memory: the
step updates the rows in place, and the optimizer keeps state of the block's shape (a
quarter of a 4-way split parameter's moments on each owner). The view's ``.grad`` is the
block's gradient: the rows of ``param.grad`` under DDP (ZeRO-1: linked, no copy, by
:meth:`OwnedRows.link_grads`), or the owner's reduced rows, which ShardedDataParallel writes
there directly (ZeRO-2: ``param.grad`` holds a placeholder). With fp32 masters the master
copies the rows instead and no view is needed. The views are re-pointed at the parameter's
memory before every use, so replacing ``param.data`` (a weight load, ``module.to``) is
followed. ``zero_grad`` drops a view's ``.grad``.

Note [split gradients outlive the step]
DDP leaves ``.grad`` in place after ``optimizer.step()``: a script that never calls
``zero_grad`` (or calls it every few steps) sums every step's gradient into the next, and a
whole parameter under ShardedDataParallel does the same on its owner. A split parameter's
reduced rows live in its row view's ``.grad``, so after the step they are kept there, with a
placeholder left in ``param.grad`` (Note [split gradients behind placeholders] in
:mod:`shardopt.nn.data_parallel.owner_grads`) so that any later ``zero_grad`` (the module's
too) still drops them; the next reduction adds into them. Dropping them at the step instead
made the no-``zero_grad`` script 6.5e-3 off DDP at 2 ranks. A linked view (ZeRO-1: rows of
DDP's ``param.grad``) is unlinked at the step: DDP's ``param.grad`` itself carries over and the
next step links it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from shardopt.partition import SplitPlan
from shardopt.placeholders import leave_placeholder, take_placeholder

__all__ = ["OwnedRows"]


class OwnedRows:
    """Which rows of which parameter this rank owns under ``plan``, and the row views of the
    split ones it steps without a master (Note [row views]).

    Args:
        plan: the ownership plan over ``OSS.params``.
        rank: this rank.
    """

    def __init__(self, plan: SplitPlan, rank: int) -> None:
        self.plan = plan
        self.rows: dict[int, tuple[int, int]] = {b.param: (b.row_start, b.row_stop) for b in plan.blocks_of_rank(rank)}
        """Rows of every parameter this rank owns (all of them for a whole one), by index."""
        self.split: frozenset[int] = frozenset(i for i, (a, b) in self.rows.items() if (a, b) != (0, plan.rows[i]))
        """The indices this rank owns only some rows of."""
        self._views: dict[int, nn.Parameter] = {}

    def owns(self, index: int) -> bool:
        """Whether this rank owns rows of ``params[index]``."""
        return index in self.rows

    def split_rows(self) -> dict[int, tuple[int, int]]:
        """The rows of the parameters this rank owns only part of."""
        return {i: self.rows[i] for i in self.split}

    def build_views(self, params: Sequence[torch.Tensor], indices: Iterable[int]) -> None:
        """Make the row views of ``params[i]`` for ``i`` in ``indices`` that are split here."""
        self._views = {}
        for i in sorted(indices):
            if i in self.split:
                a, b = self.rows[i]
                self._views[i] = nn.Parameter(params[i].detach()[a:b], requires_grad=True)

    def view(self, index: int) -> nn.Parameter | None:
        """The row view of ``params[index]``, if this rank steps one."""
        return self._views.get(index)

    def refresh(self, params: Sequence[torch.Tensor]) -> None:
        """Point every view at its parameter's current memory (``.data`` may have been replaced)."""
        for i, view in self._views.items():
            a, b = self.rows[i]
            view.data = params[i].detach()[a:b]

    def link_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Give each view the rows of its parameter's ``.grad`` where it has one (ZeRO-1); a
        view whose parameter has none keeps what ShardedDataParallel wrote (ZeRO-2), unless
        the placeholder left for it was dropped or zeroed (Note [split gradients behind
        placeholders] in :mod:`shardopt.nn.data_parallel.owner_grads`)."""
        for i, view in self._views.items():
            if not take_placeholder(params[i]):
                view.grad = None
            grad = params[i].grad
            if grad is not None:
                a, b = self.rows[i]
                view.grad = grad[a:b]

    def after_step(self, params: Sequence[torch.Tensor]) -> None:
        """Unlink the views linked to ``param.grad`` (it is still there: :meth:`link_grads` took
        any placeholder); keep the gradients ShardedDataParallel wrote, behind a placeholder
        (Note [split gradients outlive the step])."""
        for i, view in self._views.items():
            if params[i].grad is not None:
                view.grad = None
            elif view.grad is not None:
                leave_placeholder(params[i])

    def free_grads(self) -> None:
        """Drop every view's gradient."""
        for view in self._views.values():
            view.grad = None
