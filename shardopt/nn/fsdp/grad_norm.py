"""Global gradient-norm clipping over sharded gradients."""

from __future__ import annotations

import torch
from torch import nn

from shardopt import comm
from shardopt.nn.fsdp.flat_param import FlatParamHandle
from shardopt.nn.fsdp.options import UnitConfig

__all__ = ["clip_grad_norm"]


def _local(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The power sum (or max) of ``grads`` on ``device``: one partial per device the
    gradients live on (offloaded shards' on the host), each moved to ``device`` once."""
    inf = norm_type == float("inf")
    partials = []
    for where in dict.fromkeys(g.device for g in grads):  # devices in first-seen order
        terms = [
            g.detach().float().abs().max() if inf else g.detach().float().norm(norm_type) ** norm_type
            for g in grads
            if g.numel() and g.device == where
        ]
        if terms:
            stacked = torch.stack(terms)
            partials.append((stacked.max() if inf else stacked.sum()).to(device))
    if not partials:
        return torch.zeros((), dtype=torch.float32, device=device)
    if len(partials) == 1:
        return partials[0]
    stacked = torch.stack(partials)
    return stacked.max() if inf else stacked.sum()


def clip_grad_norm(
    handles: list[FlatParamHandle], others: list[nn.Parameter], config: UnitConfig, max_norm: float, norm_type: float
) -> torch.Tensor:
    """Clip gradients by their global norm, counting every element once across ranks.

    How it works: each rank computes the ``norm_type`` power sum (or the max) of its
    gradient pieces; one all-reduce over the shard group combines them (replica groups hold
    equal values and are not counted again); parameters outside any unit (replicated) add
    their local terms; every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does. The reduction runs on the units' compute device
    (where the collective backend wants it); offloaded gradients (Note [offloaded shards] in
    ``offload``) are summed on the host and get the coefficient as a host copy, read once
    per call.

    Args:
        handles: the flat parameters of the model's units (their gradients are disjoint
            pieces per rank).
        others: replicated parameters (e.g. of ignored modules).
        config: the units' configuration (shard group).
        max_norm: the largest allowed total norm (> 0).
        norm_type: p of the p-norm (> 0), ``inf`` for the max norm.

    Returns:
        The total norm before clipping, an fp32 scalar tensor on the compute device.

    Raises:
        ValueError: ``max_norm`` or ``norm_type`` not positive.
    """
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not max_norm > 0 or not norm_type > 0:
        raise ValueError(
            f"clip_grad_norm_ needs max_norm > 0 and norm_type > 0, got max_norm={max_norm}, norm_type={norm_type}"
        )
    inf = norm_type == float("inf")
    sharded_grads = [p.grad for h in handles for p in h.params if p.grad is not None]
    other_grads = [p.grad for p in others if p.grad is not None]
    device = handles[0].device if handles else other_grads[0].device if other_grads else torch.device("cpu")
    total = _local(sharded_grads, norm_type, device)
    if config.shard_size > 1:
        comm.all_reduce(total, config.shard_group, op="max" if inf else "sum",
                        label="shardopt::fsdp::clip_grad_norm").wait()
    extra = _local(other_grads, norm_type, device)
    total = torch.maximum(total, extra) if inf else (total + extra) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coefs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    for g in sharded_grads + other_grads:
        key = (g.device, g.dtype)
        if key not in coefs:
            coefs[key] = coef.to(g.device, g.dtype)  # on the host for offloaded gradients: one read
        g.detach().mul_(coefs[key])
    return total
