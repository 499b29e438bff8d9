"""``--shard-size`` in the ``shardopt`` command: ``estimate`` plans the sharded terms over the
S ranks of a shard group; ``bench`` and ``demo`` run hybrid ZeRO-1 and count bytes per group."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from shardopt.app.cli import main
from shardopt.app.shapes import SHAPE_PRESETS
from shardopt.memory import estimate_plans
from tests.helpers.cli import assert_one_line_errors


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def test_estimate_shard_size_plans_optimizer_and_gradient_shards_over_the_shard_group(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--model", "llama3-8b", "--world-size", "64", "--shard-size", "8", "--json",
                 str(out)]) == 0
    data = _json(out)
    psi = data["num_params"]
    hybrid = data["hybrid"]
    assert hybrid["shard_size"] == 8 and hybrid["num_replicas"] == 8
    rows = {(r["stage"], r["layout"].split(",")[0], r["plan"]): r for r in hybrid["rows"]}
    # the formula with N replaced by S: ZeRO-2 mixed holds 2 Psi + (2 + 12) Psi / S bytes
    assert rows[("ZeRO-2", "hybrid", "formula")]["bytes"] == 2 * psi + 14 * psi / 8
    assert rows[("ZeRO-1", "hybrid", "formula")]["bytes"] == 4 * psi + 12 * psi / 8
    assert rows[("ZeRO-2", "flat", "formula")]["bytes"] == data["stage2_bytes"]
    assert rows[("ZeRO-2", "flat", "formula")]["sharded_fraction"] == 1 / 64
    # the real plans over 8 ranks, whole and row-split, as estimate_plans plans them
    plan = estimate_plans(SHAPE_PRESETS["llama3-8b"].shapes(), 8)
    for split, name in ((False, "whole-parameter plan, heaviest rank"), (True, "row-split plan, heaviest rank")):
        assert rows[("ZeRO-1", "hybrid", name)]["bytes"] == plan.stage1(split)
        assert rows[("ZeRO-2", "hybrid", name)]["bytes"] == plan.stage2(split)
        assert rows[("ZeRO-2", "hybrid", name)]["at_step_bytes"] == plan.stage2_at_step(split)
    # the split plan reaches 1/S within 1%; the whole-parameter plan holds the 525M embedding on one rank
    assert math.isclose(rows[("ZeRO-2", "hybrid", "row-split plan, heaviest rank")]["sharded_fraction"], 1 / 8,
                        rel_tol=0.01)
    assert "hybrid sharding: shard groups of 8 ranks, 64 ranks in all" in capsys.readouterr().out


def test_estimate_shard_size_of_a_bare_count_has_formula_rows_only(tmp_path: Path) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--params", "1e9", "--world-size", "8", "--shard-size", "2", "--fp32", "--json",
                 str(out)]) == 0
    rows = _json(out)["hybrid"]["rows"]
    assert [r["plan"] for r in rows] == ["formula"] * 4
    assert rows[1]["bytes"] == 8e9 + 8e9 / 2 and rows[3]["bytes"] == 4e9 + 12e9 / 2  # fp32: 4 + 4 (+ K=8) bytes


def test_bad_shard_size_ends_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_errors([
        (["estimate", "--params", "1e9", "--world-size", "8", "--shard-size", "3"],
         "--shard-size: shard_size must divide the world size 8, got shard_size=3; use one of [1, 2, 4, 8]"),
        (["estimate", "--params", "1e9", "--world-size", "4", "--shard-size", "8"], "must divide the world size 4"),
        (["estimate", "--params", "1e9", "--world-size", "4", "--shard-size", "0"], "must be >= 1, got 0"),
    ], capsys)
