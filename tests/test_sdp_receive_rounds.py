"""ShardedDataParallel's receive buffers do not grow with the number of ranks (Note [receive
rounds] in shardopt/nn/data_parallel/grad_buckets.py).

Regression: a bucket's owner received one copy of its part from every rank in one all-to-all,
so a rank that owns a whole parameter of a bucket held N copies of it. Under the fake group
(``shardopt rehearse``), rank 0 of ZeRO-2 on the 27M GPT (it owns a 528 x 2112 matrix) held
160 MB of communication buffers at N = 8 and 1.21 GB at N = 256 (4.6 GB at N = 1024). Now the
all-to-all goes in rounds that receive at most max(two buckets, 64 MiB) at once, and the sum
is the one-round sum bit for bit: checked on real gloo ranks with the floor patched to 0, so
that these small models need 2 to 4 rounds per bucket.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from shardopt.app.precision import Precision
from shardopt.app.rehearse import RehearsalConfig, rehearse_rank
from shardopt.app.rehearse_build import model_spec, num_params
from shardopt.nn import ShardedDataParallel
from shardopt.nn.data_parallel import grad_buckets
from shardopt.nn.data_parallel.grad_buckets import RECEIVE_FLOOR_BYTES, plan_buckets, sources_per_round
from shardopt.optim import OSS
from shardopt.partition import partition_by_size
from shardopt.testing import run_ranks
from tests.helpers.sdp import VocabModel, vocab_loss

GPT_27M = model_spec("27m", None)


def test_a_round_never_receives_more_than_two_buckets_or_the_floor_at_any_world_size() -> None:
    _, shapes = num_params(GPT_27M)
    params = [nn.Parameter(torch.empty(s, device="meta", dtype=torch.bfloat16)) for s in shapes]
    for n in (8, 64, 256, 1024):
        owners = partition_by_size([p.numel() for p in params], n).owners
        for spec in plan_buckets(params, owners, n, 2**23, {torch.bfloat16: torch.float32}):
            k, share = sources_per_round(spec), max(spec.splits) * 4
            rounds = math.ceil(n / k)
            assert k >= 2 and k * share <= max(2 * spec.numel * 4, RECEIVE_FLOOR_BYTES), (n, spec.index)
            assert (rounds == 1) == (n * share <= max(2 * spec.numel * 4, RECEIVE_FLOOR_BYTES)), (n, spec.index)


def test_zero2_communication_buffers_at_256_ranks_stay_within_a_bound_independent_of_n() -> None:
    # Bound: every bucket's send pieces (the model's gradient in the fp32 wire dtype, as the
    # buckets fill; the same at every N) plus three receive windows of max(2 buckets, 64 MiB):
    # the queue keeps two default buckets in flight (Note [reductions in flight]) and posts the
    # next one's first round before it retires the oldest.
    numel, _ = num_params(GPT_27M)
    bound = 4 * numel + 3 * max(2 * 4 * 2**23, RECEIVE_FLOOR_BYTES)
    comm_bytes = {}
    for n in (8, 256):
        config = RehearsalConfig(GPT_27M, "zero2", Precision("bf16-master"), n, seq_len=16, steps=4, threads=1)
        result = rehearse_rank(config, 0)  # rank 0 owns a 528 x 2112 matrix whole at N = 8 and at 256
        assert result.replay_matched
        comm_bytes[n] = result.memory.comm
    assert max(comm_bytes.values()) <= bound, (comm_bytes, bound)  # before: 160 MB at 8, 1.21 GB at 256 (bound 310 MB)
    assert comm_bytes[256] <= comm_bytes[8], comm_bytes


def _run(rank: int, world_size: int, floor: int | None, dtype: torch.dtype, split: bool,
         wire: torch.dtype | None) -> tuple[list[torch.Tensor], list[int]]:
    """Five steps of ZeRO-2 on VocabModel in small buckets; the parameters after them and each
    bucket's rounds. ``floor`` replaces RECEIVE_FLOOR_BYTES while the wrapper is built (None:
    the default, one round per bucket on this model)."""
    saved = grad_buckets.RECEIVE_FLOOR_BYTES
    if floor is not None:
        grad_buckets.RECEIVE_FLOOR_BYTES = floor
    try:
        model = VocabModel(dtype)
        master = torch.float32 if dtype != torch.float32 else None
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, split_large_params=split, master_dtype=master)
        sdp = ShardedDataParallel(model, opt, reduce_buffer_size=2**13, reduce_dtype=wire)
        rounds = [math.ceil(world_size / sources_per_round(b.spec)) for b in sdp.reduction_buckets]
    finally:
        grad_buckets.RECEIVE_FLOOR_BYTES = saved
    for step in range(5):
        opt.zero_grad(set_to_none=step % 2 == 0)
        vocab_loss(sdp, rank, step).backward()
        opt.step()
    assert all(not b.holds_buffers for b in sdp.reduction_buckets)
    return [p.detach().clone() for p in model.parameters()], rounds


def _rounds_against_one(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype, split, wire in ((torch.float32, False, None), (torch.float32, True, None),
                               (torch.bfloat16, True, None), (torch.bfloat16, False, torch.bfloat16)):
        tag = f"{dtype}/split={split}/wire={wire}"
        one, one_rounds = _run(rank, world_size, None, dtype, split, wire)
        many, many_rounds = _run(rank, world_size, 0, dtype, split, wire)
        out[tag] = (max(one_rounds), max(many_rounds), all(torch.equal(a, b) for a, b in zip(one, many, strict=True)))
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [3, 4])
def test_rounds_sum_bit_for_bit_as_one_all_to_all_on_gloo(world_size: int) -> None:
    results = run_ranks(_rounds_against_one, world_size)
    for tag, (one, many, _) in results[0].items():
        assert one == 1 and many >= 2, (world_size, tag, one, many)
    for rank, result in enumerate(results):
        assert all(equal for _, _, equal in result.values()), (world_size, rank, result)
