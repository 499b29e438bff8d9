"""The correctness traps of common training patterns, each against DDP (or DDP's arithmetic done by hand).

Every comparison here is at two ranks in fp32, where FSDP must be bit-identical to DDP
(Note [average like DDP] in shardopt.nn.fsdp.unit) unless the test says why not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from shardopt import comm
from shardopt.nn.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP
from shardopt.nn.fsdp import ModuleClassPolicy, ShardingStrategy
from shardopt.testing import RankFailure, run_ranks
from tests.helpers.data import max_abs_diff
from tests.helpers.fsdp import all_sharded
from tests.helpers.gpt import Block, TinyGPT, gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

BLOCKS = ModuleClassPolicy((Block,))
SHARDED = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)


def _step(model: nn.Module, opt: torch.optim.Optimizer, toks: torch.Tensor, set_to_none: bool = True) -> float:
    opt.zero_grad(set_to_none=set_to_none)
    loss = lm_loss(model(toks), toks)
    loss.backward()
    opt.step()
    return loss.item()


def _all_sharded(model: nn.Module) -> bool:
    """Every parameter shows its rows of its unit's shard (no unit left gathered)."""
    return all_sharded(model)


def _eval_after_training(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in SHARDED:
        for bwd in (BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST):
            for limit in (True, False):
                ref = DDP(gpt())
                model = FSDP(gpt(), sharding_strategy=strategy, auto_wrap_policy=BLOCKS, forward_prefetch=True,
                             backward_prefetch=bwd, limit_all_gathers=limit)
                opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.optim.Adam(model.parameters(), lr=1e-2)
                diffs = []
                for step in range(2):
                    toks = tokens(rank, step)
                    diffs.append(abs(_step(ref, opt_ref, toks) - _step(model, opt, toks)))
                for step in range(2, 4):  # two evaluations in a row, each then checked for stale units
                    toks = tokens(rank, step)
                    with torch.no_grad():
                        diffs.append(max_abs_diff([ref(toks)], [model(toks)]))
                    assert _all_sharded(model), f"{strategy} left a unit gathered after a no-grad forward"
                # a forward with autograd on whose backward never comes, then a full state dict
                stale = model(tokens(rank, 9))
                del stale
                diffs.append(max_abs_diff(model.state_dict().values(), ref.module.state_dict().values()))
                for step in range(4, 6):
                    toks = tokens(rank, step)
                    diffs.append(abs(_step(ref, opt_ref, toks) - _step(model, opt, toks)))
                diffs.append(max_abs_diff(model.state_dict().values(), ref.module.state_dict().values()))
                out[f"{strategy.name}/{bwd.name}/limit={limit}"] = max(diffs)
    return out


def test_eval_after_training_with_prefetch_runs_on_full_shapes_and_matches_ddp() -> None:
    for diffs in run_ranks(_eval_after_training, 2):
        assert max(diffs.values()) == 0.0, diffs


def _freeze(model: nn.Module) -> None:
    """Mixed frozen/trainable parameters in block 0, an all-frozen block 1."""
    core = model.module if isinstance(model, (DDP, FSDP)) else model
    core.blocks[0].ln1.requires_grad_(False)
    core.blocks[0].qkv.bias.requires_grad_(False)
    core.blocks[1].requires_grad_(False)


def _frozen(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in SHARDED + (ShardingStrategy.NO_SHARD,):
        plain, sharded = gpt(), gpt()
        _freeze(plain)
        _freeze(sharded)
        ref, model = DDP(plain), FSDP(sharded, sharding_strategy=strategy, auto_wrap_policy=BLOCKS)
        opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen pieces get no grad: skipped
        before = {n: t.clone() for n, t in model.state_dict().items()}
        for step in range(4):
            _step(ref, opt_ref, tokens(rank, step), set_to_none=step % 2 == 0)
            _step(model, opt, tokens(rank, step), set_to_none=step % 2 == 0)
        after = model.state_dict()
        assert torch.equal(after["blocks.1.qkv.weight"], before["blocks.1.qkv.weight"])
        assert torch.equal(after["blocks.0.ln1.weight"], before["blocks.0.ln1.weight"])
        assert not torch.equal(after["blocks.0.qkv.weight"], before["blocks.0.qkv.weight"])
        out[strategy.name] = max_abs_diff(after.values(), plain.state_dict().values())
    return out


def test_frozen_and_trainable_params_in_one_unit_and_an_all_frozen_unit_match_ddp() -> None:
    for diffs in run_ranks(_frozen, 2):
        assert max(diffs.values()) == 0.0, diffs


class _DDPByHand:
    """DDP's gradient arithmetic without DDP: g * (1/N), then a sum over ranks."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def sync(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / comm.group_size(None))
                comm.all_reduce(p.grad, None).wait()


def _freeze_mid_training(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in SHARDED:
        plain = gpt()
        ref = _DDPByHand(plain)
        model = FSDP(gpt(), sharding_strategy=strategy, auto_wrap_policy=BLOCKS)
        opt_ref, opt = torch.optim.SGD(plain.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(5):
            if step == 2:  # freeze a block in the middle of training, unfreeze it later
                plain.blocks[1].requires_grad_(False)
                model.module.blocks[1].requires_grad_(False)
            if step == 4:
                plain.blocks[1].requires_grad_(True)
                model.module.blocks[1].requires_grad_(True)
            toks = tokens(rank, step)
            opt_ref.zero_grad()
            lm_loss(plain(toks), toks).backward()
            ref.sync()
            opt_ref.step()
            _step(model, opt, toks)
        out[strategy.name] = max_abs_diff(model.state_dict().values(), plain.state_dict().values())
    return out


def test_freezing_a_block_mid_training_matches_ddp_arithmetic() -> None:
    for diffs in run_ranks(_freeze_mid_training, 2):
        assert max(diffs.values()) == 0.0, diffs


def _accumulation(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in SHARDED + (ShardingStrategy.NO_SHARD,):
        for use_no_sync in (True, False):
            ref, model = DDP(gpt()), FSDP(gpt(), sharding_strategy=strategy, auto_wrap_policy=BLOCKS)
            opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                for m, o in ((ref, opt_ref), (model, opt)):
                    o.zero_grad(set_to_none=step % 2 == 0)
                    for micro in range(3):
                        toks = tokens(rank, 10 * step + micro)
                        if use_no_sync and micro < 2:
                            with m.no_sync():
                                lm_loss(m(toks), toks).backward()
                        else:
                            lm_loss(m(toks), toks).backward()
                    o.step()
            plain = ref.module.state_dict()
            scale = max(v.abs().max().item() for v in plain.values())
            out[f"{strategy.name}/no_sync={use_no_sync}"] = (
                max_abs_diff(model.state_dict().values(), plain.values()) / scale
            )
    return out


def test_grad_accumulation_matches_ddp_bitwise_with_no_sync_and_within_1e6_without() -> None:
    # Without no_sync DDP reduces (avg1 + local g2) * 1/N while sharded gradients can only
    # add avg1 + avg2 (the shard of avg1 is all a rank has): same value, other rounding.
    for diffs in run_ranks(_accumulation, 2):
        assert max(v for k, v in diffs.items() if k.endswith("no_sync=True")) == 0.0, diffs
        assert max(diffs.values()) <= 1e-6, diffs


class _Twice(nn.Module):
    """One block applied twice in a forward, and a parameterless unit in between."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(37, 12)
        self.block = Block(12)
        self.act = nn.Tanh()
        self.head = nn.Linear(12, 37)

    def forward(self, toks: torch.Tensor) -> torch.Tensor:
        x = self.embed(toks)
        x = self.block(self.act(self.block(x)))
        return self.head(x)


def _twice(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in SHARDED + (ShardingStrategy.NO_SHARD,):
        ref = DDP(_Twice())
        model = FSDP(_Twice(), sharding_strategy=strategy, auto_wrap_policy=ModuleClassPolicy((Block, nn.Tanh)))
        opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(4):
            _step(ref, opt_ref, tokens(rank, step), set_to_none=step % 2 == 0)
            _step(model, opt, tokens(rank, step), set_to_none=step % 2 == 0)
        out[strategy.name] = max_abs_diff(model.state_dict().values(), ref.module.state_dict().values())
    return out


def test_module_used_twice_in_one_forward_and_a_unit_without_params_match_ddp() -> None:
    for diffs in run_ranks(_twice, 2):
        assert max(diffs.values()) == 0.0, diffs


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return y + self.b(x) if use_b else y


def _unused(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in SHARDED + (ShardingStrategy.NO_SHARD,):
        ref = DDP(_Branchy(), find_unused_parameters=True)
        model = FSDP(_Branchy(), sharding_strategy=strategy)
        opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            for m, o in ((ref, opt_ref), (model, opt)):
                o.zero_grad()
                m(x, use_b=rank == 1).pow(2).mean().backward()  # b unused on rank 0, `never` everywhere
                o.step()
        out[strategy.name] = max_abs_diff(model.state_dict().values(), ref.module.state_dict().values())
    return out


def test_parameter_unused_on_one_rank_does_not_hang_and_matches_ddp() -> None:
    for diffs in run_ranks(_unused, 2, timeout_s=60):
        assert max(diffs.values()) == 0.0, diffs


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    extras: dict[str, torch.Tensor]


class _DataclassOut(nn.Module):
    """A one-unit model (token inputs, no nested units) whose output is a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = gpt()

    def forward(self, toks: torch.Tensor) -> _Output:
        logits = self.gpt(toks)
        return _Output(logits=logits, extras={"mean": logits.mean()})


def _dataclass_output(rank: int, world_size: int) -> float:
    plain, model = _DataclassOut(), FSDP(_DataclassOut())
    ref = _DDPByHand(plain)
    opt_ref, opt = torch.optim.SGD(plain.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        toks = tokens(rank, step)
        opt_ref.zero_grad()
        lm_loss(plain(toks).logits, toks).backward()
        ref.sync()
        opt_ref.step()
        opt.zero_grad()
        lm_loss(model(toks).logits, toks).backward()
        opt.step()
    return max_abs_diff(model.state_dict().values(), plain.state_dict().values())


def test_dataclass_output_of_a_single_unit_still_reduces_gradients() -> None:
    assert run_ranks(_dataclass_output, 2) == [0.0, 0.0]


def _inf_on_one_rank(rank: int, world_size: int) -> list[bool]:
    seen = []
    for strategy in SHARDED + (ShardingStrategy.NO_SHARD,):
        model = FSDP(gpt(), sharding_strategy=strategy, auto_wrap_policy=BLOCKS)
        toks = tokens(rank, 0)
        loss = lm_loss(model(toks), toks)
        (loss * (float("inf") if rank == 0 else 1.0)).backward()
        seen.append(not bool(torch.isfinite(model.clip_grad_norm_(1.0))))
    return seen


def test_inf_gradient_on_one_rank_reaches_every_rank_without_hanging() -> None:
    assert run_ranks(_inf_on_one_rank, 3, timeout_s=60) == [[True] * 3] * 3


def _unit_skipped_on_one_rank(rank: int, world_size: int) -> None:
    from tests.helpers.gpt import SkippingGPT as _SkippingGPT

    torch.manual_seed(0)
    core = _SkippingGPT(depth=3)
    model = FSDP(core, auto_wrap_policy=BLOCKS)
    core.skip = (1,) if rank == 0 else ()
    toks = tokens(rank, 0)
    lm_loss(model(toks), toks).backward()


def test_unit_skipped_on_one_rank_ends_in_an_error_naming_the_cause() -> None:
    # The flight recorder names the two units within its grace (Note [flight recorder]);
    # should the 3 s group timeout fire first, the unit's own hint says the same.
    with pytest.raises(RankFailure, match="every rank must run the same units in the same order"):
        run_ranks(_unit_skipped_on_one_rank, 2, timeout_s=3)


def _retained_graph(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in SHARDED + (ShardingStrategy.NO_SHARD,):
        plain, model = gpt(), FSDP(gpt(), sharding_strategy=strategy, auto_wrap_policy=BLOCKS)
        ref = _DDPByHand(plain)
        opt_ref, opt = torch.optim.SGD(plain.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            toks = tokens(rank, step)
            for m, o in ((plain, opt_ref), (model, opt)):
                o.zero_grad()
                loss = lm_loss(m(toks), toks)
                loss.backward(retain_graph=True)  # two backwards through one graph
                loss.backward()
                if m is plain:
                    ref.sync()
                o.step()
        out[strategy.name] = max_abs_diff(model.state_dict().values(), plain.state_dict().values())
    return out


def test_second_backward_through_a_retained_graph_is_reduced_like_ddp_arithmetic() -> None:
    # (g + g) * 1/2 summed over two ranks equals two averaged reductions added, bit for bit
    for diffs in run_ranks(_retained_graph, 2):
        assert max(diffs.values()) == 0.0, diffs


def _eval_between_forward_and_backward(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in SHARDED:
        ref = DDP(gpt())
        model = FSDP(gpt(), sharding_strategy=strategy, auto_wrap_policy=BLOCKS, forward_prefetch=True)
        opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.optim.Adam(model.parameters(), lr=1e-2)
        worst = 0.0
        for step in range(3):
            toks, probe = tokens(rank, step), tokens(rank, 100 + step)
            for m, o in ((ref, opt_ref), (model, opt)):
                o.zero_grad()
                loss = lm_loss(m(toks), toks)
                with torch.no_grad():  # reshards what the training forward kept gathered
                    m(probe)
                loss.backward()  # gathers again for backward; saved views see the same storage
                o.step()
            worst = max(worst, max_abs_diff(model.state_dict().values(), ref.module.state_dict().values()))
        out[strategy.name] = worst
    return out


def test_no_grad_forward_between_forward_and_backward_matches_ddp() -> None:
    for diffs in run_ranks(_eval_between_forward_and_backward, 2):
        assert max(diffs.values()) == 0.0, diffs


class _CheckpointedGPT(TinyGPT):
    """Every (FSDP-wrapped) block runs under activation checkpointing."""

    reentrant = False

    def forward(self, toks: torch.Tensor) -> torch.Tensor:
        x = self.embed(toks) + self.pos[: toks.shape[1]]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.ln_f(x))


def _checkpointed(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in SHARDED:
        for mode in ("non-reentrant", "non-reentrant/no-early-stop", "reentrant"):
            torch.manual_seed(0)
            plain = _CheckpointedGPT()
            torch.manual_seed(0)
            core = _CheckpointedGPT()
            plain.reentrant = core.reentrant = mode == "reentrant"
            ref = _DDPByHand(plain)
            model = FSDP(core, sharding_strategy=strategy, auto_wrap_policy=BLOCKS)
            opt_ref, opt = torch.optim.Adam(plain.parameters(), lr=1e-2), torch.optim.Adam(model.parameters(), lr=1e-2)
            with set_checkpoint_early_stop(mode != "non-reentrant/no-early-stop"):
                for step in range(3):
                    toks = tokens(rank, step)
                    opt_ref.zero_grad()
                    lm_loss(plain(toks), toks).backward()
                    ref.sync()
                    opt_ref.step()
                    _step(model, opt, toks)
            out[f"{strategy.name}/{mode}"] = max_abs_diff(model.state_dict().values(), plain.state_dict().values())
    return out


def test_activation_checkpointing_around_units_matches_ddp() -> None:
    # the recomputed forward runs inside backward: the unit stays gathered and is not counted again
    for diffs in run_ranks(_checkpointed, 2):
        assert max(diffs.values()) == 0.0, diffs
