"""Configuration and runtime-state types of ``FullyShardedDataParallel``.

Everything a unit decides from is here: the public policy types (:class:`ShardingStrategy`,
:class:`BackwardPrefetch`, :class:`MixedPrecision`), the frozen per-wrapper configuration
that nested units inherit (:class:`UnitConfig`), and the two state machines
(:class:`TrainingState`, :class:`ShardedState`) each with one checked transition method.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "BackwardPrefetch",
    "MixedPrecision",
    "ShardedState",
    "ShardingStrategy",
    "TrainingState",
    "UnitConfig",
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
    """

    strategy: ShardingStrategy
    shard_group: Any
    shard_size: int
    shard_rank: int
    replicate_group: Any
    replicate_size: int
    mixed_precision: MixedPrecision
    forward_prefetch: bool
    backward_prefetch: BackwardPrefetch | None
    limit_all_gathers: bool

    @property
    def world_size(self) -> int:
        """Number of ranks a gradient is averaged over."""
        return self.shard_size * self.replicate_size

    @property
    def reshard_after_forward(self) -> bool:
        """Whether a unit frees its gathered parameters at the end of its forward."""
        return self.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


class TrainingState(enum.Enum):
    """What a unit is doing; see :meth:`advance` for the allowed moves.

    Attributes:
        IDLE: between steps (also during optimizer steps).
        FORWARD_BACKWARD: a forward ran with autograd on; its backward has not finished.
        SUMMON_FULL_PARAMS: inside ``summon_full_params`` (forward is not allowed).
    """

    IDLE = "idle"
    FORWARD_BACKWARD = "forward_backward"
    SUMMON_FULL_PARAMS = "summon_full_params"

    def advance(self, new: TrainingState, rank: int) -> TrainingState:
        """Check that ``self -> new`` is allowed and return ``new``.

        Raises:
            AssertionError: an internal ordering bug (user-reachable misuse is checked earlier
                with a clear error).
        """
        allowed = {
            TrainingState.IDLE: {TrainingState.FORWARD_BACKWARD, TrainingState.SUMMON_FULL_PARAMS, TrainingState.IDLE},
            # a forward whose backward never came may be followed by a summon
            TrainingState.FORWARD_BACKWARD: {
                TrainingState.FORWARD_BACKWARD, TrainingState.IDLE, TrainingState.SUMMON_FULL_PARAMS
            },
            TrainingState.SUMMON_FULL_PARAMS: {TrainingState.IDLE},
        }
        if new not in allowed[self]:
            raise AssertionError(f"[rank {rank}] FSDP training state cannot go from {self.name} to {new.name}")
        return new


class ShardedState(enum.Enum):
    """Where a unit's parameters live; see :meth:`advance`.

    Attributes:
        SHARDED: only this rank's shard exists; original parameters are 1-D views of it.
        GATHERING: an all-gather into the full buffer is in flight (a prefetch).
        UNSHARDED: the full buffer holds every rank's values; original parameters are views
            of it with their original shapes.
        HELD: between a forward and its backward (Note [held between forward and backward]
            in ``unit``): the full buffer still holds the forward's values, but the original
            parameters are 1-D shard views again, so an optimizer, ``zero_grad`` or a state
            dict between the two sees the sharded parameters and their sharded gradients.
    """

    SHARDED = "sharded"
    GATHERING = "gathering"
    UNSHARDED = "unsharded"
    HELD = "held"

    def advance(self, new: ShardedState, rank: int) -> ShardedState:
        """Check that ``self -> new`` is allowed and return ``new``.

        Raises:
            AssertionError: an internal ordering bug.
        """
        allowed = {
            ShardedState.SHARDED: {ShardedState.GATHERING, ShardedState.UNSHARDED},
            ShardedState.GATHERING: {ShardedState.UNSHARDED},
            ShardedState.UNSHARDED: {ShardedState.SHARDED, ShardedState.HELD},
            ShardedState.HELD: {ShardedState.UNSHARDED, ShardedState.SHARDED},
        }
        if new not in allowed[self]:
            raise AssertionError(f"[rank {rank}] FSDP sharded state cannot go from {self.name} to {new.name}")
        return new
