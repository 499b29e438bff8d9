"""OSS against DDP with the same torch optimizer: bit-identical at 2 ranks in fp32."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.common import max_abs_diff, rank_batch, seeded_mlp


def _oss_matches_ddp(rank: int, world_size: int) -> float:
    ref, sharded = seeded_mlp(), seeded_mlp()
    ddp_ref, ddp_sharded = DDP(ref), DDP(sharded)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = OSS(sharded.parameters(), optim=torch.optim.Adam, lr=1e-2)
    for step in range(6):
        x = rank_batch(rank, step)
        for model, o in ((ddp_ref, opt_ref), (ddp_sharded, opt)):
            o.zero_grad(set_to_none=step % 2 == 0)
            model(x).pow(2).mean().backward()
            o.step()
    return max_abs_diff(ref.parameters(), sharded.parameters())


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_oss_adam_matches_ddp(world_size: int) -> None:
    diffs = run_ranks(_oss_matches_ddp, world_size)
    tolerance = 0.0 if world_size <= 2 else 1e-6
    assert max(diffs) <= tolerance, diffs
