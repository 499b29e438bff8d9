"""The command's parameter precisions: ``--precision`` / ``--reduce-dtype`` for demo, precision
suffixes in bench mode names, the DeepSpeed ZeRO-2 bf16 peer, and the one-line errors for
combinations that do not exist."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from typing import Any

import pytest
import torch

from shardopt.app.cli import main
from shardopt.app.launch import run_launched
from shardopt.app.modes import MODES, bench_names, resolve
from shardopt.app.precision import Precision
from shardopt.app.runner import TrainJob
from tests.helpers.cli import TINY, assert_one_line_errors as _assert_one_line_errors

MIXED = ["ddp-bf16", "zero1-bf16m", "zero2-bf16m", "zero2-bf16m-bf16reduce"]


def _json(path: Any) -> dict[str, Any]:
    with open(path) as f:
        return dict(json.load(f))


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


PRECISION_ERRORS = [
    (["demo", "--mode", "zero3", "--precision", "bf16-master"],
     ("--precision: mode 'zero3' does not run at precision 'bf16-master' (bf16 params + fp32 masters); it runs at "
      "fp32; modes with bf16-master: zero1, zero1-offload, zero2, zero2-offload, zero2-split, zero1-hybrid, zero2-hybrid, "
      "deepspeed-zero2")),
    (["demo", "--mode", "ddp", "--precision", "bf16-master"],
     "--precision: mode 'ddp' does not run at precision 'bf16-master'"),
    (["demo", "--mode", "fsdp2", "--precision", "bf16"], "modes with bf16: ddp, zero1, zero2"),
    (["demo", "--mode", "deepspeed-zero2"], "mode 'deepspeed-zero2' does not run at precision 'fp32'"),
    (["demo", "--precision", "bf16-master", "--amp", "bf16"],
     ("--amp bf16 autocasts fp32 parameters, but --precision bf16-master makes them bf16; drop --amp, or use "
      "--precision fp32")),
    (["demo", "--precision", "bf16", "--amp", "fp16"], "--amp fp16 autocasts fp32 parameters"),
    (["demo", "--reduce-dtype", "bf16"],
     ("--reduce-dtype bf16 picks how gradients reach the owner's fp32 masters; it needs --precision bf16-master, "
      "not fp32")),
    (["demo", "--mode", "zero1", "--precision", "bf16-master", "--reduce-dtype", "fp32"],
     ("--reduce-dtype: mode 'zero1' cannot choose the gradient reduce dtype (reduce dtype 'fp32'); modes that can: "
      "zero2, zero2-offload, zero2-split, zero2-hybrid, deepspeed-zero2")),
    (["demo", "--precision", "fp16"], "argument --precision: invalid choice: 'fp16'"),
    (["demo", "--mode", "deepspeed-zero2", "--precision", "bf16-master"],
     ("mode 'deepspeed-zero2' needs deepspeed, which is not installed; install it with: DS_BUILD_OPS=0 pip "
      "install deepspeed")),
    (["bench", "--modes", "zero3-bf16m"],
     ("--modes: unknown mode 'zero3-bf16m': mode 'zero3' does not run at precision 'bf16-master' (bf16 params + "
      "fp32 masters); it runs at fp32; modes with bf16-master: zero1, zero1-offload, zero2, zero2-offload, "
      "zero2-split, zero1-hybrid, zero2-hybrid, deepspeed-zero2; bench names for zero3: zero3")),
    (["bench", "--modes", "ddp-bf16m"], "bench names for ddp: ddp, ddp-bf16"),
    (["bench", "--modes", "zero2-bf16reduce"],
     "--modes: mode 'zero2-bf16reduce': -bf16reduce needs fp32 masters (a -bf16m name before it)"),
    (["bench", "--modes", "zero1-bf16m-bf16reduce"], "mode 'zero1' cannot choose the gradient reduce dtype"),
    (["bench", "--modes", "deepspeed-zero2"], "bench names for deepspeed-zero2: deepspeed-zero2-bf16m"),
    (["bench", "--modes", "zero2-fp16"], ("--modes: unknown mode 'zero2-fp16'; choose from ddp, ddp-bf16, ddp-amp, "
     "zero1, zero1-bf16, zero1-bf16m, zero1-offload, zero1-offload-bf16m, zero2, zero2-bf16, zero2-bf16m, "
     "zero2-bf16m-bf16reduce, zero2-offload, zero2-offload-bf16m, zero2-offload-bf16m-bf16reduce, zero2-split, "
     "zero2-split-bf16, zero2-split-bf16m, zero2-split-bf16m-bf16reduce, zero1-hybrid, zero1-hybrid-bf16, "
     "zero1-hybrid-bf16m, zero2-hybrid, zero2-hybrid-bf16, zero2-hybrid-bf16m, zero2-hybrid-bf16m-bf16reduce, "
     "zero3, zero3-offload, torch-zero")),
    (["bench", "--modes", "deepspeed-zero2-bf16m"],
     "none of --modes can run here: mode 'deepspeed-zero2' needs deepspeed, which is not installed"),
]


def test_precision_combinations_that_do_not_exist_end_in_one_line_and_exit_code_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # an import of it now fails: a missing peer
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # restored after the test
    _assert_one_line_errors(PRECISION_ERRORS, capsys)


def test_every_mode_and_precision_has_one_bench_name_that_reads_back() -> None:
    names = []
    for mode in MODES.values():
        for name in mode.precisions:
            reduce_dtypes = (None, *mode.reduce_dtypes) if name == "bf16-master" else (None,)
            for reduce_dtype in reduce_dtypes:
                precision = Precision(name, reduce_dtype)
                run = f"{mode.name}{precision.suffix}"
                assert resolve(run) == (mode, Precision(name, None if reduce_dtype == "fp32" else reduce_dtype)), run
                names.append(run)
    assert {"ddp", "ddp-bf16", "zero1-bf16m", "zero2-bf16m", "zero2-bf16m-bf16reduce", "deepspeed-zero2-bf16m",
            "deepspeed-zero2-bf16m-bf16reduce"} <= set(names)
    # -bf16m with reduce fp32 is the default's name (zero2, zero2-offload, zero2-split, zero2-hybrid, deepspeed)
    assert len(names) == len(set(names)) + 5
    assert bench_names() == list(dict.fromkeys(names))


def test_precision_and_train_job_refuse_what_does_not_exist() -> None:
    with pytest.raises(ValueError, match="Precision.name must be one of fp32, bf16, bf16-master, got 'fp16'"):
        Precision("fp16")
    with pytest.raises(ValueError, match="Precision.reduce_dtype must be one of fp32, bf16 or None, got 'fp8'"):
        Precision("bf16-master", "fp8")
    with pytest.raises(ValueError, match="Precision.reduce_dtype='bf16' needs name='bf16-master'"):
        Precision("bf16", "bf16")
    with pytest.raises(ValueError, match=r"TrainJob\(amp='bf16'\) autocasts fp32 parameters, but precision is "
                                         "'bf16-master'"):
        TrainJob(amp="bf16", precision=Precision("bf16-master"))
    with pytest.raises(ValueError, match="mode 'zero3' does not run at precision 'bf16'"):
        MODES["zero3"].wrap(torch.nn.Linear(2, 2), _setup(Precision("bf16")))


def _setup(precision: Precision) -> Any:
    from shardopt.app.modes import Setup

    return Setup(1e-3, torch.device("cpu"), precision)


def test_estimate_labels_every_row_with_the_configuration_that_reaches_it(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--params", "7.5e9", "--world-size", "64", "--json", str(out)]) == 0
    rows = {r["stage"]: r for r in _json(out)["rows"]}
    printed = capsys.readouterr().out
    assert rows["ZeRO-2"]["configuration"] == ("ShardedDataParallel(bf16 model, OSS(Adam, "
                                               "master_dtype=torch.float32))")
    assert rows["ZeRO-2"]["bench_mode"] == "zero2-bf16m" and rows["ZeRO-1"]["bench_mode"] == "zero1-bf16m"
    assert round(rows["ZeRO-2"]["bytes"] / 1e9, 1) == 16.6 and round(rows["ZeRO-2"]["at_step_bytes"] / 1e9, 1) == 16.9
    for text in ("ShardedDataParallel(bf16 model, OSS(Adam, master_dtype=torch.float32)) (zero2-bf16m)", "16.6",
                 "16.9", "GB during the step", "MixedPrecision(param_dtype=torch.bfloat16)"):
        assert text in printed, text
    assert main(["estimate", "--params", "7.5e9", "--world-size", "64", "--fp32", "--json", str(out)]) == 0
    rows = {r["stage"]: r for r in _json(out)["rows"]}
    assert [r["bench_mode"] for r in rows.values()] == ["ddp", "zero1", "zero2", "zero3"]
    assert rows["ZeRO-2"]["configuration"] == "ShardedDataParallel(model, OSS(Adam))"
    assert rows["ZeRO-2"]["at_step_bytes"] == rows["ZeRO-2"]["bytes"]
    assert "ShardedDataParallel(model, OSS(Adam)) (zero2)" in capsys.readouterr().out


@pytest.mark.distributed
def test_bench_mixed_modes_send_fewer_bytes_than_fp32_ddp_and_skip_a_missing_peer(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # requested but missing: skipped with a note
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    out = tmp_path / "bench.json"
    modes = ",".join([*MIXED, "deepspeed-zero2-bf16m"])
    assert main(["bench", *TINY, "--steps", "3", "--warmup-steps", "1", "--modes", modes, "--json", str(out)]) == 0
    data = _json(out)
    results = {r["mode"]: r for r in data["results"]}
    assert list(results) == ["ddp", *MIXED]
    assert data["skipped"] == [{"mode": "deepspeed-zero2-bf16m", "reason": "mode 'deepspeed-zero2' needs deepspeed, "
                                "which is not installed; install it with: DS_BUILD_OPS=0 pip install deepspeed"}]
    assert results["zero2-bf16m-bf16reduce"]["precision"] == "bf16 params + fp32 masters, bf16 reduce"
    for name in MIXED:
        r = results[name]
        for rank in r["ranks"]:
            assert rank["heap_after_step"] > 0 and rank["bytes_per_step"] > 0 and rank["counted_steps"] == 2, name
        # bf16 parameters: within a few bf16 roundings of fp32 DDP after 3 Adam steps at lr 1e-3
        assert 0 < r["max_param_diff"] < 2e-2, (name, r["max_param_diff"])
    ratio = {name: results[name]["bytes_ratio"] for name in MIXED}
    # DDP in bf16 all-reduces half the bytes; the master modes gather bf16 parameters (half of zero1's fp32
    # gather) and reduce gradients in bf16 (ZeRO-1's DDP, -bf16reduce) or fp32 (zero2-bf16m): 0.5 / 0.75 of DDP
    assert ratio["ddp-bf16"] < 0.6 and ratio["zero2-bf16m-bf16reduce"] < 0.6, ratio
    assert ratio["zero1-bf16m"] < 0.85 and ratio["zero2-bf16m"] < 0.85, ratio
    printed = capfd.readouterr()  # notes and progress on stderr, the table on stdout
    assert "bench: skipping deepspeed-zero2-bf16m: mode 'deepspeed-zero2' needs deepspeed" in printed.err
    assert "-bf16m: bf16 params + fp32 masters on the owner" in printed.out


@pytest.mark.distributed
def test_demo_bf16_modes_match_ddp_bf16_and_zero2_masters_match_across_reduce_dtypes(tmp_path: Any) -> None:
    def losses(name: str, *extra: str) -> list[float]:
        out = tmp_path / f"{name}.json"
        assert main(["demo", *TINY, "--steps", "4", "--json", str(out), *extra]) == 0
        return [r["final_loss"] for r in _json(out)["ranks"]]

    # At 2 ranks a bf16 sum of two gradients rounds once whoever adds them, so plain bf16 modes agree with DDP
    # exactly. With masters, ZeRO-2 halves each gradient in the wire dtype and sums in fp32: halving is exact in
    # bf16 too, so at 2 ranks the bf16 reduce gives the fp32 reduce's result for half the bytes.
    plain = {mode: losses(f"{mode}-bf16", "--mode", mode, "--precision", "bf16") for mode in ("ddp", "zero1", "zero2")}
    assert plain["zero1"] == plain["ddp"] and plain["zero2"] == plain["ddp"], plain
    masters = losses("zero2-bf16m", "--precision", "bf16-master")
    assert masters == losses("zero2-bf16m-bf16reduce", "--precision", "bf16-master", "--reduce-dtype", "bf16")
    assert masters != plain["ddp"]  # the fp32 masters are stepped, not the bf16 parameters


@pytest.mark.distributed
def test_master_checkpoints_resume_exactly_and_refuse_another_precision(
        tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    def demo(name: str, *extra: str) -> dict[str, Any]:
        out = tmp_path / f"{name}.json"
        assert main(["demo", *TINY, "--precision", "bf16-master", "--json", str(out), *extra]) == 0
        return _json(out)

    ckpt = str(tmp_path / "masters.pt")
    straight = demo("straight", "--steps", "4")
    demo("first", "--steps", "2", "--checkpoint", ckpt)
    _assert_one_line_errors([
        (["demo", *TINY, "--checkpoint", ckpt, "--resume"],
         f"checkpoint {ckpt!r} was saved at --precision bf16-master, not fp32; resume with --precision bf16-master"),
    ], capsys)
    resumed = demo("resumed", "--steps", "4", "--checkpoint", ckpt, "--resume")
    assert [r["start_step"] for r in resumed["ranks"]] == [2, 2]
    # the fp32 masters and their Adam state travel in the checkpoint: the resumed run is the straight one
    assert [r["final_loss"] for r in resumed["ranks"]] == [r["final_loss"] for r in straight["ranks"]]


@pytest.mark.distributed
def test_deepspeed_zero2_bf16_is_measured_like_shardopt(tmp_path: Any) -> None:
    pytest.importorskip("deepspeed")
    out = tmp_path / "bench.json"
    modes = "deepspeed-zero2-bf16m,deepspeed-zero2-bf16m-bf16reduce"
    assert main(["bench", *TINY, "--steps", "3", "--warmup-steps", "1", "--modes", modes, "--json", str(out)]) == 0
    results = {r["mode"]: r for r in _json(out)["results"]}
    assert list(results) == ["ddp", *modes.split(",")]
    for name in ("deepspeed-zero2-bf16m", "deepspeed-zero2-bf16m-bf16reduce"):
        r = results[name]
        for rank in r["ranks"]:
            assert rank["heap_after_step"] > 0 and rank["bytes_per_step"] > 0 and rank["counted_steps"] == 2, name
        assert 0 < r["max_param_diff"] < 2e-2, (name, r["max_param_diff"])
    # DeepSpeed all-reduces the gradient buckets (1.0x DDP's bytes in fp32, 0.5x in bf16) and all-gathers
    # bf16 parameters (0.25x at 2 ranks): its counted bytes must show exactly that
    assert 1.1 < results["deepspeed-zero2-bf16m"]["bytes_ratio"] < 1.4, results["deepspeed-zero2-bf16m"]
    assert 0.6 < results["deepspeed-zero2-bf16m-bf16reduce"]["bytes_ratio"] < 0.9


def _update_signs(mode: str, precision: Precision, grad_accum: int, tmp_path: Any) -> dict[str, torch.Tensor]:
    from shardopt.app.bench import bench_rank
    from shardopt.app.models import build_model

    out = str(tmp_path / f"{mode}-{grad_accum}.pt")
    job = TrainJob(mode=mode, precision=precision, preset="tiny", steps=1, batch_size=2, grad_accum_steps=grad_accum,
                   warmup_steps=0, params_out=out, threads_per_rank=1, device="cpu")  # the CPU where a GPU is seen too
    run_launched("demo", bench_rank, 2, job)
    after = torch.load(out, weights_only=True)
    before = dict(build_model("tiny").named_parameters())
    # sign of the first Adam update (lr * sign(grad)), on the weight matrices (bf16 cannot move LayerNorm's 1.0)
    return {k: (after[k].float() - before[k].detach().to(after[k].dtype).float()).sign()
            for k in after if after[k].dim() >= 2}


@pytest.mark.distributed
def test_deepspeed_accumulates_every_micro_batch(tmp_path: Any) -> None:
    pytest.importorskip("deepspeed")
    ddp = _update_signs("ddp", Precision(), 2, tmp_path)
    deepspeed = _update_signs("deepspeed-zero2", Precision("bf16-master"), 2, tmp_path)
    last_only = _update_signs("ddp", Precision(), 1, tmp_path)  # what a dropped micro-batch looks like

    def agreement(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return float(sum((a[k] == b[k]).float().mean() for k in a) / len(a))

    assert agreement(ddp, deepspeed) > 0.99
    assert agreement(ddp, last_only) < 0.9


def test_deepspeed_ranks_training_on_the_cpu_pick_its_cpu_accelerator_where_cuda_is_visible(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from shardopt.app.modes import get_mode

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    before_import = get_mode("deepspeed-zero2").before_import
    assert before_import is not None
    for device_type, expected in (("cuda", None), (None, None), ("cpu", "cpu")):
        monkeypatch.delenv("DS_ACCELERATOR", raising=False)
        before_import(device_type)
        assert os.environ.get("DS_ACCELERATOR") == expected, device_type  # DeepSpeed takes CUDA unless told
