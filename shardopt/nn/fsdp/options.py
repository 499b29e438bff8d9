"""Configuration of ``FullyShardedDataParallel``: the public policy types
(:class:`ShardingStrategy`, :class:`BackwardPrefetch`, :class:`MixedPrecision`,
:class:`CPUOffload`), and the
frozen per-wrapper configuration that nested units inherit (:class:`UnitConfig`), built and
checked from the constructor's arguments by :func:`make_config`.

Runtime state lives in :mod:`shardopt.nn.fsdp.records`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from shardopt import comm

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "MixedPrecision",
    "ShardingStrategy",
    "UnitConfig",
    "make_config",
]


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split over ranks.

    Attributes:
        FULL_SHARD: parameters, gradients and optimizer state sharded; parameters are
            gathered before a unit's forward, freed after it, gathered again for its backward.
        SHARD_GRAD_OP: as FULL_SHARD, but a unit keeps its gathered parameters from its
            forward until its backward (one all-gather per step instead of two).
        NO_SHARD: every rank keeps everything (DDP-like); gradients are all-reduced.
        HYBRID_SHARD: FULL_SHARD inside a shard group, replicated across groups; gradients
            are reduce-scattered in the shard group, then all-reduced across replicas.
    """

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"
    HYBRID_SHARD = "hybrid_shard"


class BackwardPrefetch(enum.Enum):
    """When a unit issues the next unit's all-gather during backward.

    Attributes:
        BACKWARD_PRE: when this unit's backward starts (most overlap, one more unit gathered).
        BACKWARD_POST: when this unit's gradients have been computed.
    """

    BACKWARD_PRE = "backward_pre"
    BACKWARD_POST = "backward_post"


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute, gradient reduction and buffers; ``None`` keeps the parameter dtype.

    The sharded master parameters (what the optimizer steps) keep their original dtype. The
    forward and backward run on a gathered copy in ``param_dtype``; gradients are reduced in
    ``reduce_dtype`` (default: ``param_dtype``) and cast back to the master dtype unless
    ``keep_low_precision_grads``.

    Attributes:
        param_dtype: dtype of the gathered parameters used in forward and backward; floating
            point inputs of each unit's forward are cast to it.
        reduce_dtype: dtype in which gradients are averaged over ranks.
        buffer_dtype: dtype the module's floating point buffers are cast to at wrap time.
        keep_low_precision_grads: leave the reduced gradient in ``reduce_dtype`` on the
            master parameter (the optimizer must accept a gradient of another dtype).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise TypeError(
                    f"MixedPrecision.{name} must be a floating point torch.dtype or None, got {value!r}; "
                    "use e.g. torch.bfloat16"
                )


@dataclass(frozen=True)
class CPUOffload:
    """Where the sharded parameters and their gradients live (torch FSDP1's ``CPUOffload``).

    With ``offload_params=True`` each unit's shard (this rank's rows of its parameters in
    their original dtype, what the optimizer steps) and the sharded gradients live in host
    memory, pinned when the module is on a CUDA device, so the optimizer and its state run
    on the CPU. A unit's shard is copied to the compute device before its all-gather, and
    its reduced gradient shard is copied back to the host after the reduction; the gathered
    parameters, the unreduced gradients and ``no_sync``'s accumulated gradients stay on the
    compute device (Note [offloaded shards] in ``shardopt.nn.fsdp.offload``).

    Attributes:
        offload_params: keep the sharded parameters and gradients in host memory.

    Raises:
        TypeError: ``offload_params`` is not a bool.
    """

    offload_params: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.offload_params, bool):
            raise TypeError(
                f"CPUOffload.offload_params must be a bool, got {self.offload_params!r}; "
                "use CPUOffload(offload_params=True)"
            )


@dataclass(frozen=True)
class UnitConfig:
    """What every unit of one wrapped model shares; nested units inherit it whole.

    Attributes:
        strategy: the sharding strategy.
        shard_group: group the flat parameter is split over (``None`` = the world).
        shard_size: number of ranks in ``shard_group`` (1 for NO_SHARD).
        shard_rank: this process's rank in ``shard_group``.
        replicate_group: group across which shards are replicated and gradients all-reduced
            (NO_SHARD and HYBRID_SHARD), else ``None``.
        replicate_size: number of ranks in ``replicate_group`` (1 when there is none).
        mixed_precision: the dtype policy.
        forward_prefetch: gather the next unit (in recorded forward order) during a forward.
        backward_prefetch: when to gather the next unit in backward, or ``None``.
        limit_all_gathers: allow at most one prefetched, not yet used unit at a time.
        cpu_offload: where the shards and their gradients live.
    """

    strategy: ShardingStrategy
    shard_group: comm.ProcessGroup | None
    shard_size: int
    shard_rank: int
    replicate_group: comm.ProcessGroup | None
    replicate_size: int
    mixed_precision: MixedPrecision
    forward_prefetch: bool
    backward_prefetch: BackwardPrefetch | None
    limit_all_gathers: bool
    cpu_offload: CPUOffload

    @property
    def world_size(self) -> int:
        """Number of ranks a gradient is averaged over."""
        return self.shard_size * self.replicate_size

    @property
    def reshard_after_forward(self) -> bool:
        """Whether a unit frees its gathered parameters at the end of its forward."""
        return self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


def make_config(
    strategy: ShardingStrategy,
    process_group: Any,
    device_mesh: Any,
    mixed_precision: MixedPrecision | None,
    forward_prefetch: bool,
    backward_prefetch: BackwardPrefetch | None,
    limit_all_gathers: bool,
    cpu_offload: CPUOffload | None,
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
    if cpu_offload is None:
        cpu_offload = CPUOffload()
    if not isinstance(cpu_offload, CPUOffload):
        raise TypeError(
            f"cpu_offload must be a shardopt CPUOffload or None, got {cpu_offload!r} "
            f"({type(cpu_offload).__module__}.{type(cpu_offload).__qualname__}); use "
            "cpu_offload=CPUOffload(offload_params=True) with `from shardopt.nn.fsdp import CPUOffload`"
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
        cpu_offload=cpu_offload,
    )
