"""Which optimizers update each element from that element alone (so a parameter may be cut).

A row-split plan (:func:`shardopt.partition.plan_split`) gives one parameter's rows to several
ranks, each stepping its rows alone. That is exact for an optimizer whose update of an element
reads only that element's parameter, gradient and state (SGD, the Adam family, RMSprop,
Adagrad, ...), in their for-loop, foreach and fused forms alike: the form is a flag on the
same class. It is wrong for one that reads the whole matrix (Muon orthogonalises it,
Adafactor keeps row and column statistics, LBFGS takes dot products over every parameter),
and unknowable for anything else. OSS reads it to choose its plan (``split_large_params``,
:func:`resolve_split`) and warns when a plan of whole parameters is badly balanced
(:func:`warn_if_unbalanced`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from shardopt.partition import SplitPlan

__all__ = ["ELEMENTWISE_OPTIMIZERS", "UNBALANCED_WARNING_RATIO", "resolve_split", "updates_elementwise",
           "warn_if_unbalanced"]

UNBALANCED_WARNING_RATIO = 1.25
"""OSS warns at construction when its heaviest rank holds more than this times the mean."""

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


def resolve_split(split_large_params: object, optim: type[torch.optim.Optimizer]) -> bool:
    """OSS's ``split_large_params`` resolved: ``None`` means "when ``optim`` updates element by element".

    Raises:
        TypeError: ``split_large_params`` is not ``None`` or a bool.
        ValueError: ``True`` for an optimizer that is not elementwise (it would be stepped on
            pieces of its matrices: silently wrong).
    """
    if split_large_params is not None and not isinstance(split_large_params, bool):
        raise TypeError(f"split_large_params must be None, True or False, got {split_large_params!r}; None splits "
                        "large parameters when the optimizer updates element by element")
    elementwise = updates_elementwise(optim)
    if split_large_params and not elementwise:
        raise ValueError(
            f"OSS(split_large_params=True) with optim={optim.__qualname__}: it is not known to update each element "
            "from that element alone (Muon, Adafactor, LBFGS and unknown optimizers read whole matrices), so "
            "stepping pieces of a parameter would change its update; leave split_large_params=None, or give the "
            "large parameters to an elementwise optimizer such as torch.optim.AdamW in a second OSS (docs/partition.md)"
        )
    return elementwise if split_large_params is None else split_large_params


def warn_if_unbalanced(plan: SplitPlan, params: Sequence[torch.Tensor], split: bool,
                       optim: type[torch.optim.Optimizer]) -> None:
    """Warn when ``plan`` leaves its heaviest rank over :data:`UNBALANCED_WARNING_RATIO` times the
    mean, naming the largest parameter that rank holds whole and what to do."""
    if plan.num_ranks == 1 or plan.imbalance <= UNBALANCED_WARNING_RATIO:
        return
    loads = plan.rank_bytes
    heaviest = loads.index(max(loads))
    blocks = [b for b in plan.blocks_of_rank(heaviest) if b.num_rows == plan.rows[b.param]]
    if not blocks:
        return
    big = max(blocks, key=lambda b: plan.sizes[b.param])
    why = ("it is kept whole because " + ("split_large_params=False" if updates_elementwise(optim) else
                                          f"{optim.__qualname__} is not an elementwise optimizer"))
    fix = ("pass split_large_params=None (or True) to cut it into row blocks" if updates_elementwise(optim) else
           "give the embeddings and head to an elementwise optimizer (e.g. torch.optim.AdamW) in a second OSS, whose "
           "plan splits them (docs/partition.md, the two-optimizer recipe)")
    warnings.warn(
        f"OSS: the heaviest rank ({heaviest}) holds {plan.imbalance:.2f}x the mean optimizer-state bytes over "
        f"{plan.num_ranks} ranks; its largest parameter is parameter {big.param} (shape "
        f"{tuple(params[big.param].shape)}, {plan.sizes[big.param] / 2**20:.1f} MiB), and {why}; {fix}",
        UserWarning, stacklevel=3)
