"""Construction-time checks of ``FullyShardedDataParallel``: ranks agree on the model and the
arguments, and start from the same weights.

Note [same weights at construction]
DDP and ShardedDataParallel broadcast rank 0's parameters and buffers when they are built, so
a script that seeds each rank differently (``torch.manual_seed(seed + rank)`` before building
the model, to get different data or dropout per rank) still trains one model. FSDP in torch
and fairscale does so only with ``sync_module_states=True``; with the default ``False`` every
rank keeps its own rows of its own initialisation and the sharded model is a patchwork that
matches no rank's weights, silently. shardopt keeps that signature and default (no hidden
broadcast of the whole model) but refuses the patchwork: with ``sync_module_states=False``
every rank computes, for every parameter and buffer, the integer sum of its bit patterns
(the values viewed as integers of their width, summed in int64: exact, so it does not depend
on threads or kernels), and one object all-gather compares these lists
(:func:`shardopt.agreement.check_agreement`). Ranks whose weights differ get a ``ValueError``
on every rank naming the first tensor that differs and the fix: pass
``sync_module_states=True`` (rank 0's weights, as DDP does), or seed the model identically.
Cost: one read of the model on every rank and one small all-gather, once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shardopt import comm
from shardopt.agreement import check_agreement
from shardopt.nn.fsdp.materialize import materialize
from shardopt.nn.fsdp.options import UnitConfig
from shardopt.nn.module_checks import refuse_sparse_modules

__all__ = ["agree_and_sync", "prepare"]

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksums(tensors: list[torch.Tensor]) -> list[int]:
    """Exact, order-independent sums of every tensor's bit patterns (Note [same weights at construction])."""
    sums = []
    for t in tensors:
        t = t.detach().contiguous()
        width = _INT_OF_WIDTH.get(t.element_size())
        bits = t.view(width) if width is not None else t.view(torch.uint8)
        sums.append(bits.sum(dtype=torch.int64))
    if not sums:
        return []
    return [int(v) for v in torch.stack(sums).tolist()]  # one host read, once at construction


def agree_and_sync(
    module: nn.Module,
    config: UnitConfig,
    arguments: list[tuple[str, object]],
    sync_module_states: bool,
    unowned: Callable[[nn.Parameter], bool],
) -> None:
    """Check that every rank built the same model with the same arguments, then broadcast
    rank 0's weights (``sync_module_states``) or refuse ranks whose weights differ.

    Args:
        module: the module about to be wrapped (materialised).
        config: the wrapper's configuration (its shard and replicate groups).
        arguments: ``(name, value)`` of the FSDP arguments that shape the collectives.
        sync_module_states: broadcast rank 0's parameters and buffers.
        unowned: whether a parameter is not yet owned by a unit (units built before this
            wrapper were checked when they were built).

    Raises:
        ValueError: an argument, the parameter list or (without ``sync_module_states``) a
            parameter's or buffer's values differ across ranks; on every rank.
    """
    groups = [(s, g) for s, g in ((config.shard_size, config.shard_group),
                                  (config.replicate_size, config.replicate_group)) if s > 1]
    named = [(n, p) for n, p in module.named_parameters() if unowned(p)]
    # Note [agree before the first collective] in shardopt.agreement: a rank whose
    # parameters are registered in another order would fill the flat layout differently.
    for _, group in groups:
        check_agreement("FullyShardedDataParallel", [
            *arguments,
            ("parameters (name, shape, dtype) in registration order",
             [(n, tuple(p.shape), str(p.dtype)) for n, p in named]),
        ], group, "build the same model, in the same order, with the same FSDP arguments on every rank")
    if sync_module_states:
        # From rank 0 of the shard group, then from rank 0 of the replica group: every rank
        # of the model's groups ends with the values of the first rank of the first group.
        for _, group in groups:
            for tensor in [p for _, p in named] + list(module.buffers()):
                comm.broadcast(tensor.data, 0, group, label="shardopt::fsdp::sync_module_states").wait()
        return
    if not groups:
        return
    named_buffers = list(module.named_buffers())
    sums = _checksums([p for _, p in named] + [b for _, b in named_buffers])
    entries: list[tuple[str, object]] = [
        (f"the values of {kind} {name!r} (sum of bit patterns)", s)
        for (kind, name), s in zip([("parameter", n) for n, _ in named] + [("buffer", n) for n, _ in named_buffers],
                                   sums, strict=False)
    ]
    for _, group in groups:
        check_agreement("FullyShardedDataParallel", entries, group,
                        "pass sync_module_states=True to start every rank from rank 0's weights (what DDP does at "
                        "construction), or build the model from the same seed on every rank "
                        "(Note [same weights at construction])")


def prepare(
    module: nn.Module,
    config: UnitConfig,
    arguments: list[tuple[str, object]],
    sync_module_states: bool,
    param_init_fn: Callable[[nn.Module], None] | None,
    unowned: Callable[[nn.Parameter], bool],
) -> None:
    """Everything the root wrapper does to ``module`` before any unit is built: materialise
    meta tensors, refuse sparse modules, :func:`agree_and_sync`, cast floating point buffers
    to the mixed precision ``buffer_dtype``.

    Raises:
        ValueError: as :func:`agree_and_sync`, :func:`~shardopt.nn.fsdp.materialize.materialize`
            and ``refuse_sparse_modules``.
    """
    materialize(module, param_init_fn, comm.default_device(config.shard_group))
    refuse_sparse_modules(module, "FullyShardedDataParallel")
    agree_and_sync(module, config, arguments, sync_module_states, unowned)
    buffer_dtype = config.mixed_precision.buffer_dtype
    if buffer_dtype is not None:
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and buf.is_floating_point():
                    sub._buffers[name] = buf.to(buffer_dtype)
