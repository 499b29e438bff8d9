"""``shardopt rehearse`` of the offload modes: the host bytes at the replayed peak against the
formula of :func:`shardopt.memory.estimate_offload` over what the rank owns, the device side
against the same mode without offload, and the CLI's host and device figures and errors; with
``--delayed-update`` (``OSS(delay_update_after=...)``) the host also holds the copy of the gradient
buffer, as it does for a real delayed OSS at 2 ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardopt.app.cli import main
from shardopt.app.precision import Precision
from shardopt.app.rehearse import CATEGORIES, RankRehearsal, RehearsalConfig, rehearse_on_group, rehearse_rank
from shardopt.app.modes import MODES, Setup
from shardopt.app.rehearse_build import build_rank, make_batch, materialize, model_spec, num_params
from shardopt.app.storage_trace import StorageTracker
from shardopt.memory import estimate_offload
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.cli import assert_one_line_errors

TINY = model_spec("tiny", None)  # the built-in GPT: 42,880 parameters in 29 tensors
N, RANK = 2, 1


def _rehearse(mode: str, precision: Precision, delayed_update: bool = False) -> RankRehearsal:
    config = RehearsalConfig(TINY, mode, precision, N, batch_size=2, seq_len=16, delayed_update=delayed_update)
    result = rehearse_rank(config, RANK)
    parts = [getattr(result.memory, name) for name in CATEGORIES]
    assert result.replay_matched and sum(parts) == result.memory.total == result.peak_bytes, (mode, result.memory)
    assert result.memory.device + result.memory.host == result.peak_bytes, (mode, result.memory)
    assert result.memory.host_held, (mode, result.memory)  # so device is the step's device peak too
    return result


def _owned(mode: str, precision: Precision) -> tuple[int, int]:
    """Elements of this rank's masters and the tensors its wrapped optimizer steps, from the built OSS itself."""
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=N)
    try:
        built = build_rank(TINY, mode, precision, torch.device("cpu"), shard_size=None, checkpointing=False,
                           batch_size=2, seed=0)
        opt = built.optimizer
        assert isinstance(opt, OSS) and opt.offload == "cpu"
        owned = sum(m.numel() for m in (opt.master_of(p) for p in opt.params) if m is not None)
        stepped = sum(len(g["params"]) for g in opt.optim.param_groups)
        if isinstance(built.model, ShardedDataParallel):
            built.model.close()
        return owned, stepped
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_offloaded_oss_host_bytes_equal_the_formula_and_leave_the_device(stage: str) -> None:
    for precision in (Precision("fp32"), Precision("bf16-master")):
        row = next(r for r in estimate_offload(N, precision.name != "fp32")
                   if r.stage == f"ZeRO-{stage[-1]}" and r.offload)
        per_owned = row.host * N  # the formula's Psi / N replaced by what the rank owns
        assert per_owned == 16
        owned, stepped = _owned(f"{stage}-offload", precision)
        off = _rehearse(f"{stage}-offload", precision).memory
        # masters (or fp32 mirrors) 4, their kept gradient buffer 4, Adam's moments 8 per owned element; 4-byte steps
        assert off.host == per_owned * owned + 4 * stepped, (stage, precision.name, off)
        assert off.host == off.masters + off.optimizer, (stage, precision.name, off)
        base = _rehearse(stage, precision).memory
        # What leaves the device is what the mode without offload kept there for the optimizer at the same event: its
        # masters (and their gradients where the peak is at the step) and Adam's state. The host also holds what
        # offload adds (fp32 mirrors, the kept buffer), so the drop is at most the host bytes. Measured: exact but for
        # 88 bytes of zero2-offload fp32's bookkeeping outside the categories' tensors (in "other").
        moved = base.masters + base.optimizer
        drop = base.total - off.device
        assert off.phase == base.phase and abs(drop - moved) <= 128 and drop <= off.host, (stage, precision.name,
                                                                                            drop, moved, off, base)


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_a_rehearsed_delayed_update_adds_its_gradient_copy_to_the_host_as_the_formula_says(stage: str) -> None:
    for precision in (Precision("fp32"), Precision("bf16-master")):
        row = next(r for r in estimate_offload(N, precision.name != "fp32", delayed_update=True)
                   if r.stage == f"ZeRO-{stage[-1]}" and r.offload)
        assert row.host * N == 20 and row.delayed_update  # the formula's 16 and the copy's 4
        owned, stepped = _owned(f"{stage}-offload", precision)
        delayed = _rehearse(f"{stage}-offload", precision, delayed_update=True).memory
        plain = _rehearse(f"{stage}-offload", precision).memory
        assert delayed.host == row.host * N * owned + 4 * stepped, (stage, precision.name, delayed)
        assert delayed.host - plain.host == 4 * owned == delayed.masters - plain.masters, (delayed, plain)
        # Adam's temporaries now run on the worker thread, which the tracker does not see (Note [a rehearsed
        # delayed update] in shardopt/app/rehearse_build.py): measured, zero2's peak (in backward) is the same and
        # zero1's (in the step) lower by them.
        assert delayed.host_held and delayed.device <= plain.device, (stage, precision.name, delayed, plain)


def _real_delayed_host_bytes(rank: int, world_size: int) -> dict[str, tuple[int, int, int]]:
    """A real OSS(offload="cpu", delay_update_after=0) and one without the delay, as the zero1-offload and
    zero2-offload modes build them (Setup.delay_update_after), after 3 steps: the bytes of the distinct host
    storages they keep (OSS.offloaded_buffers() and the wrapped optimizer's state), the elements this rank owns
    and the tensors its optimizer steps."""
    out: dict[str, tuple[int, int, int]] = {}
    for mode in ("zero1-offload", "zero2-offload"):
        for precision in (Precision("fp32"), Precision("bf16-master")):
            for delay in (0, None):
                torch.manual_seed(0)
                with torch.device("meta"):
                    module = TINY.build()
                materialize(module, torch.device("cpu"), precision.param_dtype)
                setup = Setup(1e-3, torch.device("cpu"), precision, 2, 1, delay_update_after=delay)
                wrapped = MODES[mode].wrap(module, setup)
                opt = wrapped.optimizer
                assert isinstance(opt, OSS)
                batch = make_batch(TINY, 2, 16, rank, 0, torch.device("cpu"))
                for _ in range(3):
                    opt.zero_grad()
                    TINY.loss(wrapped.model, *batch).backward()
                    opt.step()
                opt.finish_update()
                state = [t for s in opt.optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
                storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for t in [*opt.offloaded_buffers(), *state]}
                owned = sum(m.numel() for m in (opt.master_of(p) for p in opt.params) if m is not None)
                stepped = sum(len(g["params"]) for g in opt.optim.param_groups)
                out[f"{mode}/{precision.name}/{delay}"] = (sum(storages.values()), owned, stepped)
                if isinstance(wrapped.model, ShardedDataParallel):
                    wrapped.model.close()
    return out


@pytest.mark.distributed
def test_the_estimate_of_a_delayed_update_equals_the_host_bytes_of_a_real_delayed_oss_at_2_ranks_to_the_byte() -> None:
    for rank, measured in enumerate(run_ranks(_real_delayed_host_bytes, N, timeout_s=300)):
        for tag, (host, owned, stepped) in measured.items():
            mode, precision, delay = tag.split("/")
            row = next(r for r in estimate_offload(N, precision != "fp32", delayed_update=delay == "0")
                       if r.stage == f"ZeRO-{mode[4]}" and r.offload)
            assert host == row.host * N * owned + 4 * stepped, (rank, tag, host, owned, stepped)
        for key in [k for k in measured if k.endswith("/0")]:
            plain = measured[key.removesuffix("/0") + "/None"]
            assert measured[key][0] - plain[0] == 4 * plain[1], (rank, key)  # the copy: 4 bytes per owned element


def test_zero3_offload_host_bytes_are_the_shards_and_the_state_and_leave_the_device() -> None:
    _, shapes = num_params(TINY)
    slots = sum(math.ceil(s[0] / N) * math.prod(s[1:]) for s in shapes)  # Note [flat parameter layout]
    for precision in (Precision("fp32"), Precision("bf16-master")):
        off = _rehearse("zero3-offload", precision).memory
        base = _rehearse("zero3", precision).memory
        # the peak is in backward, before the reduced gradients land on the host: fp32 shards 4 and Adam's moments 8
        # per owned element (the formula's 16 less the gradients' 4), 4-byte steps per parameter
        assert off.phase == "backward" and off.grads == 0
        assert off.host == 12 * slots + 4 * len(shapes) == off.params + off.optimizer, (precision.name, off)
        assert base.total - off.device == base.params + base.optimizer == off.host, (precision.name, off, base)


def _real(rank: int, world_size: int, configs: list[RehearsalConfig]) -> list[tuple[int, int]]:
    return [(r.peak_bytes, r.memory.host) for r in map(rehearse_on_group, configs)]


@pytest.mark.distributed
def test_fake_offload_rehearsal_equals_a_real_two_rank_gloo_run() -> None:
    configs = [RehearsalConfig(TINY, mode, Precision("bf16-master"), N, batch_size=2, seq_len=16, steps=3)
               for mode in ("zero1-offload", "zero2-offload", "zero3-offload")]
    configs += [RehearsalConfig(TINY, mode, Precision("bf16-master"), N, batch_size=2, seq_len=16, steps=3,
                                delayed_update=True) for mode in ("zero1-offload", "zero2-offload")]
    real = run_ranks(_real, N, configs, timeout_s=300)
    for index, config in enumerate(configs):
        for rank in range(N):
            fake = rehearse_rank(config, rank)
            assert real[rank][index] == (fake.peak_bytes, fake.memory.host), (config.mode, rank, real[rank][index])


def test_rehearse_offload_reports_host_and_device_and_judges_the_fit_on_the_device(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.json"
    assert main(["rehearse", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--threads", "1",
                 "--world-size", "2", "--mode", "zero2-offload", "--ranks", "1", "--device-memory", "1GiB",
                 "--json", str(out)]) == 0
    row = json.loads(out.read_text())["ranks"][0]
    memory = row["memory"]
    assert sum(memory[name] for name in CATEGORIES) == memory["total"] == memory["device"] + memory["host"]
    assert memory["host"] > 0 and row["device_needed_bytes"] == memory["device"] < row["needed_bytes"]
    assert row["fits"] and row["headroom_bytes"] == 2**30 - memory["device"]
    shown = capsys.readouterr().out
    assert "zero2-offload at bf16 params + fp32 masters" in shown and "host" in shown


def test_rehearse_offload_bad_combinations_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["rehearse", "--model", "tiny", "--world-size", "2"]
    assert_one_line_errors([
        ([*base, "--mode", "zero1-offload", "--precision", "bf16"],
         "--precision bf16: mode 'zero1-offload' does not run at precision 'bf16'"),
        ([*base, "--mode", "zero3-offload", "--precision", "bf16"],
         "--precision bf16: mode 'zero3-offload' is rehearsed at fp32 or bf16-master"),
        ([*base, "--mode", "zero2-offload", "--shard-size", "2"],
         "--shard-size 2 applies to --mode zero1-hybrid and zero2-hybrid only"),
        ([*base, "--mode", "zero3-offload", "--delayed-update"],
         "--delayed-update applies to --mode zero1-offload and zero2-offload only (an offloaded OSS delays its update), "
         "not --mode zero3-offload; pick one of them, or drop --delayed-update"),
        # the device side only: bf16 parameters and their gradients, 4 bytes x 875,264 (estimate_offload's ZeRO-1 row)
        (["rehearse", "--model", "small", "--world-size", "2", "--mode", "zero1-offload", "--device-memory", "1MiB"],
         "--device-memory 1.00 MiB is too small for --model small in --mode zero1-offload at --world-size 2: a rank's "
         "model states alone take 3.34 MiB"),
    ], capsys)


def test_host_storages_born_in_the_step_or_freed_in_it_are_not_held() -> None:
    from shardopt.app.rehearse import _held
    from shardopt.app.storage_trace import storage_key

    with StorageTracker("cpu") as tracker:
        before = torch.empty(16)
        start = tracker.events
        during = torch.empty(16)
        freed = torch.empty(16)
        keys = [storage_key(t) for t in (before, during, freed)]
        del freed
        assert _held(tracker, frozenset(keys[:1]), start)
        assert not _held(tracker, frozenset(keys[:2]), start)  # born in the step: the host may have grown in it
        assert not _held(tracker, frozenset({keys[0], keys[2]}), start)  # freed before the step ended
        del before, during
