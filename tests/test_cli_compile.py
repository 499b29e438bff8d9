"""``shardopt bench --compile`` and ``shardopt demo --compile``: every mode compiles the same
blocks (Note [--compile in every mode] in shardopt.app.modes) and still trains exactly as DDP.

At 2 ranks in fp32 every mode's arithmetic is DDP's, and with the blocks compiled in every
mode the compiled kernels are the same too (inductor generates them from the same graph),
so the parameters after the run match DDP's bit for bit. A cold inductor compile of the
tiny GPT's block takes about a minute on a small CPU; later processes find it in
inductor's on-disk cache.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from shardopt.app.cli import main
from tests.helpers.cli import TINY

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)


def _json(path: Any) -> dict[str, Any]:
    with open(path) as f:
        return dict(json.load(f))


@pytest.mark.timeout(900)
def test_bench_and_demo_compile_the_blocks_in_every_mode_and_match_ddp_bitwise(
        tmp_path: Any, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--steps", "4", "--warmup-steps", "1", "--modes", "zero1,zero2,zero3",
                 "--compile", "--json", str(out)]) == 0
    data = _json(out)
    assert data["compile"] is True
    results = {r["mode"]: r for r in data["results"]}
    assert list(results) == ["ddp", "zero1", "zero2", "zero3"]
    for name, r in results.items():
        assert r["max_param_diff"] == 0.0, (name, r["max_param_diff"])
        # the tiny GPT's blocks share one shape: one graph per rank, whatever wraps them
        assert [rank["compiled_graphs"] for rank in r["ranks"]] == [1, 1], name
    assert "blocks compiled" in capfd.readouterr().out

    demo = tmp_path / "demo.json"
    assert main(["demo", *TINY, "--mode", "zero3", "--steps", "4", "--compile", "--json", str(demo)]) == 0
    ran = _json(demo)
    assert ran["job"]["compile"] is True
    assert [r["compiled_graphs"] for r in ran["ranks"]] == [1, 1]
    # the same job as bench's zero3 run: the same losses on every rank
    assert [r["final_loss"] for r in ran["ranks"]] == [r["final_loss"] for r in results["zero3"]["ranks"]]

    plain = tmp_path / "plain.json"
    assert main(["demo", *TINY, "--mode", "zero3", "--steps", "1", "--json", str(plain)]) == 0
    assert _json(plain)["job"]["compile"] is False
    assert [r["compiled_graphs"] for r in _json(plain)["ranks"]] == [None, None]
