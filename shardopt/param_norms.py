"""Per-parameter gradient norms over every rank, under any stage: what per-layer norm logging reads.

Note [per-parameter norms across ranks]
Under ShardedDataParallel a gradient lives on its owner only (a parameter split across ranks,
in its owners' rows; with fp32 masters, in the master), and under FullyShardedDataParallel
each rank holds its rows of every gradient, so ``param.grad.norm()`` on one rank is not the
parameter's gradient norm (and on a placeholder it refuses to run, Note [placeholders refuse
to be read] in :mod:`shardopt.placeholders`). :func:`grad_norms` asks, for each parameter,
which part of its gradient this rank holds: the rows an OSS owner keeps
(``OSS.grad_holder(param).grad``, plus the owned rows of a real ``param.grad`` not yet folded
into a master), the rows a ZeRO-3 unit keeps, or the whole local ``.grad`` for a parameter no
wrapper shards (DDP's, already averaged). Each rank puts ``|part|_p ** p`` (the max for the
inf-norm) in one slot per parameter of a float64 vector, plus a "has a gradient" flag; one
all-reduce per process group (sum, or max for inf) combines them; the norm is the p-th root.
Every element is counted once: owners hold disjoint rows, and a hybrid layout's replicas are
not counted again (the reduction runs over the shard group only). A parameter held whole by
one rank gets exactly ``torch.linalg.vector_norm`` of its gradient (the float64 power and
root round back to the same float32); a split one is within rounding of it. Cost: one
vector of two float64 slots per parameter, reduced once per group per call.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardopt import clipping, comm
from shardopt.nn import FullyShardedDataParallel
from shardopt.nn.fsdp.wrap import owner_of
from shardopt.optim import OSS
from shardopt.placeholders import is_placeholder

__all__ = ["grad_norms"]

_LABEL = "shardopt::grad_norms"


def _optimizers_by_param(named: list[tuple[str, nn.Parameter]]) -> dict[int, OSS]:
    """The OSS that shards each parameter (by ``id``), for the live wrappers of ``named``: a
    ShardedDataParallel's optimizers, or an OSS registered itself (fp32 masters under DDP)."""
    found: dict[int, OSS] = {}
    for _, p in named:
        registration = clipping.sharded_by(p)
        if registration is None or id(p) in found:
            continue
        wrapper = registration.wrapper
        for opt in getattr(wrapper, "sharded_optimizers", None) or [wrapper]:
            if isinstance(opt, OSS):
                found.update({id(q): opt for q in opt.params})
    return found


def _oss_part(param: torch.Tensor, opt: OSS) -> torch.Tensor | None:
    """The gradient rows of ``param`` this rank holds as an owner under ``opt``, or ``None``."""
    rows = opt.owned_rows(param)
    if rows is None:
        return None
    holder = opt.grad_holder(param)
    parts = []
    if holder is not None and holder is not param and holder.grad is not None:
        parts.append(holder.grad.detach())
    if param.grad is not None and not is_placeholder(param):  # under DDP (ZeRO-1): rows of the full gradient
        grad = param.grad.detach()
        parts.append(grad if grad.dim() == 0 or rows == (0, grad.shape[0]) else grad[rows[0] : rows[1]])
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else parts[0].float() + parts[1].float()


def _named_unique(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    for name, p in module.named_parameters():
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            yield name, p


def grad_norms(module: nn.Module, norm_type: float = 2.0) -> dict[str, torch.Tensor]:
    """The norm of every trainable parameter's gradient, over all ranks, by name.

    A collective: call it on every rank, after the backward pass whose gradients you want
    (after the last micro-batch under ``no_sync``) and before ``optimizer.step()``. How it
    works: Note [per-parameter norms across ranks]. Works under DDP (with or without OSS),
    ShardedDataParallel (whole, split, hybrid, fp32 masters) and FullyShardedDataParallel,
    and on a plain module (local norms).

    Args:
        module: the model, wrapped (DDP, ShardedDataParallel, FullyShardedDataParallel) or
            the inner module; names are those of ``module.named_parameters()``.
        norm_type: the p of the p-norm; ``float("inf")`` for the max norm.

    Returns:
        ``{name: norm}`` for each trainable parameter with a gradient on some rank: a 0-d
        float32 tensor on the parameter's device, the same on every rank.

    Raises:
        ValueError: ``norm_type`` is not positive.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"grad_norms needs norm_type > 0 (2.0, or float('inf') for the max norm), got {norm_type}")
    inf = norm_type == float("inf")
    named = list(_named_unique(module))
    optimizers = _optimizers_by_param(named)
    parts: list[torch.Tensor | None] = []
    groups: list[Any] = []  # the process group each slot is reduced over; "local" for none
    for _, p in named:
        registration = clipping.sharded_by(p)
        wrapper = registration.wrapper if registration is not None else None
        if isinstance(wrapper, FullyShardedDataParallel) and owner_of(p) is not None:
            parts.append(p.grad.detach() if p.grad is not None else None)
            groups.append(wrapper.unit.config.shard_group)  # replicas hold equal shards
            continue
        opt = optimizers.get(id(p))
        if opt is not None:
            parts.append(_oss_part(p, opt))
            groups.append(opt.group)
            continue
        parts.append(None if p.grad is None or is_placeholder(p) else p.grad.detach())
        groups.append("local")
    terms = torch.zeros(2 * len(named), dtype=torch.float64)
    for i, part in enumerate(parts):
        if part is not None:
            norm = torch.linalg.vector_norm(part, norm_type).double()
            terms[i] = norm if inf else norm**norm_type  # host-side vector: one copy per parameter
            terms[len(named) + i] = 1.0
    distinct: list[Any] = []
    for g in groups:
        if g != "local" and all(g is not d for d in distinct):
            distinct.append(g)
    for group in distinct:
        slots = [i for i, g in enumerate(groups) if g is group]
        picked = torch.tensor(slots + [len(named) + i for i in slots])
        device = _device_of(named, slots)
        exchange = terms[picked].to(device)
        comm.all_reduce(exchange, group, op="max" if inf else "sum", label=_LABEL).wait()
        terms[picked] = exchange.cpu()  # host-read: the call's one, per group
    out = {}
    for i, (name, p) in enumerate(named):
        if terms[len(named) + i] > 0:
            value = terms[i] if inf else terms[i] ** (1.0 / norm_type)
            out[name] = value.to(torch.float32).to(p.device)
    return out


def _device_of(named: list[tuple[str, nn.Parameter]], slots: list[int]) -> torch.device:
    """Where a group's exchange runs: the first parameter's device (a CUDA one for NCCL)."""
    return named[slots[0]][1].device if slots else torch.device("cpu")
