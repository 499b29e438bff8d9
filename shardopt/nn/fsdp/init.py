"""Construction-time helpers of ``FullyShardedDataParallel``: argument checks turned into a
:class:`~shardopt.nn.fsdp.state.UnitConfig`, and meta-device materialisation."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardopt import comm
from shardopt.nn.fsdp.state import BackwardPrefetch, MixedPrecision, ShardingStrategy, UnitConfig

__all__ = ["make_config", "materialize"]


def make_config(
    strategy: ShardingStrategy,
    process_group: Any,
    device_mesh: Any,
    mixed_precision: MixedPrecision | None,
    forward_prefetch: bool,
    backward_prefetch: BackwardPrefetch | None,
    limit_all_gathers: bool,
) -> UnitConfig:
    """Check the constructor's policy arguments and resolve the process groups.

    Returns:
        The configuration every unit of the model shares.

    Raises:
        TypeError: a policy argument of the wrong type.
        ValueError: process groups or device mesh that do not fit the strategy.
    """
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(
            f"sharding_strategy must be a ShardingStrategy, got {strategy!r}; use e.g. ShardingStrategy.FULL_SHARD"
        )
    if mixed_precision is None:
        mixed_precision = MixedPrecision()
    if not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be a MixedPrecision or None, got {type(mixed_precision).__name__}; "
            "use MixedPrecision(param_dtype=torch.bfloat16, ...)"
        )
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a BackwardPrefetch or None, got {backward_prefetch!r}")
    if strategy is ShardingStrategy.HYBRID_SHARD:
        if device_mesh is not None:
            if device_mesh.ndim != 2:
                raise ValueError(
                    f"HYBRID_SHARD needs a 2-D device_mesh (replicate, shard), got {device_mesh.ndim} dimensions"
                )
            replicate, shard = device_mesh.get_group(0), device_mesh.get_group(1)
        elif isinstance(process_group, tuple) and len(process_group) == 2:
            shard, replicate = process_group
        else:
            raise ValueError(
                f"HYBRID_SHARD needs process_group=(shard_group, replicate_group) or a 2-D device_mesh, got "
                f"process_group={process_group!r}; build the groups with torch.distributed.new_group or "
                "torch.distributed.device_mesh.init_device_mesh"
            )
    else:
        if isinstance(process_group, tuple):
            raise ValueError(
                f"a (shard_group, replicate_group) pair is only meaningful with HYBRID_SHARD, got it with {strategy}; "
                "pass one process group"
            )
        group = process_group
        if device_mesh is not None:
            if device_mesh.ndim != 1:
                raise ValueError(f"{strategy} needs a 1-D device_mesh, got {device_mesh.ndim} dimensions")
            group = device_mesh.get_group()
        shard, replicate = (None, group) if strategy is ShardingStrategy.NO_SHARD else (group, None)
    no_shard = strategy is ShardingStrategy.NO_SHARD
    return UnitConfig(
        strategy=strategy,
        shard_group=shard,
        shard_size=1 if no_shard else comm.group_size(shard),
        shard_rank=0 if no_shard else comm.group_rank(shard),
        replicate_group=replicate,
        replicate_size=comm.group_size(replicate) if replicate is not None or no_shard else 1,
        mixed_precision=mixed_precision,
        forward_prefetch=bool(forward_prefetch),
        backward_prefetch=backward_prefetch,
        limit_all_gathers=bool(limit_all_gathers),
    )


def materialize(module: nn.Module, param_init_fn: Callable[[nn.Module], None] | None) -> None:
    """Materialise a module built on the meta device (warn when ``param_init_fn`` is unused).

    Without ``param_init_fn`` the module is moved with ``to_empty`` (current CUDA device, or
    CPU) and every submodule's ``reset_parameters()`` runs, in module order. Parameters
    shared by several modules stay shared (the first registration's tensor is kept).

    Raises:
        ValueError: meta tensors remain afterwards.
    """
    tensors = list(module.parameters()) + list(module.buffers())
    if not any(t.is_meta for t in tensors):
        if param_init_fn is not None:
            warnings.warn(
                "param_init_fn is ignored: the module has no parameters or buffers on the meta device",
                UserWarning,
                stacklevel=3,
            )
        return
    # to_empty() makes a new tensor per registration, which would untie shared parameters.
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((sub, name))
    tied = [where for where in places.values() if len(where) > 1]

    def retie() -> None:
        for (first, first_name), *rest in tied:
            for sub, name in rest:
                sub._parameters[name] = first._parameters[first_name]

    if param_init_fn is not None:
        param_init_fn(module)
        retie()
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        module.to_empty(device=device)
        retie()
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(
            f"after meta-device initialisation these tensors are still on the meta device: {left[:5]}; "
            "param_init_fn must materialise every parameter and buffer (e.g. module.to_empty(device=...) then "
            "initialise), or give each submodule a reset_parameters()"
        )
