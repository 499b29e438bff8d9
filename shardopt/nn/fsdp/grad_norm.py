"""Global gradient-norm clipping over sharded gradients."""

from __future__ import annotations

import torch
from torch import nn

from shardopt import comm
from shardopt.nn.fsdp.options import UnitConfig

__all__ = ["clip_grad_norm"]


def _local(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    inf = norm_type == float("inf")
    terms = [
        g.detach().float().abs().max() if inf else g.detach().float().norm(norm_type) ** norm_type
        for g in grads
        if g.numel()
    ]
    if not terms:
        return torch.zeros((), dtype=torch.float32, device=device)
    stacked = torch.stack(terms)
    return stacked.max() if inf else stacked.sum()


def clip_grad_norm(
    sharded: list[nn.Parameter], others: list[nn.Parameter], config: UnitConfig, max_norm: float, norm_type: float
) -> torch.Tensor:
    """Clip gradients by their global norm, counting every element once across ranks.

    How it works: each rank computes the ``norm_type`` power sum (or the max) of its
    gradient pieces; one all-reduce over the shard group combines them (replica groups hold
    equal values and are not counted again); parameters outside any unit (replicated) add
    their local terms; every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does.

    Args:
        sharded: parameters owned by units (their gradients are disjoint pieces per rank).
        others: replicated parameters (e.g. of ignored modules).
        config: the units' configuration (shard group).
        max_norm: the largest allowed total norm (> 0).
        norm_type: p of the p-norm (> 0), ``inf`` for the max norm.

    Returns:
        The total norm before clipping, an fp32 scalar tensor.

    Raises:
        ValueError: ``max_norm`` or ``norm_type`` not positive.
    """
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm > 0 or not norm_type > 0:
        raise ValueError(
            f"clip_grad_norm_ needs max_norm > 0 and norm_type > 0, got max_norm={max_norm}, norm_type={norm_type}"
        )
    inf = norm_type == float("inf")
    sharded_grads = [p.grad for p in sharded if p.grad is not None]
    other_grads = [p.grad for p in others if p.grad is not None]
    device = sharded_grads[0].device if sharded_grads else torch.device("cpu")
    total = _local(sharded_grads, norm_type, device)
    if config.shard_size > 1:
        comm.all_reduce(total, config.shard_group, op="max" if inf else "sum",
                        label="shardopt::fsdp::clip_grad_norm").wait()
    extra = _local(other_grads, norm_type, device)
    total = torch.maximum(total, extra) if inf else (total + extra) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded_grads + other_grads:
        g.detach().mul_(coef.to(g.dtype))
    return total
