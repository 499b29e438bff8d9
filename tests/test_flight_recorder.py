"""Ranks that run different programs are named within seconds (Note [flight recorder]).

Each scenario is a real training-loop mistake at 2 ranks on gloo, with a group timeout of
60 s. Before the flight recorder every one of them waited for the group timeout and then
reported a transport error; now every rank ends with a ``CollectiveError`` that names the
other rank, where it is and the likely cause, in well under the timeout. Every rank writes
what it caught to a file, because the failing ranks make ``run_ranks`` raise.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from shardopt import checkpoint, comm, flight
from shardopt.nn import FullyShardedDataParallel as FSDP
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
    sdp, opt = _sdp(rank, optim=torch.optim.LBFGS, lr=1.0, max_iter=20)
    for step in range(3):
        def closure() -> float:
            opt.zero_grad()
            loss = (sdp(rank_batch(rank, step)) ** 2).sum() * (1.0 + 10 * rank)
            loss.backward()
            return float(loss)
        opt.step(closure)


def _fsdp_forward_on_rank0_only(rank: int, path: str) -> None:
    model = FSDP(seeded_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        with torch.no_grad():
            model(rank_batch(rank, 99))  # evaluation on rank 0 only
    for step in range(3):
        model(rank_batch(rank, step)).sum().backward()
        opt.step()
        opt.zero_grad()


def _fsdp_state_dict_on_rank0_only(rank: int, path: str) -> None:
    model = FSDP(seeded_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        model.state_dict()
    for step in range(3):
        model(rank_batch(rank, step)).sum().backward()
        opt.step()
        opt.zero_grad()


SCENARIOS: dict[str, Callable[[int, str], None]] = {
    "step on one rank only": _step_on_one_rank,
    "step twice on one rank": _step_twice_on_one_rank,
    "backward skipped on one rank": _backward_skipped,
    "uneven data then a collective save": _uneven_data_then_save,
    "no_sync on one rank only": _no_sync_on_one_rank,
    "save_consolidated on rank 0 only": _save_on_rank0_only,
    "freezing on one rank only": _freeze_on_one_rank,
    "no data on one rank": _no_data_on_one_rank,
    "LBFGS with a closure": _lbfgs_closure,
    "ZeRO-3 forward on rank 0 only": _fsdp_forward_on_rank0_only,
    "ZeRO-3 state_dict() on rank 0 only": _fsdp_state_dict_on_rank0_only,
}


def _run(rank: int, world_size: int, path: str, name: str) -> None:
    start = time.monotonic()
    try:
        SCENARIOS[name](rank, path)
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
        print(name, rank, seen)
        assert seen["error"] is not None, (rank, seen)
        assert seen["seconds"] < BOUND_S, (rank, seen)
