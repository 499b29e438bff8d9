"""The ``shardopt`` command: each subcommand runs and reports the right fields, the estimate
reproduces the ZeRO paper, demo resumes from its own checkpoint bit for bit, modes agree
with DDP, bad arguments end in one line and exit code 2, and Ctrl-C stops every rank."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import record

import shardopt.nn.fsdp
from shardopt.app.bench import merge_rounds
from shardopt.app.cli import main
from shardopt.app.launch import run_launched
from shardopt.app.models import PRESETS
from tests.helpers.cli import TINY, assert_one_line_errors as _assert_one_line_errors
from tests.helpers.processes import REPO, session_processes as _session_processes

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)


def _json(path: Any) -> dict[str, Any]:
    with open(path) as f:
        return dict(json.load(f))


def _demo(tmp_path: Any, name: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / f"{name}.json"
    assert main(["demo", *TINY, "--json", str(out), *extra]) == 0
    return _json(out)


def test_estimate_reproduces_zero_paper_numbers(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--params", "7.5e9", "--world-size", "64", "--json", str(out)]) == 0
    data = _json(out)
    got = [round(data[k] / 1e9, 1) for k in ("ddp_bytes", "stage1_bytes", "stage2_bytes", "stage3_bytes")]
    assert got == [120.0, 31.4, 16.6, 1.9]
    printed = capsys.readouterr().out
    for text in ("120.0", "31.4", "16.6", "1.9", "ZeRO-3"):
        assert text in printed


def test_estimate_counts_a_real_model(tmp_path: Any) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--model", "27m", "--world-size", "2", "--fp32", "--json", str(out)]) == 0
    data = _json(out)
    assert data["num_params"] == PRESETS["27m"].num_params() > 27_000_000
    assert data["largest_layer_params"] == 528 * 4 * 528
    assert data["ddp_bytes"] == 16 * data["num_params"]
    assert main(["estimate", "--model", "tests.helpers.data:seeded_mlp", "--world-size", "4", "--json", str(out)]) == 0
    data = _json(out)
    assert data["num_params"] == (8 * 16 + 16) + (16 * 32 + 32) + (32 * 4 + 4)
    assert data["largest_layer_params"] == 16 * 32


BAD_ARGUMENTS = [
    (["demo", "--world-size", "0"], "argument --world-size: must be >= 1, got 0"),
    (["bench", "--world-size", "0"], "argument --world-size: must be >= 1, got 0"),
    (["estimate", "--params", "10", "--world-size", "0"], "argument --world-size: must be >= 1, got 0"),
    (["demo", "--mode", "zero9"], "argument --mode: invalid choice: 'zero9'"),
    (["demo", "--lr", "-1"], "argument --lr: must be > 0, got -1"),
    (["bench", "--steps", "ten"], "argument --steps: expected a positive integer, got 'ten'"),
    (["bench", "--modes", "ddp,zero9"], "--modes: unknown mode 'zero9'; choose from ddp, ddp-bf16, ddp-amp, zero1"),
    (["bench", "--modes", "fairscale"], "mode 'fairscale' needs fairscale, which is not installed; install it"),
    (["demo", "--mode", "zero3"], "mode 'zero3' needs shardopt.nn.fsdp.FullyShardedDataParallel"),
    (["demo", "--resume"], "--resume needs --checkpoint PATH"),
    (["demo", "--resume-if-exists"], "--resume-if-exists needs --checkpoint PATH (where to resume from)"),
    (["demo", "--save-every", "5"], "--save-every needs --checkpoint PATH (where to save)"),
    (["demo", "--mode", "torch-zero", "--checkpoint", "x.pt"], "--checkpoint is not supported with mode "
     "'torch-zero' (shardopt cannot consolidate its optimizer state); use one of ddp, ddp-amp, zero1, zero1-offload, "
     "zero2, zero2-offload, zero2-split, zero1-hybrid, zero2-hybrid, zero3, zero3-offload, fsdp2, fsdp2-reshard, "
     "fsdp2-offload"),
    (["demo", "--resume", "--resume-if-exists"], "argument --resume-if-exists: not allowed with argument --resume"),
    (["bench", "--steps", "2"], "--steps 2 leaves nothing to measure after --warmup-steps 2"),
    (["bench", "--plot", "x.png"], "--plot needs matplotlib"),
    (["estimate", "--model", "nomodule", "--world-size", "2"], "must be a preset"),
    (["estimate", "--model", "torch.nn:Linear", "--world-size", "2"],
     "--model 'torch.nn:Linear': calling Linear() with no arguments failed (TypeError"),
    (["demo", "--amp", "fp16", "--mode", "fsdp2"], "--amp fp16 is supported with"),
    (["estimate", "--model", "no_such_module:make", "--world-size", "2"], "cannot load 'make'"),
    (["estimate", "--model", "os:getcwd", "--world-size", "2"], "returned str, not an nn.Module"),
    (["estimate", "--model", "torch.nn:ReLU", "--world-size", "2"], "has no parameters"),
    (["demo", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["bench", "--device", "cuda"], "--device cuda: torch sees no CUDA device here"),
    (["demo", "--device", "cuda"], "--device cuda: torch sees no CUDA device here"),
]


def test_bad_arguments_end_in_one_line_and_exit_code_2(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "fairscale", None)  # an import of it now fails: a missing peer
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delattr(shardopt.nn.fsdp, "FullyShardedDataParallel")  # a shardopt build without ZeRO-3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU
    _assert_one_line_errors(BAD_ARGUMENTS, capsys)


HUGE = "1" + "0" * 30
BAD_INTS = ["ten", "1.5", "nan", HUGE]
BAD_FLOATS = ["ten", "nan", "inf", "-inf", "1e400", "-1"]
ESTIMATE = ["estimate", "--params", "1e9", "--world-size", "2"]
# every numeric option of every command: (the command's other arguments, option, values it must refuse)
NUMERIC_OPTIONS = [
    *[([command], option, [*BAD_INTS, "0" if low == 1 else "-1"])
      for command in ("demo", "bench")
      for option, low in (("--steps", 1), ("--batch-size", 1), ("--world-size", 1), ("--warmup-steps", 0),
                          ("--seed", 0), ("--threads-per-rank", 1))],
    *[([command], "--lr", [*BAD_FLOATS, "0"]) for command in ("demo", "bench")],
    (["demo"], "--grad-accum", [*BAD_INTS, "0"]),
    (["demo"], "--save-every", [*BAD_INTS, "-1"]),
    (["bench"], "--rounds", [*BAD_INTS, "0"]),
    (ESTIMATE, "--params", [*BAD_FLOATS, "0.5", "1e30"]),
    (ESTIMATE, "--world-size", [*BAD_INTS, "0"]),
    (ESTIMATE, "--optimizer-bytes", BAD_FLOATS),
]


def test_every_bad_number_is_a_one_line_usage_error_naming_its_option(capsys: pytest.CaptureFixture[str]) -> None:
    cases = [([*base, f"{option}={value}"], f"argument {option}: ")
             for base, option, values in NUMERIC_OPTIONS for value in values]
    assert len(cases) > 80
    _assert_one_line_errors(cases, capsys)
    _assert_one_line_errors([
        (["demo", "--steps", HUGE], f"argument --steps: must be <= 1000000000, got {HUGE[:12]}...(31 chars)"),
        (["demo", "--lr", "nan"], "argument --lr: must be a finite number, got nan"),
        (["demo", "--seed", "1000000"], "argument --seed: must be <= 999999, got 1000000"),
        (["estimate", "--params", "1e400", "--world-size", "2"], "argument --params: must be a finite number"),
        (["estimate", "--params", "7e9", "--world-size", "2", "--optimizer-bytes", "-1"],
         "argument --optimizer-bytes: must be >= 0, got -1"),
    ], capsys)


def test_resume_without_a_checkpoint_is_refused_at_startup(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.pt"
    _assert_one_line_errors([
        (["demo", "--checkpoint", str(missing), "--resume"],
         f"--resume: no checkpoint at {str(missing)!r}; check the path, or use --resume-if-exists"),
    ], capsys)  # --resume-if-exists starting from step 0: see the cross-mode resume test


def test_unwritable_output_paths_are_refused_before_training(tmp_path: Any,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    a_file, a_folder = tmp_path / "file.txt", tmp_path / "folder"
    a_file.write_text("x")
    a_folder.mkdir()
    under_file = str(a_file / "sub" / "out.pt")
    cases = [
        (["demo", "--checkpoint", under_file], f"--checkpoint {under_file!r} cannot be written: {str(a_file)!r} is "
         "a file, not a folder"),
        (["demo", "--checkpoint", str(a_folder)], f"--checkpoint {str(a_folder)!r} is a folder, but mode 'zero2' "
         "saves one file there"),
        (["demo", "--mode", "fsdp2", "--checkpoint", str(a_file)], f"--checkpoint {str(a_file)!r} is a file, but "
         "mode 'fsdp2' saves a folder there"),
        (["demo", "--json", under_file], "--json"),
        (["bench", "--json", str(a_folder)], "--json"),
        ([*ESTIMATE, "--json", under_file], "--json"),
    ]
    if os.path.isdir("/proc"):  # a folder nobody can create files in, root included
        cases.append((["demo", "--checkpoint", "/proc/shardopt.pt"], "--checkpoint '/proc/shardopt.pt' cannot be "
                      "written: cannot create files in '/proc'"))
    _assert_one_line_errors(cases, capsys)
    assert sorted(os.listdir(tmp_path)) == ["file.txt", "folder"] and os.listdir(a_folder) == []  # no probe left


def test_torchrun_and_checkpoint_mismatches_end_in_one_line(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    _assert_one_line_errors([
        (["demo", "--checkpoint", str(junk), "--resume"], "exists but is not a shardopt checkpoint"),
    ], capsys)
    for name, value in (("TORCHELASTIC_RUN_ID", "x"), ("RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    _assert_one_line_errors([
        (["demo", "--world-size", "3"], "--world-size 3 differs from torchrun's WORLD_SIZE=2"),
        (["bench"], "run it directly, not under torchrun"),
    ], capsys)


@record
def _fail_on_rank_1() -> None:
    """A rank entry point: rank 1 fails at once, rank 0 would go on for a minute."""
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("corpus unreadable")
    time.sleep(60)


def test_a_failing_rank_stops_the_run_with_its_error(capfd: pytest.CaptureFixture[str]) -> None:
    start = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        run_launched("demo", _fail_on_rank_1, 2)
    err = capfd.readouterr().err
    assert exc.value.code == 1
    assert time.monotonic() - start < 45  # rank 0 was stopped, not waited for
    assert "traceback ---" in err and 'raise RuntimeError("corpus unreadable")' in err, err
    assert err.strip().splitlines()[-1] == "shardopt demo: error: rank 1 failed: RuntimeError: corpus unreadable", err


def test_demo_reports_every_rank_and_resumes_from_its_own_checkpoint(tmp_path: Any,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # a consolidated file (zero2; zero3 gathered through its wrapper) and a sharded dcp folder (fsdp2)
    for mode in ("zero2", "zero3", "fsdp2"):
        ckpt = str(tmp_path / f"ckpt-{mode}")
        straight = _demo(tmp_path, f"{mode}-straight", "--mode", mode, "--steps", "6")
        _demo(tmp_path, f"{mode}-first", "--mode", mode, "--steps", "3", "--checkpoint", ckpt)
        resumed = _demo(tmp_path, f"{mode}-resumed", "--mode", mode, "--steps", "6", "--checkpoint", ckpt,
                        "--resume")
        assert [r["start_step"] for r in resumed["ranks"]] == [3, 3]
        assert [r["final_loss"] for r in resumed["ranks"]] == [r["final_loss"] for r in straight["ranks"]], mode
        assert os.path.isdir(ckpt) == (mode == "fsdp2")
    _assert_one_line_errors([
        (["demo", "--model", "small", "--checkpoint", str(tmp_path / "ckpt-zero2"), "--resume"],
         "was saved with {'preset': 'tiny', 'seed': 0}, not {'preset': 'small', 'seed': 0}"),
        (["demo", *TINY, "--mode", "fsdp2", "--checkpoint", str(tmp_path / "ckpt-zero2"), "--resume"],
         "is a consolidated file (saved by mode 'zero2')"),
    ], capsys)
    ranks = straight["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and ranks[0]["final_loss"] != ranks[1]["final_loss"]
    for r in ranks:
        assert r["heap_after_step"] > 0 and r["heap_peak"] >= r["heap_after_step"]
        assert r["bytes_per_step"] > 0 and r["median_step_s"] > 0 and r["counted_steps"] == 4
    assert straight["machine"]["measures"]["heap"].startswith("glibc")


def test_consolidated_checkpoints_resume_under_every_consolidated_mode(tmp_path: Any) -> None:
    # At 2 ranks in fp32 every mode does DDP's arithmetic, so a resumed run must end with the
    # loss of an uninterrupted one, whichever mode saved and whichever resumed.
    straight = [r["final_loss"] for r in _demo(tmp_path, "straight", "--steps", "6")["ranks"]]
    for saver, resumers in (("zero2", ("zero3", "zero1", "ddp")), ("zero3", ("zero2",))):
        saved = str(tmp_path / f"{saver}.pt")
        first = _demo(tmp_path, f"{saver}-first", "--mode", saver, "--steps", "3", "--checkpoint", saved,
                      "--resume-if-exists")  # nothing there yet: starts from step 0
        assert [r["start_step"] for r in first["ranks"]] == [0, 0]
        for mode in resumers:
            ckpt = str(tmp_path / f"{saver}-to-{mode}.pt")
            shutil.copyfile(saved, ckpt)
            resumed = _demo(tmp_path, f"{saver}-to-{mode}", "--mode", mode, "--steps", "6", "--checkpoint", ckpt,
                            "--resume")
            assert [r["start_step"] for r in resumed["ranks"]] == [3, 3], (saver, mode)
            assert [r["final_loss"] for r in resumed["ranks"]] == straight, (saver, mode)


def test_sharded_modes_match_ddp_with_accumulation_under_bf16_and_fp16(tmp_path: Any) -> None:
    for amp in ("bf16", "fp16"):  # fp16: torch's GradScaler for ddp, ShardedGradScaler for zero1/2/3
        losses = {}
        for mode in ("ddp", "zero1", "zero2", "zero3"):
            data = _demo(tmp_path, f"{mode}-{amp}", "--mode", mode, "--steps", "4", "--grad-accum", "2", "--amp", amp)
            losses[mode] = [r["final_loss"] for r in data["ranks"]]
        assert all(v == losses["ddp"] for v in losses.values()), (amp, losses)
        assert all(0 < loss < 10 for loss in losses["ddp"]), losses


def test_bench_compares_modes_with_ddp_in_json_and_table(tmp_path: Any, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    modes = "zero1,zero2,zero2-split,zero3,torch-zero,fsdp2" + (
        ",fairscale,fairscale-default" if _installed("fairscale") else "")
    assert main(["bench", *TINY, "--steps", "4", "--warmup-steps", "1", "--modes", modes, "--json", str(out)]) == 0
    data = _json(out)
    results = {r["mode"]: r for r in data["results"]}
    assert list(results) == ["ddp", *modes.split(",")]
    assert results["ddp"]["time_ratio"] == results["ddp"]["heap_ratio"] == results["ddp"]["bytes_ratio"] == 1.0
    for name, r in results.items():
        assert len(r["ranks"]) == 2 and r["ranks"][0]["counted_steps"] == 3, name
        for rank in r["ranks"]:
            assert rank["heap_after_step"] > 0 and rank["heap_peak"] > 0 and rank["bytes_per_step"] > 0, name
        assert r["time_ratio"] > 0 and r["heap_ratio"] > 0 and r["bytes_ratio"] > 0, name
    for name in ("zero1", "zero2", "zero2-split", "zero3", "torch-zero"):  # same arithmetic as DDP at 2 ranks in fp32
        assert results[name]["max_param_diff"] == 0.0, (name, results[name]["max_param_diff"])
    assert 0 <= results["fsdp2"]["max_param_diff"] < 1e-5
    if "fairscale" in results:  # fairscale is exact with set_to_none=False and drifts with its default
        assert results["fairscale"]["max_param_diff"] == 0.0
        assert results["fairscale-default"]["max_param_diff"] > 1e-4, results["fairscale-default"]
    table = capfd.readouterr().out
    for text in ("heap after step", "sent/step", "median step ms", "max|p - p_ddp|", "zero2", "torch-zero"):
        assert text in table, text


def test_bench_rounds_interleave_and_pool_step_times(tmp_path: Any, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--steps", "3", "--warmup-steps", "1", "--modes", "zero2", "--rounds", "2",
                 "--json", str(out)]) == 0
    data = _json(out)
    assert data["rounds"] == 2
    for r in data["results"]:
        for rank in r["ranks"]:
            assert rank["rounds"] == 2 and len(rank["round_median_step_s"]) == 2
            assert rank["counted_steps"] == len(rank["step_times_s"]) == 4  # 2 rounds x (3 - 1 warm-up)
            assert rank["median_step_s"] == statistics.median(rank["step_times_s"])
        assert r["max_param_diff"] == 0.0
    printed = capfd.readouterr()
    # interleaved: ddp, zero2, ddp, zero2 (progress lines go to stderr, the table to stdout)
    order = [line.split()[1] for line in printed.err.splitlines() if line.startswith("bench: ") and "done" in line]
    assert order == ["ddp", "zero2", "ddp", "zero2"], order
    assert "2 interleaved rounds pooled" in printed.out


def test_merge_rounds_pools_times_and_keeps_the_largest_memory() -> None:
    def report(times: list[float], heap: int) -> dict[str, Any]:
        return {"rank": 0, "step_times_s": times, "median_step_s": statistics.median(times), "counted_steps": 2,
                "heap_after_step": heap, "heap_peak": heap + 1, "bytes_per_step": 10.0, "device_peak": None}

    merged = merge_rounds([[report([1.0, 5.0], 7)], [report([2.0, 3.0], 9)]])
    assert merged == [{"rank": 0, "step_times_s": [1.0, 5.0, 2.0, 3.0], "median_step_s": 2.5, "counted_steps": 4,
                       "heap_after_step": 9, "heap_peak": 10, "bytes_per_step": 10.0, "device_peak": None,
                       "rounds": 2, "round_median_step_s": [3.0, 2.5]}]


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.skipif(not _installed("matplotlib"), reason="needs matplotlib")
def test_bench_plot_writes_a_png(tmp_path: Any) -> None:
    png = tmp_path / "bench.png"
    assert main(["bench", *TINY, "--steps", "3", "--warmup-steps", "1", "--modes", "zero2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_stops_all_ranks_and_exits_130() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardopt", "demo", *TINY, "--steps", "100000"], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # rank 0 prints this once training starts
        assert "training tiny with zero2 on 2 ranks" in first, first
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "shardopt demo: interrupted; all ranks were stopped", err
    deadline = time.monotonic() + 10
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _session_processes(proc.pid) == []


def test_killing_the_launcher_takes_the_fork_server_and_every_rank_with_it() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardopt", "demo", *TINY, "--steps", "100000"], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert "training tiny with zero2 on 2 ranks" in first, first
        family = _session_processes(proc.pid)  # launcher, fork server, 2 ranks, resource tracker
        assert len(family) >= 4, family
        os.kill(proc.pid, signal.SIGKILL)  # what the OOM killer does: nothing can clean up
        proc.wait()
        start = time.monotonic()
        while _session_processes(proc.pid) and time.monotonic() - start < 5:
            time.sleep(0.02)
        assert _session_processes(proc.pid) == [], f"orphans after {time.monotonic() - start:.1f} s"
    finally:
        for left in _session_processes(proc.pid):
            os.kill(left, signal.SIGKILL)


def test_demo_runs_unchanged_under_torchrun(tmp_path: Any) -> None:
    out = tmp_path / "torchrun.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "shardopt",
           "demo", *TINY, "--steps", "3", "--warmup-steps", "1", "--mode", "zero1", "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "final loss" in done.stdout
    data = _json(out)
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["ranks"][0]["world_size"] == 2


@pytest.mark.gpu
def test_demo_on_one_gpu_reports_device_memory(tmp_path: Any) -> None:
    data = _demo(tmp_path, "gpu", "--mode", "zero2", "--steps", "3", "--world-size", "1", "--warmup-steps", "1")
    rank = data["ranks"][0]
    assert rank["backend"] == "nccl" and rank["device_peak"] > 0 and rank["bytes_per_step"] is None


@pytest.mark.gpu
def test_demo_with_two_ranks_sharing_one_gpu_trains_on_it_over_gloo(tmp_path: Any) -> None:
    data = _demo(tmp_path, "shared", "--mode", "zero2", "--steps", "3", "--world-size", "2", "--warmup-steps", "1",
                 "--device", "cuda")
    for rank in data["ranks"]:
        assert rank["backend"] == "gloo" and rank["device_peak"] > 0 and rank["bytes_per_step"] > 0, rank


def test_resume_with_steps_at_or_below_the_checkpoint_step_is_refused(tmp_path: Any,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Before, this exited 0 and reported a NaN loss (no step was run).
    ck = tmp_path / "ck.pt"
    _demo(tmp_path, "first", "--steps", "3", "--checkpoint", str(ck), "--world-size", "1")
    capsys.readouterr()
    _assert_one_line_errors([
        (["demo", *TINY, "--steps", "2", "--checkpoint", str(ck), "--resume", "--world-size", "1"],
         "is at step 3 but --steps is 2: there is nothing left to train; pass --steps greater than 3"),
    ], capsys)
