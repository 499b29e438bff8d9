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
inf-norm) in one slot per parameter of a float64 vector built on the device, plus a "has a
gradient" flag; one all-reduce per process group (sum, or max for inf) combines them, the
host reads the vector once per group, and the norm is the p-th root.
Every element is counted once: owners hold disjoint rows, and a hybrid layout's replicas are
not counted again (the reduction runs over the shard group only). A parameter held whole by
one rank gets exactly ``torch.linalg.vector_norm`` of its gradient (the float64 power and
root round back to the same float32); a split one is within rounding of it. Cost: one
vector of two float64 slots per parameter, reduced once per group per call.
"""

from __future__ import annotations

import math
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
_LOCAL = "local"  # the slots of parameters no wrapper shards: this rank's own gradient, no exchange


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


def _reduce_device(param: torch.Tensor) -> torch.device:
    """Where the slots of ``param``'s process group are reduced: the compute device of the
    ZeRO-3 unit that owns it (its shard may be offloaded to the host), else its own device."""
    handle = getattr(owner_of(param), "handle", None)
    return handle.device if handle is not None else param.device


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
    for opt in {id(o): o for o in optimizers.values()}.values():
        opt.wait_for_grads()  # offloaded gradients land asynchronously (Note [offload copies on a side stream])
    parts: list[torch.Tensor | None] = []
    groups: list[Any] = []  # the process group each slot is reduced over; _LOCAL for none
    for _, p in named:
        registration = clipping.sharded_by(p)
        wrapper = registration.wrapper if registration is not None else None
        if isinstance(wrapper, FullyShardedDataParallel) and owner_of(p) is not None:
            parts.append(p.grad.detach() if p.grad is not None else None)
            groups.append(wrapper.unit.config.shard_group)  # replicas hold equal shards
        elif id(p) in optimizers:
            parts.append(_oss_part(p, optimizers[id(p)]))
            groups.append(optimizers[id(p)].group)
        else:
            parts.append(None if p.grad is None or is_placeholder(p) else p.grad.detach())
            groups.append(_LOCAL)
    distinct: list[Any] = []
    for g in groups:
        if all(g is not d for d in distinct):
            distinct.append(g)
    totals: dict[int, float] = {}
    for group in distinct:
        slots = [i for i, g in enumerate(groups) if g is group]
        device = _reduce_device(named[slots[0]][1])  # a CUDA one for NCCL
        zero = torch.zeros((), dtype=torch.float64, device=device)
        powers = []
        for i in slots:
            part = parts[i]
            norm = zero if part is None else torch.linalg.vector_norm(part, norm_type).to(device, torch.float64)
            powers.append(norm if inf else norm**norm_type)
        held = torch.tensor([float(parts[i] is not None) for i in slots], dtype=torch.float64)  # host facts
        exchange = torch.cat([torch.stack(powers), held.to(device)])  # built on the device: no per-slot read
        if group is not _LOCAL:
            comm.all_reduce(exchange, group, op="max" if inf else "sum", label=_LABEL).wait()
        values = exchange.cpu().tolist()  # host-read: the call's one per process group
        for k, i in enumerate(slots):
            if values[len(slots) + k] > 0:
                totals[i] = values[k] if inf else math.sqrt(values[k]) if norm_type == 2 else values[k] ** (1 / norm_type)
    return {name: torch.tensor(totals[i], dtype=torch.float32, device=p.device)
            for i, (name, p) in enumerate(named) if i in totals}


