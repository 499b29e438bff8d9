"""The check-in that gives each torchrun attempt its own store namespace (Note [one store namespace
per attempt] in shardopt.elastic), and shardopt's own keys scoped to the attempt.

Ranks are threads here, each with its own client of one TCPStore, as torchrun's workers are
clients of the agent's; a previous attempt is simulated by its keys left in the store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from shardopt import elastic, failures
from shardopt.elastic import ATTEMPT_PREFIX, attempt_store


@pytest.fixture
def server() -> Any:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    yield store


def _client(server: Any) -> Any:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30))


def _ranks(world: int, body: Callable[[int], Any], delays: dict[int, float] | None = None) -> dict[int, Any]:
    """Run ``body(rank)`` on ``world`` threads (rank r starting ``delays[r]`` s late); what each returned or raised."""
    out: dict[int, Any] = {}

    def run(rank: int) -> None:
        time.sleep((delays or {}).get(rank, 0.0))
        try:
            out[rank] = body(rank)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_every_attempt_agrees_on_a_namespace_no_earlier_attempt_used_however_late_its_ranks_start(server: Any) -> None:
    world = 3
    tokens = []
    for delays in ({}, {1: 0.4}, {0: 0.3, 2: 0.6}, {2: 0.5}):  # attempt 0, then restarts with late ranks
        got = _ranks(world, lambda r: attempt_store(_client(server), r, world, timedelta(seconds=20))[1], delays)
        assert sorted(got) == list(range(world)) and len(set(got.values())) == 1, got
        tokens.append(got[0])
    assert len(set(tokens)) == len(tokens)


def test_keys_of_a_dead_attempt_are_not_seen_in_the_next_ones_namespace(server: Any) -> None:
    key = "default_pg/0//cpu/rank_0"  # where gloo keeps rank 0's address

    def first(rank: int) -> bool:
        store, _ = attempt_store(_client(server), rank, 2, timedelta(seconds=20))
        if rank == 0:
            store.set(key, "127.0.0.1:1234")
        store.wait([key], timedelta(seconds=20))
        return bool(store.check([key]))

    def restarted(rank: int) -> bool:
        store, _ = attempt_store(_client(server), rank, 2, timedelta(seconds=20))
        return bool(store.check([key]))

    assert _ranks(2, first) == {0: True, 1: True}
    assert _ranks(2, restarted, {0: 0.3}) == {0: False, 1: False}


def test_rank_0_names_the_ranks_that_never_checked_in_and_answers_the_others(server: Any) -> None:
    got = _ranks(2, lambda r: attempt_store(_client(server), r, 3, timedelta(seconds=1)))  # rank 2 never starts
    assert isinstance(got[0], TimeoutError), got
    assert str(got[0]).startswith("[rank 0] shardopt.elastic: ranks [2] never said hello within 1 s"), got[0]
    assert not isinstance(got[1], Exception), got  # rank 1 was answered before rank 0 gave up


def test_a_rank_that_checked_in_but_got_no_answer_is_counted_by_rank_0(server: Any) -> None:
    # A stale hello of rank 2 is in the store (from an earlier attempt), but rank 2 is gone.
    server.set(f"{ATTEMPT_PREFIX}hello/2", "an-old-nonce")
    got = _ranks(2, lambda r: attempt_store(_client(server), r, 3, timedelta(seconds=1)))
    assert isinstance(got[0], TimeoutError), got
    assert str(got[0]).startswith("[rank 0] shardopt.elastic: 1 of ranks 1..2 did not answer within 1 s"), got[0]
    assert not isinstance(got[1], Exception), got  # rank 1 was answered before rank 0 gave up


def test_a_rank_says_when_rank_0_never_answers(server: Any) -> None:
    got = _ranks(2, lambda r: attempt_store(_client(server), r + 1, 3, timedelta(seconds=1)))
    for rank in (1, 2):
        assert isinstance(got[rank - 1], TimeoutError), got
        assert str(got[rank - 1]).startswith(f"[rank {rank}] shardopt.elastic: rank 0 did not answer this rank's "
                                             "check-in within 1 s"), got


def test_a_rank_outside_the_world_and_arguments_torchrun_decides_are_refused(server: Any) -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2; pass this process's RANK"):
        attempt_store(_client(server), 2, 2)
    with pytest.raises(ValueError, match=r"\['rank', 'world_size'\] come from torchrun's environment"):
        elastic.init_process_group("gloo", rank=0, world_size=1)


def test_shardopt_keys_of_an_earlier_attempt_are_not_read_by_the_next(server: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Both ways of forming the group, two attempts each on one store: a failure reported in
    # attempt 0 must not be on the board in attempt 1 (it ended the first collective that
    # waited longer than half a second, naming a rank of a dead attempt).
    monkeypatch.setattr(failures, "_reported", set())
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    for through_shardopt in (True, False):
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", str(through_shardopt))
        for restart in ("0", "1"):
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
            if through_shardopt:
                assert elastic.init_process_group("gloo") is not None
            else:  # torch's own env:// rendezvous on the same store (no attempt namespace)
                dist.init_process_group("gloo", store=dist.PrefixStore("default_pg", _client(server)), rank=0,
                                        world_size=1)
            try:
                assert not failures.any_reported(), (through_shardopt, restart)
                failures.report_failure("RuntimeError: attempt " + restart)
                assert failures.any_reported()
            finally:
                failures._reported.clear()
                dist.destroy_process_group()
