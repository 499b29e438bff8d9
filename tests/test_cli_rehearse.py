"""``shardopt rehearse``: the tables and JSON of a tiny model's rehearsal, a user's factory model, and
one-line errors naming the option, the value and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardopt.app.cli import main
from shardopt.app.rehearse import CATEGORIES
from tests.helpers.cli import assert_one_line_errors

TINY = ["rehearse", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--threads", "1"]


def test_rehearse_defaults_play_rank_0_the_last_and_the_heaviest_and_their_categories_sum_to_the_peak(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main([*TINY, "--world-size", "8", "--device-memory", "1GiB", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["mode"], data["precision"], data["device"]) == ("zero2", "bf16-master", "cpu")
    ranks = [row["rank"] for row in data["ranks"]]
    assert ranks[0] == 0 and 7 in ranks and ranks == sorted(ranks) and len(ranks) in (2, 3)
    for row in data["ranks"]:
        memory = row["memory"]
        assert sum(memory[name] for name in CATEGORIES) == memory["total"] == row["peak_bytes"]
        assert row["replay_matched"] and row["fits"] and row["headroom_bytes"] == 2**30 - row["needed_bytes"]
        prediction = row["prediction"]
        # on the CPU the default (--overlap auto) adds every collective to compute (Note [the step time model])
        assert prediction["step_s"] == pytest.approx(prediction["compute_s"] + prediction["comm_s"])
        assert prediction["comm_s"] > 0 and prediction["compute_s"] > 0
        assert prediction["tokens_per_s"] == pytest.approx(8 * 2 * 16 / prediction["step_s"])
        assert row["bytes_per_step"]["world"] > 0 and row["bytes_per_step"]["replicate"] == 0
    shown = capsys.readouterr().out  # the tables go to standard output when the JSON goes to a file
    assert "memory, MiB: tiny" in shown and "time per step, on a link of 100 Gbit/s" in shown


def test_rehearse_json_dash_writes_only_json_to_stdout(capfd: pytest.CaptureFixture[str]) -> None:
    assert main([*TINY, "--world-size", "2", "--mode", "zero3", "--ranks", "1", "--activation-checkpointing",
                 "--link-gbps", "25", "--latency-us", "3", "--json", "-"]) == 0
    out, err = capfd.readouterr()
    data = json.loads(out)
    assert data["command"] == "rehearse" and data["activation_checkpointing"] is True and data["overlap"] is False
    assert [r["rank"] for r in data["ranks"]] == [1] and data["link"] == {"gbps": 25.0, "latency_us": 3.0}
    assert "time per step" in err and "(no overlap)" in err


def test_rehearse_overlap_yes_replays_communication_beside_compute(capfd: pytest.CaptureFixture[str]) -> None:
    # a slow link so that the collectives take longer than the compute they could hide behind
    assert main([*TINY, "--world-size", "2", "--mode", "zero3", "--ranks", "0", "--overlap", "yes",
                 "--link-gbps", "0.01", "--latency-us", "0", "--json", "-"]) == 0
    out, err = capfd.readouterr()
    data = json.loads(out)
    prediction = data["ranks"][0]["prediction"]
    assert data["overlap"] is True and "communication beside compute" in err
    assert prediction["hidden_s"] > 0 and prediction["step_s"] < prediction["compute_s"] + prediction["comm_s"]


def test_rehearse_builds_a_factory_model_one_unit_at_a_time(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    assert main(["rehearse", "--model", "tests.helpers.gpt:TinyGPT", "--world-size", "4", "--mode", "zero3",
                 "--seq-len", "8", "--ranks", "0", "--threads", "1", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["ranks"][0]
    assert row["replay_matched"] and row["memory"]["params"] > 0


def test_rehearse_bad_input_is_one_line_naming_the_option_the_value_and_the_fix(
        capsys: pytest.CaptureFixture[str]) -> None:
    base = ["rehearse", "--model", "tiny"]
    assert_one_line_errors([
        ([*base, "--world-size", "8", "--mode", "zero2-hybrid", "--shard-size", "3"],
         "--shard-size 3 with --world-size 8"),
        ([*base, "--world-size", "8", "--mode", "zero2-hybrid"], "pass --shard-size S, a divisor of --world-size 8"),
        ([*base, "--world-size", "8", "--shard-size", "2"], "--shard-size 2 applies to --mode zero1-hybrid and "
                                                            "zero2-hybrid only"),
        ([*base, "--world-size", "0"], "argument --world-size: must be from 1 to 65536, got 0"),
        ([*base, "--world-size", "8", "--ranks", "3,8"], "--ranks 3,8: rank 8 is not below --world-size 8; give "
                                                         "ranks from 0 to 7"),
        ([*base, "--world-size", "8", "--device-memory", "300KiB"], "argument --device-memory: must be at least 1MiB"),
        ([*base, "--world-size", "8", "--device-memory", "80XB"], "expected a size such as 80GiB"),
        (["rehearse", "--model", "small", "--world-size", "2", "--mode", "ddp", "--device-memory", "1MiB"],
         "--device-memory 1.00 MiB is too small for --model small in --mode ddp at --world-size 2: a rank's model "
         "states alone take 6.68 MiB by the ownership plan, before activations and buffers; raise --world-size, use a "
         "mode that shards more (zero3 holds 1/N of everything), or give a larger --device-memory"),
        (["rehearse", "--model", "llama3-8b", "--world-size", "1", "--mode", "ddp", "--device-memory", "1TiB"],
         "this machine cannot hold the rank to rehearse it"),
        ([*base, "--world-size", "8", "--mode", "zero3", "--precision", "bf16"],
         "--precision bf16: mode 'zero3' is rehearsed at fp32 or bf16-master"),
        ([*base, "--world-size", "8", "--mode", "ddp", "--precision", "bf16-master"],
         "--precision bf16-master: mode 'ddp' does not run at precision 'bf16-master'"),
        ([*base, "--world-size", "8", "--seq-len", "33"], "--seq-len 33 exceeds --model tiny's 32 positions; give "
                                                          "--seq-len 32 or less"),
        ([*base, "--world-size", "8", "--link-gbps", "0"], "argument --link-gbps: must be a finite number > 0"),
        (["rehearse", "--model", "nomodule", "--world-size", "8"], "is neither a preset"),
        (["rehearse", "--model", "torch.nn:Identity", "--world-size", "8"], "has no nn.Embedding"),
        (["rehearse", "--model", "torch.nn:Embedding", "--world-size", "8"], "calling Embedding() under "
                                                                              "torch.device('meta') failed"),
        (["rehearse", "--model", "tests.helpers.rehearse_models:embedding_only", "--world-size", "2",
          "--activation-checkpointing"], "has no nn.ModuleList of repeated blocks to checkpoint; drop the flag"),
        (["rehearse", "--model", "nomodule:build", "--world-size", "8"], "cannot load 'build' from 'nomodule'"),
        (["rehearse", "--model", "tests.helpers.rehearse_models:not_a_module", "--world-size", "8"],
         "returned int, not an nn.Module"),
        ([*base, "--world-size", "8", "--ranks", "0,x"], "expected comma-separated ranks such as 0,63"),
        # found while training the first step, after the fake group exists: still one line
        (["rehearse", "--model", "tests.helpers.rehearse_models:embedding_only", "--world-size", "2", "--seq-len",
          "4", "--ranks", "0"], "model(tokens) returned shape (1, 4, 4); rehearse needs logits of shape (batch, seq, "
                                "16) from token ids of shape (batch, seq)"),
    ], capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_rehearse_device_cuda_without_a_gpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_errors([(["rehearse", "--model", "tiny", "--world-size", "2", "--device", "cuda"],
                             "--device cuda: torch sees no CUDA device here; use --device auto or cpu")], capsys)
