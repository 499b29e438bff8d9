"""Prefetch follows the execution order recorded in the first step, within its bound.

The events of a step are logged in order: ``gather:<unit>`` when an all-gather is issued
(``shardopt.comm.all_gather_into`` is wrapped inside the rank), ``fwd:<unit>`` when the
wrapped block's own forward starts and ``bwd:<unit>`` when its backward has finished.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardopt import comm
from shardopt.nn.fsdp import BackwardPrefetch, FullyShardedDataParallel as FSDP
from shardopt.nn.fsdp import ModuleClassPolicy, ShardingStrategy
from shardopt.testing import run_ranks
from tests.helpers.fsdp import all_sharded
from tests.helpers.gpt import Block, lm_loss, tokens
from tests.helpers.gpt import SkippingGPT as _SkippingGPT

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)


def _logged_step(model: FSDP, core: _SkippingGPT, rank: int, log: list[str]) -> None:
    log.clear()
    toks = tokens(rank, 1)
    lm_loss(model(toks), toks).backward()


def _events(rank: int, world_size: int) -> dict[str, Any]:
    log: list[str] = []
    original = comm.all_gather_into

    def logged(output: torch.Tensor, input: torch.Tensor, group: Any, label: str = "all_gather") -> comm.PendingWork:
        log.append("gather:" + label.rsplit("::", 1)[-1])
        return original(output, input, group, label)

    comm.all_gather_into = logged  # type: ignore[assignment]
    out: dict[str, Any] = {}
    try:
        for fwd in (False, True):
            for bwd in (None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST):
                for limit in (True, False):
                    torch.manual_seed(0)
                    core = _SkippingGPT(depth=4)
                    for i, block in enumerate(core.blocks):
                        block.register_forward_pre_hook(lambda m, a, i=i: log.append(f"fwd:blocks.{i}"))
                        block.register_full_backward_hook(lambda m, gi, go, i=i: log.append(f"bwd:blocks.{i}"))
                    model = FSDP(core, sharding_strategy=ShardingStrategy.FULL_SHARD, forward_prefetch=fwd,
                                 backward_prefetch=bwd, limit_all_gathers=limit,
                                 auto_wrap_policy=ModuleClassPolicy((Block,)))
                    _logged_step(model, core, rank, log)  # records the order
                    _logged_step(model, core, rank, log)
                    out[f"{fwd}/{bwd}/{limit}"] = list(log)
                    core.skip = (1,)
                    _logged_step(model, core, rank, log)
                    out[f"{fwd}/{bwd}/{limit}/skip"] = list(log)
                    assert all_sharded(model)
    finally:
        comm.all_gather_into = original  # type: ignore[assignment]
    return out


def _before(log: list[str], a: str, b: str, nth_a: int = 0) -> bool:
    """Whether the nth_a-th occurrence of ``a`` comes before the first ``b``."""
    positions = [i for i, e in enumerate(log) if e == a]
    return len(positions) > nth_a and positions[nth_a] < log.index(b)


def test_prefetch_follows_recorded_order_and_limit_bounds_gathered_units() -> None:
    out = run_ranks(_events, 2)[0]
    for limit in (True, False):
        for bwd in (None, BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_POST):
            plain, ahead = out[f"False/{bwd}/{limit}"], out[f"True/{bwd}/{limit}"]
            # forward: without prefetch block 2 is gathered after block 1 starts, with it before
            assert not _before(plain, "gather:blocks.2", "fwd:blocks.1"), plain
            assert _before(ahead, "gather:blocks.2", "fwd:blocks.1"), ahead
        # backward: FULL_SHARD gathers each block again; BACKWARD_PRE issues block 1's second
        # gather before block 2's backward has finished, no prefetch only after it
        pre = out[f"False/{BackwardPrefetch.BACKWARD_PRE}/{limit}"]
        none = out[f"False/None/{limit}"]
        post = out[f"False/{BackwardPrefetch.BACKWARD_POST}/{limit}"]
        assert _before(pre, "gather:blocks.1", "bwd:blocks.2", nth_a=1), pre
        assert not _before(none, "gather:blocks.1", "bwd:blocks.2", nth_a=1), none
        assert pre.count("gather:blocks.1") == none.count("gather:blocks.1") == post.count("gather:blocks.1") == 2
    # Block 1 is skipped in the last step but was prefetched by block 0 and stays unused.
    # With the limit, block 2 may not prefetch block 3 while it is held; without, it may.
    limited, unlimited = out["True/None/True/skip"], out["True/None/False/skip"]
    assert "fwd:blocks.1" not in limited and "gather:blocks.1" in limited
    assert not _before(limited, "gather:blocks.3", "fwd:blocks.2"), limited
    assert _before(unlimited, "gather:blocks.3", "fwd:blocks.2"), unlimited
