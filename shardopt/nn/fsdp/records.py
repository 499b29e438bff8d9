"""Runtime records of ``FullyShardedDataParallel`` units: the two state machines, each with one
checked transition method, the kind of a forward call, and the per-step counters.

Nothing here is configuration (that is :mod:`shardopt.nn.fsdp.options`); these values
change during a step and are reset in one place (:meth:`StepCounts.reset` through
``Unit.reset_step_``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["ForwardKind", "ShardedState", "StepCounts", "TrainingState"]


class ForwardKind(enum.Enum):
    """What a call of a unit's forward is, decided in its pre-forward.

    Attributes:
        NO_GRAD: autograd is off; nothing will come back for the gathered parameters.
        TRAINING: autograd is on and no backward runs: counted, inputs and outputs hooked.
        RECOMPUTE: autograd is on while a backward runs (activation checkpointing
            recomputing the unit): the unit stays gathered and is neither counted nor hooked.
    """

    NO_GRAD = "no_grad"
    TRAINING = "training"
    RECOMPUTE = "recompute"


@dataclass
class StepCounts:
    """A unit's forward/backward bookkeeping for the current step (Note [hook order])."""

    forward_calls: int = 0
    """Forwards with autograd on since the last backward finished."""
    hooked_calls: int = 0
    """Of those, forwards whose inputs carry the post-backward hook."""
    post_backward_calls: int = 0
    """Post-backward hooks that fired in the current backward."""
    reduced: bool = False
    """Whether this step's gradients have been reduced (or accumulated under no_sync)."""
    backward_seen: bool = False
    """A gradient of one of the unit's outputs arrived in the current backward (set even when
    no forward is pending, e.g. a second backward through a retained graph)."""

    def reset(self) -> None:
        """Forget the step (end of backward)."""
        self.forward_calls = self.hooked_calls = self.post_backward_calls = 0
        self.reduced = self.backward_seen = False


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
