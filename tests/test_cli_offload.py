"""The offload modes of ``shardopt bench`` / ``demo`` (zero1-, zero2-, zero3- and fsdp2-offload;
Note [offload modes] in shardopt.app.offload_modes): each trains end to end on 2 CPU ranks, equals its mode without
offload bit for bit, resumes from its own checkpoint, and the report splits the model states
into those on the training device and those offloaded to the host; ``ddp-amp`` autocasts the
forward in bf16 and steps with torch's fused Adam."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from shardopt.app.bench import bench_rank
from shardopt.app.cli import main
from shardopt.app.launch import run_launched
from shardopt.app.modes import MODES, Setup, resolve
from shardopt.app.models import build_model
from shardopt.app.runner import TrainJob
from shardopt.testing import run_ranks
from tests.helpers.cli import TINY, assert_one_line_errors

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

BENCHED = ("zero1", "zero1-offload", "zero2", "zero2-offload", "zero2-offload-bf16m", "zero3-offload", "fsdp2-reshard",
           "fsdp2-offload", "ddp-amp")
PAIRS = (("zero1-bf16m", "zero1-offload-bf16m"), ("zero2-bf16m", "zero2-offload-bf16m"),
         ("zero2-bf16m-bf16reduce", "zero2-offload-bf16m-bf16reduce"))
"""Each mode with fp32 masters and its offloaded form."""


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def _final_params(name: str, tmp_path: Path, steps: int = 4) -> dict[str, torch.Tensor]:
    mode, precision = resolve(name)
    out = str(tmp_path / f"{name}.pt")
    job = TrainJob(mode=mode.name, precision=precision, preset="tiny", steps=steps, batch_size=2, warmup_steps=1,
                   params_out=out, threads_per_rank=1, device="cpu")
    run_launched("bench", bench_rank, 2, job)
    return dict(torch.load(out, weights_only=True))


def test_offload_modes_train_bit_for_bit_as_without_offload_and_report_host_state(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", *TINY, "--steps", "4", "--warmup-steps", "1", "--modes", ",".join(BENCHED),
                 "--json", str(out)]) == 0
    data = _json(out)
    results = {r["mode"]: r for r in data["results"]}
    assert list(results) == ["ddp", *BENCHED]
    psi = data["num_params"]
    tensors = len(list(build_model("tiny").parameters()))
    for name, r in results.items():
        for rank in r["ranks"]:
            assert rank["heap_after_step"] > 0 and rank["bytes_per_step"] > 0 and rank["counted_steps"] == 3, name
    # On CPU ranks the offloaded step runs the same torch kernels on the same values: an fp32
    # parameter's host mirror is its exact copy, the flat step over aligned segments equals the
    # per-parameter one (Note [aligned segments] in shardopt.optim.flat_masters), the copies to
    # and from the host are exact, and at 2 ranks in fp32 every one of these modes sums and
    # halves the two gradients as DDP does. So their parameters are DDP's, bit for bit.
    for name in ("zero1-offload", "zero2-offload", "zero3-offload", "fsdp2-offload"):
        assert results[name]["max_param_diff"] == 0.0, (name, results[name]["max_param_diff"])
        assert [k["final_loss"] for k in results[name]["ranks"]] == [k["final_loss"] for k in results["ddp"]["ranks"]]
    # Model states (Note [counting offloaded state] in shardopt.app.state_count): offloaded to the host at the
    # update, 16 bytes per owned element (master or mirror 4, Adam's moments 8, the gradient buffer kept between
    # steps 4) plus Adam's 4-byte step count per stepped tensor (a flat tensor per rank and one per unaligned
    # master: at most one per parameter and rank); on the device after the step only the parameters, and with
    # fp32 mirrors a one-element placeholder in the .grad of each owned parameter (its gradient stays on the host)
    for name, width in (("zero2-offload", 4), ("zero2-offload-bf16m", 2)):
        ranks = results[name]["ranks"]
        assert all(0 <= k["device_state_bytes"] - width * psi <= (4 * tensors if width == 4 else 0) for k in ranks), (
            name, ranks)
        extra = sum(k["host_state_bytes"] for k in ranks) - 16 * psi
        assert 0 < extra <= 4 * (tensors + 2) and extra % 4 == 0, (name, extra)
    # ZeRO-1 keeps the fp32 parameters and DDP's gradients on the device (the owned ones handed back after the step)
    zero1 = results["zero1-offload"]["ranks"]
    assert all(k["device_state_bytes"] == 2 * 4 * psi for k in zero1), zero1
    assert [k["host_state_bytes"] for k in zero1] == [k["host_state_bytes"] for k in results["zero2-offload"]["ranks"]]
    # ZeRO-3 and FSDP2 offload the parameter shards too: nothing between steps on the device, 16 bytes per element
    # of a rank's shard (the tiny model splits evenly over 2 ranks: no padding) plus the step counts
    for name in ("zero3-offload", "fsdp2-offload"):
        ranks = results[name]["ranks"]
        assert all(k["device_state_bytes"] == 0 for k in ranks), (name, ranks)
        assert all(0 < k["host_state_bytes"] - 16 * psi // 2 <= 4 * tensors for k in ranks), (name, ranks)
    for name in ("ddp", "zero1", "zero2", "ddp-amp"):  # counted, nothing offloaded
        assert all(k["host_state_bytes"] == 0 and k["device_state_bytes"] > 0 for k in results[name]["ranks"]), name
    assert all(k["device_state_bytes"] is None for k in results["fsdp2-reshard"]["ranks"])  # a peer's: not counted
    assert results["zero2-offload"]["ranks"][0]["device_state_bytes"] < results["zero2"]["ranks"][0][
        "device_state_bytes"]
    printed = capfd.readouterr().out
    caption = " ".join(printed.split())
    for text in ("states on device / on host = parameters, gradients, masters and optimizer state counted from",
                 "on CPU ranks (gloo) the device is host memory too"):
        assert text in caption, text


def test_offloaded_masters_train_bit_for_bit_as_masters_on_the_device(tmp_path: Path) -> None:
    # bf16 parameters with fp32 masters: the master is fp32 with and without offload, and the host step is the
    # device step on a CPU rank (the same reasoning as above), so the parameters agree exactly
    for device_mode, offload_mode in PAIRS:
        on_device, offloaded = _final_params(device_mode, tmp_path), _final_params(offload_mode, tmp_path)
        assert on_device.keys() == offloaded.keys()
        assert all(torch.equal(on_device[k], offloaded[k]) for k in on_device), (device_mode, offload_mode)
        assert all(v.dtype == torch.bfloat16 for v in offloaded.values())


def _demo(tmp_path: Path, name: str, *extra: str) -> list[float]:
    out = tmp_path / f"{name}.json"
    assert main(["demo", *TINY, "--json", str(out), *extra]) == 0
    return [r["final_loss"] for r in _json(out)["ranks"]]


def test_offload_modes_resume_from_their_own_checkpoints_and_scale_fp16(tmp_path: Path) -> None:
    for mode in ("zero2-offload", "zero3-offload", "fsdp2-offload", "ddp-amp"):
        ckpt = str(tmp_path / f"ckpt-{mode}")
        straight = _demo(tmp_path, f"{mode}-straight", "--mode", mode, "--steps", "5")
        _demo(tmp_path, f"{mode}-first", "--mode", mode, "--steps", "2", "--checkpoint", ckpt)
        if mode == "zero2-offload":  # the same consolidated file as zero2's (mirrors are never saved)
            shutil.copyfile(ckpt, ckpt + "-zero2")
            assert _demo(tmp_path, "zero2-from-offload", "--mode", "zero2", "--steps", "5", "--checkpoint",
                         ckpt + "-zero2", "--resume") == straight
        assert _demo(tmp_path, f"{mode}-resumed", "--mode", mode, "--steps", "5", "--checkpoint", ckpt,
                     "--resume") == straight, mode
    # fp16 autocast with ShardedGradScaler and accumulation: the offloaded scaler step is the device one
    fp16 = ("--steps", "3", "--grad-accum", "2", "--amp", "fp16")
    assert _demo(tmp_path, "zero2-fp16", "--mode", "zero2", *fp16) == _demo(tmp_path, "zero2-offload-fp16", "--mode",
                                                                            "zero2-offload", *fp16)


def test_ddp_amp_autocasts_the_forward_in_bf16_and_steps_with_fused_adam(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    amp = _demo(tmp_path, "ddp-amp", "--mode", "ddp-amp", "--steps", "4")
    autocast = _demo(tmp_path, "ddp-bf16-autocast", "--mode", "ddp", "--amp", "bf16", "--steps", "4")
    fp32 = _demo(tmp_path, "ddp", "--mode", "ddp", "--steps", "4")
    # the same bf16 forward as --amp bf16; fused Adam may round a tensor's tail elements differently from the
    # for-loop Adam (Note [aligned segments] in shardopt.optim.flat_masters): equal here after 4 steps
    assert all(abs(a - b) <= 1e-5 for a, b in zip(amp, autocast, strict=True)), (amp, autocast)
    assert amp != fp32  # the forward ran in bf16
    assert run_ranks(_ddp_amp_optimizer, 1)[0] == (True, torch.float32)
    assert_one_line_errors([
        (["demo", "--mode", "ddp-amp", "--amp", "fp16"],
         "--amp fp16: mode 'ddp-amp' autocasts its forward in bf16 itself; drop --amp, or use --mode ddp --amp fp16"),
        (["demo", "--mode", "ddp-amp", "--precision", "bf16"], "mode 'ddp-amp' does not run at precision 'bf16'"),
        (["demo", "--mode", "zero2-offload", "--precision", "bf16"],
         "mode 'zero2-offload' does not run at precision 'bf16' (bf16 params); it runs at fp32, bf16-master"),
    ], capsys)
    assert run_ranks(_amp_twice, 1)[0] == ("TrainJob(amp='bf16') with mode 'ddp-amp', which autocasts in bf16 itself; "
                                           "keep amp=None")


def _ddp_amp_optimizer(rank: int, world_size: int) -> tuple[bool, torch.dtype]:
    wrapped = MODES["ddp-amp"].wrap(build_model("tiny"), Setup(1e-3, torch.device("cpu")))
    return wrapped.optimizer.defaults["fused"], next(wrapped.module.parameters()).dtype


def _amp_twice(rank: int, world_size: int) -> str:
    from shardopt.app.runner import train

    try:
        train(TrainJob(mode="ddp-amp", amp="bf16", preset="tiny", steps=1, batch_size=2, device="cpu"))
    except ValueError as exc:
        return str(exc)
    return "accepted"



def test_estimate_offload_shows_device_and_host_bytes_per_parameter(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--params", "7.5e9", "--world-size", "64", "--offload", "cpu", "--json", str(out)]) == 0
    data = _json(out)
    psi = data["num_params"]
    rows = {(r["stage"], r["offload"]): r for r in data["offload"]}
    # bf16 parameters + fp32 masters + Adam (Note [offload bytes per parameter] in shardopt.memory)
    assert [(r["device_bytes_per_param"], r["host_bytes_per_param"], r["host_peak_bytes_per_param"])
            for r in data["offload"]] == [(16, 0, 0), (4 + 12 / 64, 0, 0), (4, 16 / 64, 16 / 64), (2 + 14 / 64, 0, 0),
                                          (2, 16 / 64, 16 / 64), (16 / 64, 0, 0), (0, 16 / 64, 16 / 64)]
    # the rows without offload are the paper's
    assert [rows[(s, False)]["device_bytes"] for s in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")] == [
        data[k] for k in ("ddp_bytes", "stage1_bytes", "stage2_bytes", "stage3_bytes")]
    assert rows[("ZeRO-2", True)]["bench_mode"] == "zero2-offload-bf16m" and rows[("ZeRO-2", True)][
        "host_bytes"] == 16 * psi / 64
    printed = " ".join(capsys.readouterr().out.split())
    for text in ("device and host memory, 64 ranks, bf16 params + fp32 masters, Adam: without and with offload",
                 "zero2-offload-bf16m", "ZeRO-3 + offload: FullyShardedDataParallel(cpu_offload=CPUOffload("):
        assert text in printed, text
    assert main(["estimate", "--params", "1e9", "--world-size", "8", "--fp32", "--offload", "cpu", "--json",
                 str(out)]) == 0
    rows = {(r["stage"], r["offload"]): r for r in _json(out)["offload"]}
    # fp32: the host keeps a 4-byte mirror besides Adam's 8 and the 4-byte gradient buffer
    assert (rows[("ZeRO-2", True)]["device_bytes_per_param"], rows[("ZeRO-2", True)]["host_bytes_per_param"]) == (4, 2)
    assert rows[("ZeRO-3", True)]["bench_mode"] == "zero3-offload" and rows[("ZeRO-1", True)]["device_bytes"] == 8e9
    assert main(["estimate", "--params", "1e9", "--world-size", "8", "--json", str(out)]) == 0
    assert _json(out)["offload"] is None
    assert_one_line_errors([(["estimate", "--params", "1e9", "--world-size", "8", "--offload", "nvme"],
                             "argument --offload: invalid choice: 'nvme'")], capsys)


def test_estimate_offload_with_delayed_update_adds_the_gradient_copy_to_the_zero1_and_zero2_host(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--params", "7.5e9", "--world-size", "64", "--offload", "cpu", "--delayed-update",
                 "--json", str(out)]) == 0
    rows = {(r["stage"], r["offload"]): r for r in _json(out)["offload"]}
    for stage in ("ZeRO-1", "ZeRO-2"):  # 16 bytes per owned parameter and the delayed step's 4-byte copy
        row = rows[(stage, True)]
        assert (row["host_bytes_per_param"], row["host_peak_bytes_per_param"]) == (20 / 64, 20 / 64), row
        assert row["delayed_update"] and row["bench_mode"] is None, row  # no bench mode delays the update
    zero3 = rows[("ZeRO-3", True)]  # FullyShardedDataParallel's offload keeps no OSS: no delayed update
    assert zero3["host_bytes_per_param"] == 16 / 64 and not zero3["delayed_update"], zero3
    assert rows[("ZeRO-2", False)]["device_bytes_per_param"] == 2 + 14 / 64
    printed = " ".join(capsys.readouterr().out.split())
    for text in ("without and with offload (ZeRO-1/2: and the delayed update)", "cpu+delay",
                 "also keeps the copy of the gradient buffer its delayed step reads, 4 B per owned parameter"):
        assert text in printed, text
    assert_one_line_errors([(["estimate", "--params", "1e9", "--world-size", "8", "--delayed-update"],
                             "--delayed-update counts the host copy of OSS(offload='cpu', delay_update_after=k): "
                             "pass --offload cpu with it, or drop --delayed-update")], capsys)


def _offloaded_bytes(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    """Model-state bytes of OSS(offload="cpu") counted as the bench counts them (host at the update,
    device after the step), the ZeRO-2 host bytes between backward and the step, and what this rank owns."""
    import weakref

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardopt.app.state_count import StateCount
    from shardopt.app.wrapping import Wrapped, plain_no_sync
    from shardopt.nn import ShardedDataParallel
    from shardopt.optim import OSS

    out: dict[str, dict[str, int]] = {}
    for stage in ("zero1", "zero2"):
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)  # aligned weights, unaligned biases (stepped as views), one split 64x64 weight
            model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48),
                                  nn.ReLU(), nn.Linear(48, 4)).to(dtype)
            opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3, offload="cpu",
                      master_dtype=torch.float32 if dtype != torch.float32 else None)
            wrapped: nn.Module = DDP(model) if stage == "zero1" else ShardedDataParallel(model, opt)
            states = StateCount(Wrapped(wrapped, model, opt, plain_no_sync, opt.zero_grad, offloaded=True))
            masters = [m for m in (opt.master_of(p) for p in opt.params) if m is not None]
            buffer: list[Any] = []

            def kept(*_: object, masters: list[Any] = masters, buffer: list[Any] = buffer) -> None:
                grad = masters[0].grad  # a view of the gradient buffer, which OSS keeps for the next step
                buffer[:] = [weakref.ref(grad), grad.untyped_storage().data_ptr(), grad.untyped_storage().nbytes()]

            handle = opt.optim.register_step_post_hook(kept)
            torch.manual_seed(1 + rank)
            for step in range(3):
                opt.zero_grad()
                wrapped(torch.randn(16, 8, dtype=dtype)).float().square().mean().backward()
                if step == 2:  # between backward and the step: what the host holds besides the kept buffer
                    waiting = {m.grad.untyped_storage().data_ptr(): m.grad.untyped_storage().nbytes()
                               for m in masters if m.grad is not None}
                opt.step()
            handle.remove()
            states.remove()
            assert states.device_bytes is not None and states.host_bytes is not None
            alive = buffer[0]() is not None
            waiting = {ptr: nbytes for ptr, nbytes in waiting.items() if ptr != buffer[1]}  # outside the kept buffer
            out[f"{stage}/{dtype}"] = {
                "device": states.device_bytes, "host": states.host_bytes, "owned": sum(m.numel() for m in masters),
                "stepped": len([p for g in opt.optim.param_groups for p in g["params"]]),
                "psi": sum(p.numel() for p in model.parameters()),
                "not_owned": sum(p.numel() for p in opt.params if opt.owned_rows(p) is None),
                "owned_params": sum(1 for p in opt.params if opt.owned_rows(p) is not None),
                "waiting": sum(waiting.values()), "buffer": buffer[2] if alive else 0}
    return out


def test_offloaded_host_bytes_measured_at_two_ranks_equal_the_formula() -> None:
    from shardopt.memory import estimate_offload

    ranks = run_ranks(_offloaded_bytes, 2, timeout_s=300)
    for key in ranks[0]:
        stage, dtype = key.split("/")
        mixed = dtype == "torch.bfloat16"
        formula = {(r.stage, r.offload): r for r in estimate_offload(2, mixed_precision=mixed)}
        row = formula[("ZeRO-1" if stage == "zero1" else "ZeRO-2", True)]
        per_owned = row.host * 2  # the formula's Psi / N replaced by what the rank owns (Note [the formula and the plan])
        assert per_owned == 16
        psi = ranks[0][key]["psi"]
        assert sum(r[key]["owned"] for r in ranks) == psi, key
        for r in ranks:
            # exactly the formula, plus Adam's 4-byte step count per stepped tensor (not in the formula)
            assert r[key]["host"] == per_owned * r[key]["owned"] + 4 * r[key]["stepped"], (key, r[key])
            width = 2 if mixed else 4
            if stage == "zero2":
                # the parameters only; an fp32 mirror's gradient stays on the host after the step (Note [mirrors carry
                # gradients] in shardopt.optim.masters) behind a one-element placeholder in param.grad
                assert r[key]["device"] == row.device * psi + (0 if mixed else 4 * r[key]["owned_params"]), (key, r[key])
                # before the step the reduced gradients are already in the kept buffer (OSS.add_grad: one copy),
                # none waits in a tensor of its own: the host peak is the update's
                assert r[key]["buffer"] == 4 * r[key]["owned"], (key, r[key])
                assert row.host_peak == row.host and r[key]["waiting"] == 0, (key, r[key])
            elif mixed:  # the parameters, and DDP's gradients of the parameters this rank owns no rows of: the step
                # folded the others, whole, into the host buffer and freed them (the formula counts all: after backward)
                assert r[key]["device"] == width * (psi + r[key]["not_owned"]), (key, r[key])
            else:  # fp32: the parameters and DDP's gradients, the owned ones handed back after the step
                assert r[key]["device"] == row.device * psi == 2 * width * psi, (key, r[key])
