"""FullyShardedDataParallel against DDP and a single-process model, same init, data per rank.

Two ranks in fp32 must be bit-identical (Note [average like DDP] in shardopt.nn.fsdp.unit);
three and four ranks sum in a different order than DDP's buckets, so they are compared
relative to the largest parameter, within 1e-6, with SGD+momentum (Adam divides by
sqrt(v) and turns last-bit differences of near-zero gradients into lr-sized ones).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP
from shardopt.nn.fsdp import ModuleClassPolicy, NameGlobPolicy, ShardingStrategy, SizePolicy
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff
from tests.helpers.gpt import Block, gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

STRATEGIES = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
WRAPS = ("single", "blocks", "by_hand", "embed_and_blocks", "size", "glob")


def wrap_gpt(wrap: str, strategy: ShardingStrategy, **kwargs: object) -> FSDP:
    """A TinyGPT (seed 0) wrapped one of several ways; tied embedding/head in every case."""
    model = gpt()
    if wrap == "single":
        return FSDP(model, sharding_strategy=strategy, **kwargs)  # type: ignore[arg-type]
    if wrap == "by_hand":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FSDP(block, sharding_strategy=strategy, **kwargs)  # type: ignore[arg-type]
        return FSDP(model, sharding_strategy=strategy, **kwargs)  # type: ignore[arg-type]
    policy = {
        "blocks": ModuleClassPolicy((Block,)),
        # the tied weight leaves the embedding unit with no parameters of its own
        "embed_and_blocks": ModuleClassPolicy((Block, nn.Embedding)),
        "size": SizePolicy(min_num_params=300),
        "glob": NameGlobPolicy(("blocks.*", "ln_f")),
    }[wrap]
    return FSDP(model, sharding_strategy=strategy, auto_wrap_policy=policy, **kwargs)  # type: ignore[arg-type]


def _train_pair(rank: int, ref: nn.Module, model: nn.Module, make_opt: type, steps: int, **opt_kw: float) -> float:
    opt_ref, opt = make_opt(ref.parameters(), **opt_kw), make_opt(model.parameters(), **opt_kw)
    for step in range(steps):
        toks = tokens(rank, step)
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad(set_to_none=step % 2 == 0)
            lm_loss(m(toks), toks).backward()
            o.step()
    return 0.0


def _parity(rank: int, world_size: int, exact: bool) -> dict[str, float]:
    out: dict[str, float] = {}
    for strategy in STRATEGIES:
        for wrap in WRAPS:
            ref = DDP(gpt()) if world_size > 1 else gpt()
            model = wrap_gpt(wrap, strategy)
            if exact:
                _train_pair(rank, ref, model, torch.optim.Adam, 5, lr=1e-2)
            else:
                _train_pair(rank, ref, model, torch.optim.SGD, 5, lr=0.1, momentum=0.9)
            full = model.state_dict()
            plain = ref.module.state_dict() if isinstance(ref, DDP) else ref.state_dict()
            assert list(full) == list(plain), (list(full), list(plain))
            scale = max(v.abs().max().item() for v in plain.values())
            out[f"{strategy.name}/{wrap}"] = max_abs_diff(full.values(), plain.values()) / scale
    return out


def test_fsdp_single_rank_matches_plain_model_bitwise() -> None:
    diffs = run_ranks(_parity, 1, True)[0]
    assert max(diffs.values()) == 0.0, diffs


def test_fsdp_two_ranks_matches_ddp_bitwise_with_adam() -> None:
    results = run_ranks(_parity, 2, True, timeout_s=120)
    for diffs in results:
        assert max(diffs.values()) == 0.0, diffs


@pytest.mark.parametrize("world_size", [3, 4])
def test_fsdp_three_and_four_ranks_match_ddp_within_1e6(world_size: int) -> None:
    results = run_ranks(_parity, world_size, False, timeout_s=180)
    for diffs in results:
        assert max(diffs.values()) <= 1e-6, diffs
