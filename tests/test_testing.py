"""shardopt.testing.run_ranks: results per rank, failures and hangs become errors in the parent."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from shardopt.testing import RankFailure, RankTimeout, run_ranks

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)


def _identity(rank: int, world_size: int, tag: str) -> tuple[int, int, str, int, float, torch.Tensor]:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world_size, tag, os.getpid(), t.item(), torch.full((1000,), float(rank))


def test_results_and_tensors_come_back_indexed_by_rank() -> None:
    for world_size in (1, 3):
        out = run_ranks(_identity, world_size, "x", timeout_s=30)
        assert [o[0] for o in out] == list(range(world_size))
        assert all(o[1] == world_size and o[2] == "x" for o in out)
        assert len({o[3] for o in out}) == world_size  # real, separate processes
        assert {o[4] for o in out} == {world_size * (world_size + 1) / 2}  # a real collective ran
        # Tensors come back by value, readable after the rank processes are gone.
        assert all(torch.equal(o[5], torch.full((1000,), float(r))) for r, o in enumerate(out))


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise KeyError("boom-from-rank-one")
    dist.barrier()


def test_raising_rank_becomes_rank_failure_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank_one_raises, 2, timeout_s=20)
    assert info.value.rank == 1
    message = str(info.value)
    assert message.startswith("[rank 1] failed")
    assert "KeyError: 'boom-from-rank-one'" in message and "_rank_one_raises" in message
    assert time.monotonic() - start < 15  # the peer stuck in the barrier does not hold us for long


def _rank_zero_skips_barrier(rank: int, world_size: int) -> None:
    if rank != 0:
        dist.barrier()


def _rank_zero_sleeps(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)


def test_hang_ends_within_the_timeout() -> None:
    # A rank that skips a collective: the peer's collective times out (the group timeout).
    start = time.monotonic()
    with pytest.raises((RankFailure, RankTimeout)) as info:
        run_ranks(_rank_zero_skips_barrier, 2, timeout_s=3)
    assert time.monotonic() - start < 3 + 10
    if isinstance(info.value, RankFailure):
        assert info.value.rank == 1
    # A rank stuck outside any collective: killed by the parent and named.
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0\] did not finish within 2 s") as timeout_info:
        run_ranks(_rank_zero_sleeps, 2, timeout_s=2)
    assert timeout_info.value.ranks == [0]
    assert time.monotonic() - start < 2 + 6


def _unpicklable(rank: int, world_size: int) -> object:
    return lambda: rank


def test_unpicklable_result_is_reported_not_lost() -> None:
    with pytest.raises(RankFailure, match="pickle"):
        run_ranks(_unpicklable, 1, timeout_s=20)


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        run_ranks(_identity, 0, "x")
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        run_ranks(_identity, 1, "x", backend="mpi")


def _draws(rank: int, world_size: int) -> tuple[list[float], float, float]:
    import numpy

    return torch.rand(3).tolist(), random.random(), float(numpy.random.rand())


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_every_rank_starts_from_the_callers_random_state_forked_or_spawned(
        start: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy

    import shardopt.testing

    if start == "spawn":  # what run_ranks does wherever CUDA is visible (Note [fork safety])
        monkeypatch.setattr(shardopt.testing, "_fork_is_safe", lambda: False)
    elif not shardopt.testing._fork_is_safe():
        pytest.skip("this machine spawns the ranks (CUDA is visible)")
    torch.manual_seed(11)
    random.seed(12)
    numpy.random.seed(13)
    ranks = run_ranks(_draws, 2, timeout_s=60)
    expected = (torch.rand(3).tolist(), random.random(), float(numpy.random.rand()))  # the caller's next draws
    assert ranks == [expected, expected], (ranks, expected)
