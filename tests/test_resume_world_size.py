"""``shardopt demo`` resumed at another world size continues the same run when the global batch
stays the same (``--global-batch-size``): every step trains on the same samples, so the result
differs from the uninterrupted run only by the rounding of the gradient sum (Note [the same run
at another world size] in shardopt.app.runner)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from shardopt.app.cli import main
from tests.helpers.cli import assert_one_line_errors

pytestmark = pytest.mark.distributed  # starts processes (the demo's ranks)

TINY = ["--model", "tiny", "--threads-per-rank", "1", "--warmup-steps", "0"]


def _demo(tmp_path: Path, name: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    assert main(["demo", *TINY, "--json", str(out), *extra]) == 0
    return dict(json.loads(out.read_text()))


def test_a_run_resumed_at_three_ranks_ends_where_the_two_rank_run_does_up_to_rounding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    straight = _demo(tmp_path, "straight", "--world-size", "2", "--global-batch-size", "12", "--steps", "8")
    ck = tmp_path / "ck.pt"
    _demo(tmp_path, "first", "--world-size", "2", "--global-batch-size", "12", "--steps", "4", "--checkpoint", str(ck))
    shutil.copyfile(ck, tmp_path / "other.pt")
    capsys.readouterr()
    same = _demo(tmp_path, "same", "--world-size", "3", "--global-batch-size", "12", "--steps", "8",
                 "--checkpoint", str(ck), "--resume")
    assert "note" not in capsys.readouterr().err
    other = _demo(tmp_path, "other", "--world-size", "3", "--batch-size", "2", "--steps", "8",
                  "--checkpoint", str(tmp_path / "other.pt"), "--resume")
    assert ("shardopt demo: note: the checkpoint was trained with 12 sequences per step over 2 ranks, this run takes "
            "6 over 3: it trains on other samples than the saved run would have; pass --global-batch-size 12 to keep "
            "them") in capsys.readouterr().err
    assert [r["start_step"] for r in same["ranks"]] == [4, 4, 4]
    # final_loss is the mean over the 12 samples of step 8 at either world size. Parameters
    # and samples are the same; only the order of the fp32 gradient sum (2 or 3 partial
    # sums) differs, which Adam carries over 4 steps. Measured on this machine (tiny model,
    # 6 steps after the switch): 2.4e-7 at 1 and at 4 ranks, against 1.5e-2 to 2.7e-2 when
    # the global batch changes with the world size. Allowed: 1e-5, and the control must
    # move by more than 100 times that.
    drift, control = abs(same["final_loss"] - straight["final_loss"]), abs(other["final_loss"] - straight["final_loss"])
    assert drift <= 1e-5, (drift, same["final_loss"], straight["final_loss"])
    assert control > 1e-3, (control, other["final_loss"], straight["final_loss"])


def test_a_global_batch_that_does_not_split_or_comes_with_a_batch_size_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert_one_line_errors([
        (["demo", *TINY, "--world-size", "2", "--grad-accum", "2", "--global-batch-size", "6"],
         "--global-batch-size 6 does not split over 2 ranks x --grad-accum 2; pass a multiple of 4"),
        (["demo", *TINY, "--global-batch-size", "8", "--batch-size", "4"],
         "--batch-size 4 and --global-batch-size 8 both set the batch; pass one of them"),
    ], capsys)
