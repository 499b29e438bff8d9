"""torch.compile and activation-checkpointing habits, applied to the tests' tiny GPT the way a
DDP or FSDP2 script applies them, and the three ZeRO stages built around the result.

A :class:`Habit` says what the script does to the plain model before wrapping it
(activation checkpointing on every block, ``block.compile()`` on every block, or
``torch.compile(model)``) and whether it compiles the wrapper afterwards. :func:`run`
trains a stage (or DDP) with it, compiled by a backend that counts the graphs it is given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn import ShardedDataParallel
from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP
from shardopt.nn.fsdp import ModuleClassPolicy
from shardopt.optim import OSS
from tests.helpers.data import max_abs_diff
from tests.helpers.gpt import Block, gpt, lm_loss, tokens

STEPS = 4
ADAM_LR = 1e-2
SGD_LR = 0.1


@dataclass(frozen=True)
class Habit:
    """One way a script combines compile and activation checkpointing.

    Attributes:
        name: for messages.
        checkpoint: ``apply_activation_checkpointing`` on every block with this
            implementation, or ``None``.
        compile: ``"per-block"`` (``block.compile()`` on every block, or on every
            checkpoint wrapper, before wrapping: torchtitan's order), ``"before-wrap"``
            (``torch.compile(model)``, then wrap the compiled module) or ``"wrapper"``
            (``torch.compile(wrapper)``).
        units_around_checkpoints: ZeRO-3 makes a unit of every checkpoint wrapper instead
            of every block (so each unit encloses a whole compiled, checkpointed block).
    """

    name: str
    compile: str
    checkpoint: CheckpointImpl | None = None
    units_around_checkpoints: bool = False


HABITS = (
    Habit("checkpoint + compile per block", "per-block", CheckpointImpl.NO_REENTRANT),
    Habit("reentrant checkpoint + compile per block", "per-block", CheckpointImpl.REENTRANT),
    Habit("checkpoint + compile the wrapper", "wrapper", CheckpointImpl.NO_REENTRANT),
    Habit("compile before wrap", "before-wrap"),
    Habit("compile per block", "per-block"),
    Habit("compile the wrapper", "wrapper"),
)
UNITS_AROUND_CHECKPOINTS = Habit("checkpoint + compile per block, units around the checkpointed blocks", "per-block",
                                 CheckpointImpl.NO_REENTRANT, units_around_checkpoints=True)


@dataclass
class GraphCount:
    """A ``torch.compile`` backend that counts the graphs it compiles, then hands them on."""

    backend: str
    graphs: list[int] = field(default_factory=list)
    """The number of nodes of every graph compiled, in order."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(len(gm.graph.nodes))
        return lookup_backend(self.backend)(gm, example_inputs)  # type: ignore[no-any-return]


def plain_model(habit: Habit, backend: GraphCount) -> nn.Module:
    """The seeded GPT with the habit's checkpointing and pre-wrap compile applied."""
    model = gpt()
    if habit.checkpoint is not None:
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=habit.checkpoint),
            check_fn=lambda m: isinstance(m, Block))
    if habit.compile == "per-block":
        for block in model.blocks:  # type: ignore[union-attr]
            block.compile(backend=backend)
    elif habit.compile == "before-wrap":
        return torch.compile(model, backend=backend)  # type: ignore[return-value]
    return model


def wrapped(habit: Habit, wrapper: nn.Module, backend: GraphCount) -> Callable[..., torch.Tensor]:
    """What the script calls: the wrapper, compiled when the habit compiles it."""
    return torch.compile(wrapper, backend=backend) if habit.compile == "wrapper" else wrapper


@dataclass
class Stage:
    """One ZeRO stage around a plain model: what to call, what to step, what to compare."""

    call: nn.Module
    optimizer: torch.optim.Optimizer
    state: Callable[[], list[torch.Tensor]]
    """The full parameters and buffers, in ``state_dict`` order (a collective for ZeRO-3)."""
    close: Callable[[], None] = lambda: None


def _optimizer(params: Any, sgd: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=SGD_LR) if sgd else torch.optim.Adam(params, lr=ADAM_LR)


def _oss(params: Any, sgd: bool) -> OSS:
    return OSS(params, optim=torch.optim.SGD, lr=SGD_LR) if sgd else OSS(params, optim=torch.optim.Adam, lr=ADAM_LR)


def _values(module: nn.Module) -> Callable[[], list[torch.Tensor]]:
    return lambda: [v.detach().clone() for v in module.state_dict().values()]


def build_stage(stage: str, model: nn.Module, habit: Habit, sgd: bool) -> Stage:
    """``stage`` ("ddp", "zero1", "zero2", "zero3") around ``model`` with its optimizer.

    ZeRO-1 is DDP with OSS, ZeRO-2 OSS with ShardedDataParallel, ZeRO-3
    FullyShardedDataParallel with a unit per block (per checkpoint wrapper with
    ``habit.units_around_checkpoints``) and the optimizer built on its parameters.
    """
    if stage in ("ddp", "zero1"):
        ddp = DDP(model)
        opt = _oss(model.parameters(), sgd) if stage == "zero1" else _optimizer(model.parameters(), sgd)
        return Stage(ddp, opt, _values(model))
    if stage == "zero2":
        oss = _oss(model.parameters(), sgd)
        sdp = ShardedDataParallel(model, oss)
        return Stage(sdp, oss, _values(model), sdp.close)
    unit = CheckpointWrapper if habit.units_around_checkpoints else Block
    fsdp = FSDP(model, auto_wrap_policy=ModuleClassPolicy((unit,)))
    return Stage(fsdp, _optimizer(fsdp.parameters(), sgd), _values(fsdp))


@dataclass(frozen=True)
class Run:
    """What one training run left behind.

    Attributes:
        state: the full parameters and buffers after the last step.
        graphs: how many graphs ``torch.compile`` compiled for it.
        grad_scale: the largest gradient element this rank's optimizer saw in any step.
        param_scale: the largest parameter element after the last step.
    """

    state: list[torch.Tensor]
    graphs: int
    grad_scale: float
    param_scale: float


def run(stage: str, habit: Habit, backend: str, rank: int, sgd: bool) -> Run:
    """:data:`STEPS` steps of ``stage`` with ``habit`` on this rank's data, compiled afresh."""
    torch._dynamo.reset()  # every run compiles afresh (and stays under the recompile limit)
    count = GraphCount(backend)
    built = build_stage(stage, plain_model(habit, count), habit, sgd)
    call = wrapped(habit, built.call, count)
    grad_scale = 0.0
    for step in range(STEPS):
        toks = tokens(rank, step)
        built.optimizer.zero_grad(set_to_none=step % 2 == 0)
        lm_loss(call(toks), toks).backward()
        grads = [p.grad for g in built.optimizer.param_groups for p in g["params"] if p.grad is not None]
        grad_scale = max([grad_scale] + [float(g.abs().max()) for g in grads if g.numel()])
        built.optimizer.step()
    state = built.state()
    built.close()
    return Run(state, len(count.graphs), grad_scale, max(float(t.abs().max()) for t in state))


def max_diff(a: Run, b: Run) -> float:
    """The largest difference of any parameter or buffer of two runs."""
    return max_abs_diff(a.state, b.state)
