"""Cross-rank failures end every rank within seconds with an error naming the rank and the
shardopt operation (Note [failure board] in shardopt.failures), and the debug mode names the
first collective that diverged (Note [collective sequence check] in shardopt.failures).

Each scenario runs real processes on gloo with a group timeout far above the bound asserted,
so a pass shows the board ended the wait, not the timeout. The surviving rank writes what
it caught to a file, because the failing rank makes ``run_ranks`` raise.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shardopt import comm
from shardopt.failures import describe
from shardopt.nn import FullyShardedDataParallel as FSDP
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import RankFailure, run_ranks
from tests.helpers.data import rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

GROUP_TIMEOUT_S = 60.0  # far above every bound asserted below
BOUND_S = 8.0


def _record(path: str, rank: int, **values: Any) -> None:
    Path(path, f"rank{rank}.json").write_text(json.dumps(values))


def _survivor(path: str, rank: int, run: Any) -> None:
    """Run ``run`` and write what it raised (type, message, seconds) for the parent."""
    start = time.monotonic()
    try:
        run()
        _record(path, rank, error=None, seconds=time.monotonic() - start)
    except BaseException as exc:
        _record(path, rank, error=str(exc), kind=type(exc).__name__, seconds=time.monotonic() - start)
        raise


def _sdp_setup(rank: int) -> tuple[ShardedDataParallel, OSS]:
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    return ShardedDataParallel(model, opt, reduce_buffer_size=0), opt


def _failing_rank(rank: int, world_size: int, path: str, how: str) -> None:
    sdp, opt = _sdp_setup(rank)
    sdp(rank_batch(rank, 0)).sum().backward()
    opt.step()  # one good step first
    if rank == 1:
        if how == "raise":  # a Python error; run_ranks reports it and the process exits
            raise ValueError("bad batch on rank one")
        if how == "sigkill_mid_backward":
            def die(grad: torch.Tensor) -> torch.Tensor:
                os.kill(os.getpid(), signal.SIGKILL)
                return grad
            out = sdp(rank_batch(rank, 1))
            out.register_hook(die)
            out.sum().backward()
        if how == "stuck_after_report":  # alive, reported, never joins the collective
            comm.report_failure("out of memory on rank one (simulated)")
            time.sleep(GROUP_TIMEOUT_S)
        if how == "sigkill_mid_step":
            os.kill(os.getpid(), signal.SIGKILL)
    def train() -> None:
        sdp(rank_batch(rank, 1)).sum().backward()
        opt.step()
    _survivor(path, rank, train)


@pytest.mark.parametrize(
    "how, expected",
    [
        ("raise", "rank 1 failed: ValueError: bad batch on rank one"),
        ("sigkill_mid_backward", "rank 1 left"),
        ("stuck_after_report", "rank 1 failed: out of memory on rank one (simulated)"),
        ("sigkill_mid_step", "rank 1 left"),
    ],
)
def test_a_failing_rank_ends_its_peer_within_seconds_naming_rank_and_operation(
    tmp_path: Path, how: str, expected: str
) -> None:
    with pytest.raises(RankFailure):
        run_ranks(_failing_rank, 2, str(tmp_path), how, timeout_s=GROUP_TIMEOUT_S)
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["kind"] == "CollectiveError", seen
    assert expected in seen["error"], seen
    assert seen["error"].startswith("[rank 0] ShardedDataParallel's gradient reduction") or \
        seen["error"].startswith("[rank 0] OSS's parameter gather after the step"), seen
    assert seen["seconds"] < BOUND_S, seen


def _fsdp_peer_raises(rank: int, world_size: int, path: str) -> None:
    model = FSDP(seeded_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if rank == 1:
        raise RuntimeError("data loader crashed on rank one")
    _survivor(path, rank, lambda: (model(rank_batch(rank, 0)).sum().backward(), opt.step()))


def test_fsdp_peer_failure_is_named_with_the_unit_operation(tmp_path: Path) -> None:
    with pytest.raises(RankFailure):
        run_ranks(_fsdp_peer_raises, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["kind"] == "CollectiveError", seen
    assert "rank 1 failed: RuntimeError: data loader crashed on rank one" in seen["error"], seen
    assert "FullyShardedDataParallel's parameter all-gather of unit 'root'" in seen["error"], seen
    assert seen["seconds"] < BOUND_S, seen


def _diverged(rank: int, world_size: int) -> str:
    os.environ["SHARDOPT_DEBUG_COLLECTIVES"] = "1"
    t = torch.ones(3)
    try:
        comm.all_reduce(t, None, label="shardopt::oss::clip_grad_norm").wait()  # the same on both
        if rank == 0:
            comm.broadcast(t, 0, None, label="shardopt::sdp::startup_sync").wait()
        else:
            comm.all_reduce(t, None, label="shardopt::scaler::found_inf").wait()
    except ValueError as exc:
        return str(exc)
    finally:
        os.environ.pop("SHARDOPT_DEBUG_COLLECTIVES")
    return ""


def test_debug_mode_names_the_first_collective_that_diverged() -> None:
    messages = run_ranks(_diverged, 2, timeout_s=30)
    assert "call #1 is 'shardopt::sdp::startup_sync' but group rank 1's is #1 'shardopt::scaler::found_inf'" \
        in messages[0], messages
    assert "call #1 is 'shardopt::scaler::found_inf' but group rank 0's is #1 'shardopt::sdp::startup_sync'" \
        in messages[1], messages


def test_labels_read_as_operations() -> None:
    assert describe("shardopt::sdp::reduce::bucket3") == "ShardedDataParallel's gradient reduction of bucket 3"
    assert describe("shardopt::fsdp::reduce_scatter::blocks.0") == \
        "FullyShardedDataParallel's gradient reduce-scatter of unit 'blocks.0'"
    assert describe("shardopt::oss::param_gather") == "OSS's parameter gather after the step"
    assert describe("all_reduce") == "the collective 'all_reduce'"


def _killed_mid_save(rank: int, world_size: int, folder: str) -> None:
    from shardopt import checkpoint

    sdp, opt = _sdp_setup(rank)
    path = os.path.join(folder, "ckpt")
    checkpoint.save_sharded(path, sdp.module, opt, {"step": 1})  # the checkpoint that must survive
    sdp(rank_batch(rank, 1)).sum().backward()
    opt.step()
    if rank == 1:
        import torch.distributed.checkpoint as dcp

        real_save = dcp.save

        def die_while_writing(*args: Any, **kwargs: Any) -> Any:
            os.kill(os.getpid(), signal.SIGKILL)
            return real_save(*args, **kwargs)

        dcp.save = die_while_writing  # type: ignore[assignment]
    _survivor(folder, rank, lambda: checkpoint.save_sharded(path, sdp.module, opt, {"step": 2}))


def _load_step(rank: int, world_size: int, path: str) -> int:
    from shardopt import checkpoint

    sdp, opt = _sdp_setup(rank)
    return int(checkpoint.load_sharded(path, sdp.module, opt)["step"])


def test_a_rank_killed_mid_save_ends_its_peer_and_the_previous_checkpoint_survives(tmp_path: Path) -> None:
    with pytest.raises(RankFailure):
        run_ranks(_killed_mid_save, 2, str(tmp_path), timeout_s=GROUP_TIMEOUT_S)
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["kind"] == "CollectiveError" and "rank 1 left" in seen["error"], seen
    assert seen["error"].startswith("[rank 0] shardopt.checkpoint's sharded save did not complete"), seen
    assert seen["seconds"] < BOUND_S, seen
    assert run_ranks(_load_step, 2, str(tmp_path / "ckpt"), timeout_s=60) == [1, 1]
