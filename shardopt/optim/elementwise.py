"""Which optimizers update each element from that element alone (so a parameter may be cut).

A row-split plan (:func:`shardopt.partition.plan_split`) gives one parameter's rows to several
ranks, each stepping its rows alone. That is exact for an optimizer whose update of an element
reads only that element's parameter, gradient and state (SGD, the Adam family, RMSprop,
Adagrad, ...), in their for-loop, foreach and fused forms alike: the form is a flag on the
same class. It is wrong for one that reads the whole matrix (Muon orthogonalises it,
Adafactor keeps row and column statistics, LBFGS takes dot products over every parameter),
and unknowable for anything else. Nothing in OSS reads this yet (issue 27 wires it in).
"""

from __future__ import annotations

import torch

__all__ = ["ELEMENTWISE_OPTIMIZERS", "updates_elementwise"]

ELEMENTWISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.Rprop,
    torch.optim.ASGD,
})
"""torch's optimizers whose update of an element reads only that element (every option of
them: momentum, weight decay, amsgrad, foreach, fused, ...)."""


def updates_elementwise(optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` updates each parameter element from that element alone.

    How it works: the class itself (not a subclass, which may override ``step``) must be one
    of :data:`ELEMENTWISE_OPTIMIZERS`. Matrix-wise optimizers (``torch.optim.Muon``,
    ``torch.optim.Adafactor``), ``LBFGS``, ``SparseAdam`` and every other class answer
    ``False``: unknown is treated as matrix-wise, which keeps whole parameters and is always
    correct.

    Args:
        optimizer: an optimizer class, or an instance (its class is checked).

    Returns:
        ``True`` when splitting a parameter's rows across ranks leaves its update unchanged.

    Raises:
        TypeError: ``optimizer`` is neither an optimizer class nor an optimizer.
    """
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    if not issubclass(cls, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer class or instance, got {cls.__name__}; pass "
                        "e.g. torch.optim.AdamW or the optimizer you built")
    return cls in ELEMENTWISE_OPTIMIZERS
