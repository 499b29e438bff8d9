"""A usual DDP training script's habits under ZeRO-3: DDP's result, or a clear error.

Every comparison runs 2 ranks in fp32 with different data per rank and the same initial
weights, where FSDP's arithmetic is DDP's (Note [average like DDP] in
shardopt.nn.fsdp.unit), so it asserts bitwise equality; 3 ranks (uneven rows) sum in
another order than DDP's buckets and are checked on shapes and counts only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt import comm
from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP
from shardopt.integrations.convert import release
from shardopt.nn.fsdp import ModuleClassPolicy, ShardingStrategy
from shardopt.testing import run_ranks
from tests.helpers.data import decay_groups, max_abs_diff
from tests.helpers.fsdp import all_sharded
from tests.helpers.gpt import Block, gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

BLOCKS = ModuleClassPolicy((Block,))


def _message(call: Callable[[], object], exc: type[Exception]) -> str:
    with pytest.raises(exc) as info:
        call()
    return str(info.value)


def _plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return (model.module if isinstance(model, DDP) else model).state_dict()


# ----------------------------------------------------------------- shapes, groups, counts
def _groups(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref = DDP(gpt())
    model = FSDP(gpt(), auto_wrap_policy=BLOCKS)  # the README's order: wrap, then build the optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    ref_names = {id(p): n for n, p in ref.module.named_parameters()}
    out["groups"] = [[names[id(p)] for p in g["params"]] for g in decay_groups(model)]
    out["ref_groups"] = [[ref_names[id(p)] for p in g["params"]] for g in decay_groups(ref)]
    out["full_count"] = sum(s.numel() for s in model.full_parameter_shapes().values())
    out["ref_count"] = sum(p.numel() for p in ref.parameters())
    local = torch.tensor(float(sum(p.numel() for p in model.parameters())))
    comm.all_reduce(local, None).wait()
    out["summed_local_count"] = int(local.item())  # every element counted once over ranks
    out["full_shapes"] = {n: tuple(s) for n, s in model.full_parameter_shapes().items()}
    out["ref_shapes"] = {n: tuple(p.shape) for n, p in ref.module.named_parameters()}
    if world_size == 2:  # DDP's arithmetic: AdamW with decay on matrices only, 5 steps
        opt_ref = torch.optim.AdamW(decay_groups(ref), lr=1e-2)
        opt = torch.optim.AdamW(decay_groups(model), lr=1e-2)
        for step in range(5):
            toks = tokens(rank, step)
            for m, o in ((ref, opt_ref), (model, opt)):
                o.zero_grad(set_to_none=step % 2 == 0)
                lm_loss(m(toks), toks).backward()
                o.step()
        out["diff"] = max_abs_diff(model.state_dict().values(), _plain_state(ref).values())
        out["sharded"] = all_sharded(model)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_optimizer_built_after_the_wrap_groups_by_dim_like_ddp_and_trains_bitwise(world_size: int) -> None:
    for out in run_ranks(_groups, world_size):
        assert out["groups"] == out["ref_groups"] and out["groups"][0] and out["groups"][1], out
        assert out["full_count"] == out["ref_count"] == out["summed_local_count"], out
        assert out["full_shapes"] == out["ref_shapes"], out
        if world_size == 2:
            assert out["diff"] == 0.0 and out["sharded"], out


# ----------------------------------------------------------------- model.module.state_dict()
def _module_state_dict(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain = gpt()
    for wrap in ("single", "blocks"):
        model = FSDP(gpt(), auto_wrap_policy=BLOCKS if wrap == "blocks" else None)
        raw = model.module  # DDP's raw_model = model.module
        for keep_vars in (False, True):
            sd = raw.state_dict(keep_vars=keep_vars)
            ref = plain.state_dict(keep_vars=keep_vars)
            out[f"{wrap}/{keep_vars}/keys"] = list(sd) == list(ref)
            out[f"{wrap}/{keep_vars}/diff"] = max_abs_diff([v.detach() for v in sd.values()],
                                                           [v.detach() for v in ref.values()])
            out[f"{wrap}/{keep_vars}/sharded_after"] = all_sharded(model)
        loaded = gpt(seed=5)  # the file loads into the plain model
        loaded.load_state_dict(raw.state_dict())
        out[f"{wrap}/loads"] = max_abs_diff(loaded.state_dict().values(), plain.state_dict().values())
    # after release() the plain module's state_dict is local again: its hooks find no shards
    released = release(FSDP(gpt(), auto_wrap_policy=BLOCKS))
    gathers: list[int] = []
    original = comm.all_gather_into
    comm.all_gather_into = lambda *a, **k: gathers.append(1) or original(*a, **k)  # type: ignore[assignment]
    try:
        out["released/diff"] = max_abs_diff(released.state_dict().values(), plain.state_dict().values())
    finally:
        comm.all_gather_into = original  # type: ignore[assignment]
    out["released/no_gather_keys"] = not gathers
    return out


def test_state_dict_of_model_module_is_full_on_every_rank() -> None:
    for out in run_ranks(_module_state_dict, 2):
        assert all(v is True for k, v in out.items() if k.endswith(("keys", "sharded_after"))), out
        assert max(v for k, v in out.items() if k.endswith(("diff", "loads"))) == 0.0, out


# ----------------------------------------------------------------- index-keyed optimizer checkpoint
def _index_keyed(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref = DDP(gpt())
    opt_ref = torch.optim.AdamW(decay_groups(ref), lr=1e-2)

    def train(m: nn.Module, o: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            toks = tokens(rank, step)
            o.zero_grad()
            lm_loss(m(toks), toks).backward()
            o.step()

    train(ref, opt_ref, range(3))
    # DDP's checkpoint (copied: both dicts view live tensors); the optimizer's is keyed by index
    saved_model, saved_optim = copy.deepcopy(_plain_state(ref)), copy.deepcopy(opt_ref.state_dict())
    train(ref, opt_ref, range(3, 5))
    fresh = gpt(seed=7)
    fresh.load_state_dict(saved_model)
    model = FSDP(fresh, auto_wrap_policy=BLOCKS)
    opt = torch.optim.AdamW(decay_groups(model), lr=1e-2)
    opt.load_state_dict(FSDP.shard_full_optim_state_dict(saved_optim, model, opt))
    train(model, opt, range(3, 5))
    out["diff"] = max_abs_diff(model.state_dict().values(), _plain_state(ref).values())
    # a grouping of other sizes, and the same sizes in another order, name the keying
    one_group = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out["sizes"] = _message(lambda: FSDP.shard_full_optim_state_dict(saved_optim, model, one_group), ValueError)
    groups = decay_groups(model)
    reordered = torch.optim.AdamW([{**g, "params": g["params"][::-1]} for g in groups], lr=1e-2)
    out["order"] = _message(lambda: FSDP.shard_full_optim_state_dict(saved_optim, model, reordered), ValueError)
    return out


def test_plain_index_keyed_optimizer_checkpoint_from_ddp_loads_by_position_and_trains_bitwise() -> None:
    for out in run_ranks(_index_keyed, 2):
        assert out["diff"] == 0.0, out
        assert "keyed by index" in out["sizes"] and "hold [" in out["sizes"], out
        assert "keyed by index" in out["order"] and "has shape" in out["order"], out
        assert "full_optim_state_dict" in out["order"], out


# ----------------------------------------------------------------- sync_module_states
def _per_rank_seed(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["refused"] = _message(lambda: FSDP(gpt(seed=rank), auto_wrap_policy=BLOCKS), ValueError)
    ref = DDP(gpt(seed=rank))  # DDP broadcasts rank 0's weights at construction
    model = FSDP(gpt(seed=rank), auto_wrap_policy=BLOCKS, sync_module_states=True)
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(5):
        toks = tokens(rank, step)
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            lm_loss(m(toks), toks).backward()
            o.step()
    out["diff"] = max_abs_diff(model.state_dict().values(), _plain_state(ref).values())
    buffered = gpt()
    buffered.register_buffer("mask", torch.full((3,), float(rank)))
    out["buffer"] = _message(lambda: FSDP(buffered), ValueError)
    return out


def test_ranks_with_different_weights_are_refused_and_sync_module_states_trains_like_ddp() -> None:
    for out in run_ranks(_per_rank_seed, 2):
        assert out["diff"] == 0.0, out
        assert "the values of parameter 'pos'" in out["refused"], out
        assert "sync_module_states=True" in out["refused"] and "same seed" in out["refused"], out
        assert "the values of buffer 'mask'" in out["buffer"], out


# ----------------------------------------------------------------- require_backward_grad_sync
def _grad_sync(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sent: list[int] = []
    original = comm.reduce_scatter

    def counting(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> comm.PendingWork:
        sent.append(input.numel() * input.element_size())
        return original(output, input, *args, **kwargs)

    comm.reduce_scatter = counting  # type: ignore[assignment]
    try:
        for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
            for how in ("flag", "no_sync"):
                ref = DDP(gpt())
                model = FSDP(gpt(), auto_wrap_policy=BLOCKS, sharding_strategy=strategy)
                opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
                opt = torch.optim.Adam(model.parameters(), lr=1e-2)
                sent.clear()
                for step in range(3):
                    for m, o in ((ref, opt_ref), (model, opt)):
                        for micro in range(3):  # nanoGPT's accumulation loop
                            toks = tokens(rank, 3 * step + micro)
                            last = micro == 2
                            if how == "flag" or isinstance(m, DDP):
                                m.require_backward_grad_sync = last
                                lm_loss(m(toks), toks).backward()
                            elif last:
                                lm_loss(m(toks), toks).backward()
                            else:
                                with m.no_sync():
                                    lm_loss(m(toks), toks).backward()
                        o.step()
                        o.zero_grad()
                key = f"{strategy.name}/{how}"
                out[f"{key}/bytes"] = sum(sent)
                out[f"{key}/calls"] = len(sent)
                out[f"{key}/diff"] = max_abs_diff(model.state_dict().values(), _plain_state(ref).values())
                out[f"{key}/flag_after"] = model.require_backward_grad_sync
    finally:
        comm.reduce_scatter = original  # type: ignore[assignment]
    model = FSDP(gpt(), auto_wrap_policy=BLOCKS)
    with model.no_sync():
        out["inside_no_sync"] = model.require_backward_grad_sync
    out["type"] = _message(lambda: setattr(model, "require_backward_grad_sync", 0), TypeError)
    toks = tokens(rank, 0)
    lm_loss(model(toks), toks).backward()
    nested = model.module.blocks[0]
    out["nested"] = _message(lambda: setattr(nested, "require_backward_grad_sync", False), ValueError)
    return out


def test_require_backward_grad_sync_false_skips_the_reduction_like_no_sync_and_ddp() -> None:
    for out in run_ranks(_grad_sync, 2):
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
            flag, ctx = f"{strategy}/flag", f"{strategy}/no_sync"
            assert out[f"{flag}/diff"] == 0.0 and out[f"{ctx}/diff"] == 0.0, out
            assert out[f"{flag}/bytes"] == out[f"{ctx}/bytes"] and out[f"{flag}/calls"] == out[f"{ctx}/calls"], out
            assert out[f"{flag}/calls"] == 3 * 3, out  # one reduce-scatter per unit per step, 3 units
            assert out[f"{flag}/flag_after"] is True, out
        assert out["inside_no_sync"] is False, out
        assert "require_backward_grad_sync must be a bool" in out["type"], out
        assert "must be called on the root" in out["nested"], out
