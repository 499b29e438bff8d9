"""``zero_grad`` in any position and forwards that are never backpropagated, against DDP's arithmetic.

Trainers call ``optimizer.zero_grad()`` between forward and backward (Lightning always does),
and evaluation code often runs a forward with autograd on and drops the result. With DDP
both are harmless; every sequence here must leave FSDP's parameters bit-identical to DDP's
arithmetic at two ranks in fp32, for every sharding strategy and unit layout.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from shardopt import comm
from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP
from shardopt.nn.fsdp import ModuleClassPolicy, ShardingStrategy
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff
from tests.helpers.gpt import Block, gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)

# Each sequence is one training step written as a list of actions; "zero" clears gradients
# (alternating set_to_none), "stray" is a forward with autograd on whose output is dropped.
SEQUENCES: dict[str, tuple[str, ...]] = {
    "zero_fwd_bwd_step": ("zero", "fwd", "bwd", "step"),
    "fwd_zero_bwd_step": ("fwd", "zero", "bwd", "step"),  # Lightning's order
    "fwd_bwd_step_zero": ("fwd", "bwd", "step", "zero"),
    "step_then_stray": ("zero", "fwd", "bwd", "step", "stray"),
    "stray_zero_fwd": ("stray", "zero", "fwd", "bwd", "step"),
    "stray_between_bwd_and_step": ("zero", "fwd", "bwd", "stray", "step"),
    "fwd_stray_zero_bwd": ("fwd", "stray", "zero", "bwd", "step"),
    "module_zero_between": ("fwd", "module_zero", "bwd", "step"),
}


def _sync_like_ddp(module: nn.Module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(1.0 / comm.group_size(None))
            comm.all_reduce(p.grad, None).wait()


def _run(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    actions: tuple[str, ...],
    rank: int,
    step: int,
    make_input: Callable[[int, int], torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sync: Callable[[], None] | None,
) -> None:
    x = make_input(rank, step)
    loss: torch.Tensor | None = None
    for action in actions:
        if action == "zero":
            opt.zero_grad(set_to_none=step % 2 == 0)
        elif action == "module_zero":
            model.zero_grad(set_to_none=step % 2 == 1)
        elif action == "fwd":
            loss = loss_fn(model(x), x)
        elif action == "stray":
            stray = loss_fn(model(make_input(rank, 100 + step)), x)
            del stray
        elif action == "bwd":
            assert loss is not None
            loss.backward()
            loss = None
            if sync is not None:
                sync()
        elif action == "step":
            opt.step()


def _linear_input(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(31 * step + rank)
    return torch.randn(5, 4, generator=gen)


def _linear_loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (out * out).sum()


def _linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 4)


LAYOUTS: dict[str, tuple[Callable[[], nn.Module], ModuleClassPolicy | None, Callable[[int, int], torch.Tensor],
                         Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]] = {
    "single_linear": (_linear, None, _linear_input, _linear_loss),
    "gpt_one_unit": (gpt, None, tokens, lm_loss),
    "gpt_per_block": (gpt, ModuleClassPolicy((Block,)), tokens, lm_loss),
}


def _every_position(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for layout, (build, policy, make_input, loss_fn) in LAYOUTS.items():
        for strategy in STRATEGIES:
            for name, actions in SEQUENCES.items():
                plain = build()
                model = FSDP(build(), sharding_strategy=strategy, auto_wrap_policy=policy)
                opt_ref = torch.optim.Adam(plain.parameters(), lr=1e-2)
                opt = torch.optim.Adam(model.parameters(), lr=1e-2)
                for step in range(4):
                    _run(plain, opt_ref, actions, rank, step, make_input, loss_fn, lambda: _sync_like_ddp(plain))
                    _run(model, opt, actions, rank, step, make_input, loss_fn, None)
                out[f"{layout}/{strategy.name}/{name}"] = max_abs_diff(
                    model.state_dict().values(), plain.state_dict().values()
                )
    return out


def test_zero_grad_anywhere_and_stray_forwards_match_ddp_bitwise() -> None:
    for diffs in run_ranks(_every_position, 2, timeout_s=240):
        wrong = {k: v for k, v in diffs.items() if v != 0.0}
        assert not wrong, wrong


def _hybrid_every_position(rank: int, world_size: int) -> dict[str, float]:
    """HYBRID_SHARD needs 4 ranks, where DDP sums in another order: every sequence must give
    the parameters of the same model trained in the plain order, bit for bit."""
    import torch.distributed as dist

    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair = (shard_groups[rank // 2], replicate_groups[rank % 2])
    build, policy, make_input, loss_fn = LAYOUTS["gpt_per_block"]
    finals: dict[str, list[torch.Tensor]] = {}
    for name, actions in SEQUENCES.items():
        model = FSDP(build(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=pair,
                     auto_wrap_policy=policy)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(4):
            _run(model, opt, actions, rank, step, make_input, loss_fn, None)
        finals[name] = list(model.state_dict().values())
    plain = finals["zero_fwd_bwd_step"]
    return {name: max_abs_diff(values, plain) for name, values in finals.items()}


def test_hybrid_shard_gives_the_same_parameters_whatever_the_zero_grad_position() -> None:
    for diffs in run_ranks(_hybrid_every_position, 4, timeout_s=240):
        wrong = {k: v for k, v in diffs.items() if v != 0.0}
        assert not wrong, wrong
