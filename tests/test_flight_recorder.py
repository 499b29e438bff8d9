"""Ranks that run different programs are named within seconds (Note [flight recorder]).

Each scenario is a real training-loop mistake at 2 ranks on gloo, with a group timeout of
60 s. Before the flight recorder every one of them waited for the group timeout and then
reported a transport error; now every rank ends with a ``CollectiveError`` that names the
other rank, where it is and the likely cause, in well under the timeout. Every rank writes
what it caught to a file, because the failing ranks make ``run_ranks`` raise.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from shardopt import checkpoint, comm, flight
from shardopt.nn import FullyShardedDataParallel as FSDP
from shardopt.nn.fsdp import ModuleClassPolicy
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import RankFailure, run_ranks
from tests.helpers.data import rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

GROUP_TIMEOUT_S = 60.0  # far above every bound asserted below
BOUND_S = 15.0  # grace (2 s) + a few slices, with room for a loaded 2-core machine


def _sdp(rank: int, optim: Any = torch.optim.SGD, **kwargs: Any) -> tuple[ShardedDataParallel, OSS]:
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=optim, **({"lr": 0.1} | kwargs))
    return ShardedDataParallel(model, opt, reduce_buffer_size=0), opt


def _train(sdp: Any, opt: Any, rank: int, step: int) -> None:
    sdp(rank_batch(rank, step)).sum().backward()
    opt.step()
    opt.zero_grad()


def _step_on_one_rank(rank: int, path: str) -> None:
    sdp, opt = _sdp(rank)
    _train(sdp, opt, rank, 0)
    sdp(rank_batch(rank, 1)).sum().backward()
    if rank == 0:
        opt.step()
    for step in range(2, 5):
        _train(sdp, opt, rank, step)


def _step_twice_on_one_rank(rank: int, path: str) -> None:
    sdp, opt = _sdp(rank)
    sdp(rank_batch(rank, 1)).sum().backward()
    opt.step()
    if rank == 0:
        opt.step()
    for step in range(2, 5):
        _train(sdp, opt, rank, step)


def _backward_skipped(rank: int, path: str) -> None:
    sdp, opt = _sdp(rank)
    loss = sdp(rank_batch(rank, 1)).sum()
    if rank == 0:
        loss.backward()
    opt.step()
    for step in range(2, 5):
        _train(sdp, opt, rank, step)


def _uneven_data_then_save(rank: int, path: str) -> None:
    sdp, opt = _sdp(rank)
    for step in range(3 if rank == 0 else 2):
        _train(sdp, opt, rank, step)
    checkpoint.save_consolidated(os.path.join(path, "ck.pt"), sdp.module, opt)


def _no_sync_on_one_rank(rank: int, path: str) -> None:
    sdp, opt = _sdp(rank)
    for step in range(3):
        if rank == 0:
            with sdp.no_sync():
                sdp(rank_batch(rank, step)).sum().backward()
        else:
            sdp(rank_batch(rank, step)).sum().backward()
        sdp(rank_batch(rank, step + 10)).sum().backward()
        opt.step()
        opt.zero_grad()


def _save_on_rank0_only(rank: int, path: str) -> None:
    sdp, opt = _sdp(rank)
    _train(sdp, opt, rank, 0)
    if rank == 0:
        checkpoint.save_consolidated(os.path.join(path, "ck.pt"), sdp.module, opt)
    for step in range(1, 4):
        _train(sdp, opt, rank, step)


def _freeze_on_one_rank(rank: int, path: str) -> None:
    sdp, opt = _sdp(rank)
    _train(sdp, opt, rank, 0)
    if rank == 1:
        next(sdp.module.parameters()).requires_grad_(False)
    for step in range(1, 4):
        _train(sdp, opt, rank, step)


def _no_data_on_one_rank(rank: int, path: str) -> None:
    sdp, opt = _sdp(rank)
    for step in range(3 if rank == 0 else 0):
        _train(sdp, opt, rank, step)
    checkpoint.save_consolidated(os.path.join(path, "ck.pt"), sdp.module, opt)


def _lbfgs_closure(rank: int, path: str) -> None:
    # Each rank's LBFGS sees only the parameters it owns. With the last layer zeroed, the
    # middle weight (the only parameter rank 0 owns at 2 ranks) gets a zero gradient, so
    # rank 0's LBFGS stops after one evaluation while rank 1's evaluates the closure again.
    model = seeded_mlp()
    with torch.no_grad():
        model[4].weight.zero_()
        model[4].bias.zero_()
    opt = OSS(model.parameters(), optim=torch.optim.LBFGS, lr=1.0, max_iter=20)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=0)
    for step in range(3):
        def closure() -> float:
            opt.zero_grad()
            loss = sdp(rank_batch(rank, step)).sum()
            loss.backward()
            return float(loss)
        opt.step(closure)


def _fsdp_forward_on_rank0_only(rank: int, path: str, per_layer: bool = False) -> None:
    model = FSDP(seeded_mlp(), auto_wrap_policy=ModuleClassPolicy((nn.Linear,)) if per_layer else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        with torch.no_grad():
            model(rank_batch(rank, 99))  # evaluation on rank 0 only
    for step in range(3):
        model(rank_batch(rank, step)).sum().backward()
        opt.step()
        opt.zero_grad()


def _fsdp_state_dict_on_rank0_only(rank: int, path: str, per_layer: bool = False) -> None:
    model = FSDP(seeded_mlp(), auto_wrap_policy=ModuleClassPolicy((nn.Linear,)) if per_layer else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        model.state_dict()
    for step in range(3):
        model(rank_batch(rank, step)).sum().backward()
        opt.step()
        opt.zero_grad()


STEP_HINT = "step() ran on one rank only or twice on one rank, backward was skipped on one rank"
SAVE_HINT = "a save, state_dict() or summon_full_params() ran on some ranks only, or a rank ran out of data first?"
# name: (scenario, the likely cause the message must give)
SCENARIOS: dict[str, tuple[Callable[[int, str], None], str]] = {
    "step on one rank only": (_step_on_one_rank, STEP_HINT),
    "step twice on one rank": (_step_twice_on_one_rank, STEP_HINT),
    "backward skipped on one rank": (_backward_skipped, STEP_HINT),
    "uneven data then a collective save": (_uneven_data_then_save, SAVE_HINT),
    "no_sync on one rank only": (_no_sync_on_one_rank, STEP_HINT),
    "save_consolidated on rank 0 only": (_save_on_rank0_only, SAVE_HINT),
    "freezing on one rank only": (_freeze_on_one_rank, "a change of the trainable parameters (requires_grad set on "
                                  "some ranks only)"),
    "no data on one rank": (_no_data_on_one_rank, SAVE_HINT),
    "LBFGS with a closure": (_lbfgs_closure, "an optimizer closure (e.g. LBFGS) ran backward a different number"),
    "ZeRO-3 forward on rank 0 only": (_fsdp_forward_on_rank0_only, "a forward (e.g. evaluation) or backward ran on "
                                      "one rank only? Run it on every rank, or read the full parameters with "
                                      "summon_full_params() called on every rank"),
    "ZeRO-3 state_dict() on rank 0 only": (_fsdp_state_dict_on_rank0_only, SAVE_HINT),
    # Units of different sizes: before, messages of two units could meet under one tag.
    "ZeRO-3 forward on rank 0 only, per-layer units": (
        lambda rank, path: _fsdp_forward_on_rank0_only(rank, path, per_layer=True),
        "a forward, e.g. evaluation, run on some ranks only"),
    "ZeRO-3 state_dict() on rank 0 only, per-layer units": (
        lambda rank, path: _fsdp_state_dict_on_rank0_only(rank, path, per_layer=True), "FullyShardedDataParallel"),
}


def _run(rank: int, world_size: int, path: str, name: str) -> None:
    """Run scenario ``name`` and write what it raised (message, seconds) for the parent."""
    start = time.monotonic()
    try:
        SCENARIOS[name][0](rank, path)
        values: dict[str, Any] = {"error": None}
    except BaseException as exc:
        values = {"error": str(exc), "kind": type(exc).__name__}
        raise
    finally:
        values["seconds"] = time.monotonic() - start
        Path(path, f"rank{rank}.json").write_text(json.dumps(values))


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_ranks_running_different_programs_are_named_within_seconds(tmp_path: Path, name: str) -> None:
    with pytest.raises(RankFailure):
        run_ranks(_run, 2, str(tmp_path), name, timeout_s=GROUP_TIMEOUT_S)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["kind"] == "CollectiveError", (rank, seen)
        assert seen["error"].startswith(f"[rank {rank}] "), (rank, seen)
        # Each rank names the other and where it is, itself or through the other's report.
        assert f"rank {1 - rank} is in " in seen["error"] or f"rank {1 - rank} failed: " in seen["error"], seen
        assert "the ranks run different programs" in seen["error"], (rank, seen)
        assert SCENARIOS[name][1] in seen["error"], (rank, seen)
        assert seen["seconds"] < BOUND_S, (rank, seen)


def test_three_ranks_with_step_on_one_rank_only_all_end_named(tmp_path: Path) -> None:
    # Ranks 1 and 2 agree with each other and disagree with rank 0: every rank ends, named.
    with pytest.raises(RankFailure):
        run_ranks(_run, 3, str(tmp_path), "step on one rank only", timeout_s=GROUP_TIMEOUT_S)
    for rank in range(3):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["kind"] == "CollectiveError" and "the ranks run different programs" in seen["error"], seen
        assert "OSS's parameter gather after the step" in seen["error"], seen
        assert seen["seconds"] < BOUND_S, (rank, seen)


def _stopped_peer(rank: int, world_size: int, path: str) -> None:
    sdp, opt = _sdp(rank)
    _train(sdp, opt, rank, 0)
    if rank == 1:
        time.sleep(2 * flight.BEAT_S)  # a beat after the last collective (beats lag by up to BEAT_S)
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, never resumed (run_ranks kills it)
    start = time.monotonic()
    try:
        _train(sdp, opt, rank, 1)
    except comm.CollectiveError as exc:
        Path(path, "rank0.json").write_text(json.dumps({"error": str(exc), "seconds": time.monotonic() - start}))
        raise


def test_a_stopped_rank_is_named_with_its_last_collective_after_the_heartbeat_bound(tmp_path: Path) -> None:
    with pytest.raises(RankFailure):
        run_ranks(_stopped_peer, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert "rank 1 stopped progressing: its heartbeat has not moved for" in seen["error"], seen
    assert "its last known collective is OSS's parameter gather after the step #" in seen["error"], seen
    assert seen["seconds"] < flight.GRACE_S + flight.STALE_S + BOUND_S, seen


def _slow_peer(rank: int, world_size: int) -> float:
    sdp, opt = _sdp(rank)
    _train(sdp, opt, rank, 0)
    if rank == 1:
        time.sleep(flight.GRACE_S + 3.0)  # busy outside any collective, alive: past the grace
    _train(sdp, opt, rank, 1)
    return float(next(sdp.module.parameters()).sum())


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_slow_but_alive_rank_is_waited_for_not_an_error(world_size: int) -> None:
    results = run_ranks(_slow_peer, world_size, timeout_s=GROUP_TIMEOUT_S)
    assert results == [results[0]] * world_size


def _sizes_differ(rank: int, world_size: int, path: str) -> None:
    n = 4 if rank == 0 else 8  # e.g. a parameter frozen on one rank only changed a bucket
    start = time.monotonic()
    try:
        comm.exchange([(torch.ones(n), 1 - rank)], [(torch.empty(n), 1 - rank)], None,
                      "shardopt::sdp::reduce::bucket0").wait()
    finally:
        Path(path, f"rank{rank}.txt").write_text(f"{time.monotonic() - start}")


def test_the_same_collective_with_other_sizes_is_named_not_a_gloo_abort(tmp_path: Path) -> None:
    # Before, the two messages met under one tag and gloo aborted rank 0 (SIGABRT, "Received
    # data size doesn't match expected size. 32 vs 16"); now their tags differ and the sizes
    # are named.
    with pytest.raises(RankFailure) as info:
        run_ranks(_sizes_differ, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    assert "is in the same collective (ShardedDataParallel's gradient reduction of bucket 0 #0) with other sizes" \
        in str(info.value), info.value
    assert "the ranks' models or settings differ" in str(info.value)
    for rank in range(2):
        assert float((tmp_path / f"rank{rank}.txt").read_text()) < BOUND_S


SHORT_TIMEOUT_S = 6.0  # the group's own timeout ends the wait before the heartbeat bound (2 s + 8 s)


def _stopped_under_a_short_timeout(rank: int, store: str, path: str) -> None:
    """One rank of a 2-rank gloo group with a 6 s timeout; rank 1 stops itself (SIGSTOP)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group("gloo", store=torch.distributed.FileStore(store, 2), rank=rank,
                                         world_size=2, timeout=timedelta(seconds=SHORT_TIMEOUT_S))
    sdp, opt = _sdp(rank)
    _train(sdp, opt, rank, 0)
    if rank == 1:
        time.sleep(2 * flight.BEAT_S)  # a beat after the last collective (beats lag by up to BEAT_S)
        os.kill(os.getpid(), signal.SIGSTOP)  # the parent kills it
    start = time.monotonic()
    try:
        _train(sdp, opt, rank, 1)
        values: dict[str, Any] = {"error": None}
    except Exception as exc:  # noqa: BLE001 - the CollectiveError this test is about, whatever it is
        values = {"error": str(exc), "kind": type(exc).__name__}
    values["seconds"] = time.monotonic() - start
    Path(path, f"rank{rank}.json").write_text(json.dumps(values))
    os._exit(0)  # no destroy_process_group(): its peer is stopped


def test_a_rank_stopped_under_a_short_group_timeout_is_named_with_its_last_collective(tmp_path: Path) -> None:
    # Before, rank 0 ended at the timeout with "rank 1 left without a report: it exited, was
    # killed or is stuck outside this collective", not saying that rank 1 was stopped, nor where.
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_stopped_under_a_short_timeout, args=(r, str(tmp_path / "store"), str(tmp_path)),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=120)
        assert procs[0].exitcode == 0, procs[0].exitcode
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)  # a stopped process dies at SIGKILL too; resume it anyway
                p.kill()
            p.join()
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["kind"] == "CollectiveError", seen
    assert seen["error"].startswith("[rank 0] ShardedDataParallel's gradient reduction of bucket 0 did not complete: "
                                    "rank 1 stopped progressing: its heartbeat has not moved for "), seen
    assert "its last known collective is OSS's parameter gather after the step #" in seen["error"], seen
    assert "Resume or restart that rank" in seen["error"] and "Timed out waiting 6000ms" in seen["error"], seen
    # Ended by the group's timeout (the backend's words above) plus the failure board's grace.
    assert SHORT_TIMEOUT_S <= seen["seconds"] < SHORT_TIMEOUT_S + BOUND_S, seen


def test_ranks_that_left_are_named_with_their_last_collective_a_stopped_one_first() -> None:
    label = "shardopt::sdp::reduce::bucket0"
    left = str(comm.CollectiveError(0, label, {}, [1, 2], "Connection closed by peer",
                                    last={1: "OSS's parameter gather after the step #4"}))
    assert left == ("[rank 0] ShardedDataParallel's gradient reduction of bucket 0 did not complete: rank 1 left "
                    "(and ranks [2]) without a report: it exited, was killed or is stuck outside this collective; its "
                    "last known collective is OSS's parameter gather after the step #4. Backend said: Connection "
                    "closed by peer")
    stopped = str(comm.CollectiveError(0, label, {}, [1, 2], "Timed out", last={2: "an object all-gather #0"},
                                       stalled={2: 5.04}))
    assert stopped == ("[rank 0] ShardedDataParallel's gradient reduction of bucket 0 did not complete: rank 2 stopped "
                       "progressing: its heartbeat has not moved for 5.0 s (the process was stopped, e.g. SIGSTOP, or "
                       "its machine froze); its last known collective is an object all-gather #0. Resume or restart "
                       "that rank (ranks [1] left without a report too). Backend said: Timed out")
