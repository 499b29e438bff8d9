"""One rank of N in one process under torch's fake process group (Note [fake process group] in
shardopt.failures), and ``shardopt estimate --measure`` (shardopt.fake_ranks, shardopt.app.measure):
the fake-group mode of the failure board and the agreement checks (a real group still names the rank
that left), the measured bytes against independent counts (the plans' arithmetic, FSDP's row slots),
the CLI rows, JSON and plot, and one-line errors for bad input."""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardopt import agreement, comm, failures
from shardopt.app.cli import main
from shardopt.app.decoder import Decoder, DecoderLayer, decoder_loss, scaled
from shardopt.app.shapes import SHAPE_PRESETS
from shardopt.fake_ranks import (
    Measured,
    Mode,
    Workload,
    fake_group_ddp_hook,
    measure,
    measure_rank,
    ranks_to_measure,
)
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.partition import partition_by_size, plan_split
from shardopt.testing import RankFailure, run_ranks
from tests.helpers.cli import assert_one_line_errors

LLAMA = SHAPE_PRESETS["llama3-8b"]
TINY = scaled(LLAMA, 128)  # 490k parameters: vocab 1002, hidden 32, 32 layers
SHORT = replace(TINY, num_layers=2)  # the same widths, 2 layers: quick to build
SMALL = scaled(LLAMA, 64)  # 1.96M parameters: vocab 2004, hidden 64; rows enough for N = 64


def _workload(shape: Any) -> Workload:
    return Workload(partial(Decoder, shape), partial(decoder_loss, vocab_size=shape.vocab_size), DecoderLayer)


@pytest.fixture
def fake_group() -> Iterator[None]:
    """A fake default group of 4 whose every collective raises (so a test sees any collective issued)."""
    options = FakeProcessGroup.Options()
    options.error_on_collective = True
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4, pg_options=options)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the fake-group mode


def test_fake_group_failure_quotes_the_backend_and_names_no_rank_as_left(fake_group: None) -> None:
    assert failures.is_fake_group()
    with pytest.raises(failures.CollectiveError) as exc:
        comm.all_reduce(torch.ones(4), None, label="shardopt::sdp::reduce::bucket0").wait()
    message = str(exc.value)
    assert message.startswith("[rank 1] ShardedDataParallel's gradient reduction of bucket 0 did not complete: "
                              "torch's fake process group (one process playing rank 1 of 4; no other rank exists) "
                              "refused the call: FakeProcessGroup collective operation error"), message
    assert "left" not in message and exc.value.left == [] and exc.value.failed == {}
    failures.report_failure("a report with nowhere to go")  # the fake store holds nothing: a no-op, no error
    assert not failures.any_reported()


def test_fake_group_agreement_and_arrival_pass_without_a_collective_or_store_key(fake_group: None) -> None:
    # every collective of this group raises and its store implements nothing: returning means none was used
    agreement.check_agreement("OSS", [("optim", "Adam")], None, "pass the same arguments")
    agreement.check_same_parameters("OSS", [{"params": [torch.zeros(3)]}], None)
    start = time.monotonic()
    assert agreement.arrive("shardopt::oss::clip_grad_norm", None, timeout_s=30.0) == []
    assert time.monotonic() - start < 1.0


def _leave_before_the_reduction(rank: int, world_size: int, path: str) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # leaves without a report
    try:
        comm.all_reduce(torch.ones(4), None, label="shardopt::sdp::reduce::bucket0").wait()
        seen = "completed"
    except failures.CollectiveError as exc:
        seen = str(exc)
    Path(path).write_text(json.dumps({"error": seen, "fake": failures.is_fake_group()}))


@pytest.mark.distributed
def test_a_real_group_still_names_the_rank_that_left(tmp_path: Path) -> None:
    out = tmp_path / "rank0.json"
    with pytest.raises(RankFailure):
        run_ranks(_leave_before_the_reduction, 2, str(out), timeout_s=60.0)
    seen = json.loads(out.read_text())
    assert not seen["fake"]
    assert seen["error"].startswith("[rank 0] ShardedDataParallel's gradient reduction of bucket 0 did not "
                                    "complete: rank 1 left"), seen
    assert "fake" not in seen["error"], seen


def _first_sequence_number(rank: int, world_size: int) -> int:
    return comm.all_reduce(torch.ones(2), None).seq


@pytest.mark.distributed
def test_a_real_group_made_after_fake_ones_numbers_its_collectives_from_0() -> None:
    for rank in (0, 1):  # this process plays two fake ranks, issuing collectives, before forking real ranks
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        comm.all_reduce(torch.ones(2), None).wait()
        assert comm.all_reduce(torch.ones(2), None).seq == 1  # each fake group counts from 0
        dist.destroy_process_group()
    assert run_ranks(_first_sequence_number, 2, timeout_s=60.0) == [0, 0]


def test_the_ddp_hook_refuses_a_group_that_is_not_fake() -> None:
    with pytest.raises(ValueError, match="fake_group_ddp_hook is for torch's fake process group only"):
        fake_group_ddp_hook(None, None)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- measurements


def test_every_mode_builds_trains_and_measures_under_a_fake_group_of_4() -> None:
    modes = list(Mode)
    results = measure(_workload(SHORT), SHORT.shapes(), modes, (False, True), (4,))
    assert [(r.mode, r.mixed) for r in results] == [(m, x) for m in modes for x in (False, True)]
    for r in results:
        assert [b.rank for b in r.ranks] == list(ranks_to_measure(r.mode, SHORT.shapes(), 4, r.mixed))
        assert all(b.world_size == 4 and b.total > 0 for b in r.ranks)
    assert not dist.is_initialized()  # each rank's group is gone
    gc.collect()  # and so is every wrapper (ShardedDataParallel's hooks would keep it alive unless closed)
    assert not [o for o in gc.get_objects() if isinstance(o, (ShardedDataParallel, OSS))]


def _owned(shapes: list[tuple[int, ...]], world_size: int, width: int, rank: int) -> list[int]:
    plan = partition_by_size([math.prod(s) * width for s in shapes], world_size)
    return [math.prod(shapes[i]) for i in plan.indices_of(rank)]


def test_zero1_optimizer_state_and_masters_are_exactly_the_plans_bytes() -> None:
    shapes, n = TINY.shapes(), 8
    for mixed in (False, True):
        for rank in (0, 3, 7):
            got = measure_rank(_workload(TINY), Mode.ZERO1, mixed, n, rank)
            owned = _owned(shapes, n, 2 if mixed else 4, rank)
            # Adam: exp_avg and exp_avg_sq in fp32 per owned element, and a 4-byte fp32 step per stepped
            # tensor: one per owned parameter, or with masters one for the flat tensor over those of a
            # multiple of 64 elements and one per other master (Note [aligned segments] in flat_masters)
            ragged = [k for k in owned if k % 64] if mixed else owned
            stepped = len(ragged) + (len(owned) > len(ragged))
            assert got.optimizer == 8 * sum(owned) + 4 * stepped, (mixed, rank)
            # fp32 masters of the owned parameters (no master gradient before the step: Note [what a measured
            # rank holds]); the parameters and DDP's gradients stay whole on every rank
            assert got.masters == (4 * sum(owned) if mixed else 0), (mixed, rank)
            psi = sum(math.prod(s) for s in shapes)
            assert got.params == got.grads == psi * (2 if mixed else 4)


def test_ddp_holds_everything_and_zero3_holds_its_row_slots() -> None:
    shapes, n, rank = TINY.shapes(), 8, 7
    psi = sum(math.prod(s) for s in shapes)
    ddp = measure_rank(_workload(TINY), Mode.DDP, False, n, rank)
    assert (ddp.params, ddp.grads, ddp.optimizer) == (4 * psi, 4 * psi, 8 * psi + 4 * len(shapes))
    zero3 = measure_rank(_workload(TINY), Mode.ZERO3, False, n, rank)
    # Note [flat parameter layout]: each rank holds ceil(rows / N) row slots of every parameter, padded
    slots = sum(math.ceil((s[0] if s else 1) / n) * math.prod(s[1:]) for s in shapes)
    assert zero3.params == zero3.grads == 4 * slots


def test_ranks_to_measure_finds_the_heaviest_rank_of_the_plan_oss_builds() -> None:
    shapes, n = TINY.shapes(), 8
    ranks = ranks_to_measure(Mode.ZERO2, shapes, n, mixed=True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    try:
        model = Decoder(TINY).to(torch.bfloat16)
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
        loads = opt.partition.rank_bytes
    finally:
        del opt, model
        dist.destroy_process_group()
    heaviest = max(range(n), key=lambda r: (loads[r], -r))
    assert set(ranks) == {0, heaviest, n - 1}
    split = plan_split([math.prod(s) * 2 for s in shapes], [s[0] if s else 1 for s in shapes], n).rank_bytes
    assert max(range(n), key=lambda r: (split[r], -r)) in ranks_to_measure(Mode.ZERO2_SPLIT, shapes, n, mixed=True)
    assert ranks_to_measure(Mode.ZERO3, shapes, n, mixed=True) == ranks_to_measure(Mode.DDP, shapes, n, True) == (0, 7)


def test_the_whole_parameter_plan_is_unbalanced_at_64_ranks() -> None:
    [zero2] = measure(_workload(SMALL), SMALL.shapes(), [Mode.ZERO2], (False,), (64,))
    assert isinstance(zero2, Measured) and zero2.heaviest.rank == 0  # the embedding's owner
    assert zero2.sharded_ratio is not None and zero2.sharded_ratio > 4.0  # the plan's 4.18x


def test_split_rows_bring_the_heaviest_rank_within_5_percent_of_the_ideal_at_64_ranks() -> None:
    for mixed in (False, True):
        [split] = measure(_workload(SMALL), SMALL.shapes(), [Mode.ZERO2_SPLIT], (mixed,), (64,))
        assert split.sharded_ratio is not None and split.sharded_ratio <= 1.05, (mixed, split.sharded_ratio)


def test_bad_measure_calls_fail_before_building(fake_group: None) -> None:
    with pytest.raises(RuntimeError, match=r"measure_rank makes its own fake default process group, but "
                                           r"torch\.distributed is already initialised"):
        measure_rank(_workload(TINY), Mode.DDP, False, 4, 0)


def test_bad_world_sizes_and_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        measure(_workload(TINY), TINY.shapes(), [Mode.DDP], (False,), (8, 0))
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 4\), got 4"):
        measure_rank(_workload(TINY), Mode.DDP, False, 4, 4)


def test_the_decoder_has_the_shapes_and_names_of_its_decoder_shape() -> None:
    model = Decoder(TINY)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == TINY.named_shapes()
    embed = dict(TINY.named_shapes())["model.embed_tokens.weight"]
    share = 2 * math.prod(embed) / sum(math.prod(s) for s in TINY.shapes())
    full = 2 * 128256 * 4096 / sum(math.prod(s) for s in LLAMA.shapes())
    assert abs(share - full) < 0.002  # the scaled copy keeps the embedding's and the head's share (6.5%)
    with pytest.raises(ValueError, match="--measure-scale 256 leaves head_dim 128 // 256 = 0"):
        scaled(LLAMA, 256)


# ---------------------------------------------------------------------- the command


def _estimate(tmp_path: Path, *extra: str) -> dict[str, Any]:
    """``estimate --measure`` of a 2-layer Llama-style config.json at scale 4 (vocab 1000, hidden 32)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"vocab_size": 4000, "hidden_size": 128, "intermediate_size": 448,
                                  "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
                                  "tie_word_embeddings": False}))
    out = tmp_path / "est.json"
    assert main(["estimate", "--hf-config", str(config), "--world-size", "8", "--measure", "--measure-scale", "4",
                 "--json", str(out), *extra]) == 0
    return dict(json.loads(out.read_text()))


def test_estimate_measure_prints_and_writes_each_mode_and_world_size(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = _estimate(tmp_path, "--fp32", "--measure-world-sizes", "1,4", "--measure-modes", "zero1,zero2-split")
    rows = data["measured"]
    measured = rows
    zero1 = [r for r in measured if r["mode"] == "zero1"]
    assert [(r["mode"], r["world_size"]) for r in zero1] == [("zero1", 1), ("zero1", 4)]
    assert all(r["precision"] == "fp32" for r in measured)
    four = zero1[1]
    assert four["heaviest_bytes"] == max(p["total"] for p in four["per_rank"])
    assert four["ideal_sharded_bytes"] == zero1[0]["heaviest_sharded_bytes"] / 4
    printed = capsys.readouterr().out
    assert "measured under torch's fake process group" in printed and "ZeRO-1 whole" in printed
    assert any(r["mode"] == "zero2-split" for r in measured) and "ZeRO-2 split" in printed


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_estimate_measure_plot_draws_both_precisions(tmp_path: Path) -> None:
    png = tmp_path / "plot.png"
    data = _estimate(tmp_path, "--measure-world-sizes", "1,2", "--measure-modes", "ddp,zero3", "--plot", str(png))
    assert {r["precision"] for r in data["measured"]} == {"fp32", "bf16 + fp32 masters"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bad_measure_options_end_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    base = ["estimate", "--model", "llama3-8b", "--world-size", "8"]
    assert_one_line_errors([
        ([*base, "--measure", "--measure-world-sizes", "8,0"],
         "argument --measure-world-sizes: world sizes must be from 1 to 65536, got 0 in '8,0'"),
        ([*base, "--measure", "--measure-world-sizes", "8,x"], "('x' is not an integer)"),
        ([*base, "--measure", "--measure-modes", "zero4"], "unknown mode 'zero4' in 'zero4'; modes: ddp, zero1"),
        ([*base, "--measure", "--measure-scale", "0"], "argument --measure-scale: must be >= 1, got 0"),
        ([*base, "--measure", "--measure-scale", "300"], "--measure-scale 300 leaves head_dim 128 // 300 = 0"),
        ([*base, "--measure-world-sizes", "8"], "--measure-world-sizes needs --measure; add --measure"),
        (["estimate", "--params", "1e9", "--world-size", "8", "--measure"],
         "--measure builds a scaled-down Llama-style decoder, so it needs --model (one of llama3-8b, "
         "llama3.2-1b, tinyllama-1.1b) or --hf-config config.json; got --params 1e+09"),
        ([*base, "--measure", "--plot", str(a_file / "plot.png")], "is a file, not a folder; choose another path"),
    ], capsys)
