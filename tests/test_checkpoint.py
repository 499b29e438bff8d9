"""Checkpoints: a resumed run equals an uninterrupted one bit for bit; OSS state reshards
across world sizes; a failed write never leaves a half-written file."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from shardopt import checkpoint, comm, files
from shardopt.app.models import CharBatches, build_model, stdlib_corpus
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

_CORPUS = stdlib_corpus(2**16)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    """Data-parallel steps with gradients summed one parameter at a time, in a fixed order.

    (DDP rebuilds its buckets after the first iteration, so a fresh DDP sums in a different
    order than a long-running one at 3 ranks; this keeps the arithmetic identical.)
    """
    for step in steps:
        opt.zero_grad(set_to_none=step % 2 == 0)
        model(rank_batch(rank, step)).pow(2).mean().backward()
        for param in model.parameters():
            comm.all_reduce(param.grad, None).wait()  # type: ignore[arg-type]
        opt.step()


def _oss_resume(rank: int, world_size: int, path: str, sharded: bool) -> float:
    """Train 3 steps, save, train 3 more; reload into fresh objects, train the same 3: compare."""
    save = checkpoint.save_sharded if sharded else checkpoint.save_consolidated
    load = checkpoint.load_sharded if sharded else checkpoint.load_consolidated
    module = seeded_mlp()
    model, opt = module, OSS(module.parameters(), optim=torch.optim.Adam, lr=1e-2)
    _train(model, opt, rank, range(3))
    save(path, model if sharded else module, opt, {"step": 3})
    _train(model, opt, rank, range(3, 6))
    fresh = seeded_mlp(seed=1)  # different initial weights: everything must come from the file
    fresh_model, fresh_opt = fresh, OSS(fresh.parameters(), optim=torch.optim.Adam, lr=1e-2)
    extra = load(path, fresh_model if sharded else fresh, fresh_opt)
    assert extra == {"step": 3}, extra
    _train(fresh_model, fresh_opt, rank, range(3, 6))
    return max_abs_diff(module.parameters(), fresh.parameters())


def test_resumed_oss_run_matches_uninterrupted_run(tmp_path: Any) -> None:
    for sharded in (False, True):
        for world_size in (1, 2, 3):
            path = str(tmp_path / f"ckpt-{sharded}-{world_size}")
            diffs = run_ranks(_oss_resume, world_size, path, sharded, timeout_s=60)
            assert max(diffs) == 0.0, (sharded, world_size, diffs)


def _save_oss(rank: int, world_size: int, path: str, sharded: bool) -> dict[str, Any] | None:
    module = seeded_mlp()
    model, opt = module, OSS(module.parameters(), optim=torch.optim.Adam, lr=1e-2)
    _train(model, opt, rank, range(3))
    (checkpoint.save_sharded if sharded else checkpoint.save_consolidated)(path, module, opt)
    opt.consolidate_state_dict(recipient_rank=0)
    return opt.state_dict() if rank == 0 else None


def _load_oss(rank: int, world_size: int, path: str, sharded: bool) -> dict[str, Any] | None:
    module = seeded_mlp(seed=5)
    opt = OSS(module.parameters(), optim=torch.optim.Adam, lr=0.5)
    (checkpoint.load_sharded if sharded else checkpoint.load_consolidated)(path, module, opt)
    opt.consolidate_state_dict(recipient_rank=0)
    return opt.state_dict() if rank == 0 else None


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][name])), (index, name)


def test_oss_state_saved_at_two_ranks_loads_identically_at_three_and_one(tmp_path: Any) -> None:
    for sharded in (False, True):
        path = str(tmp_path / f"reshard-{sharded}")
        saved = run_ranks(_save_oss, 2, path, sharded, timeout_s=60)[0]
        for world_size in (3, 1):
            loaded = run_ranks(_load_oss, world_size, path, sharded, timeout_s=60)[0]
            _same_state(saved, loaded)


def _fsdp2_resume(rank: int, world_size: int, path: str) -> float:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg_batches = CharBatches(_CORPUS, 2, 32, rank, world_size=world_size)

    def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        module = build_model("tiny", seed=seed)
        mesh = init_device_mesh("cpu", (world_size,))  # the default mesh is CUDA's wherever CUDA exists
        for block in module.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
        return module, torch.optim.Adam(module.parameters(), lr=1e-2)

    def steps(model: torch.nn.Module, opt: torch.optim.Optimizer, span: range) -> None:
        for step in span:
            opt.zero_grad()
            model(*cfg_batches.batch(step)).backward()
            opt.step()

    model, opt = make(0)
    steps(model, opt, range(2))
    checkpoint.save_sharded(path, model, opt, {"step": 2})
    steps(model, opt, range(2, 4))
    fresh, fresh_opt = make(1)
    assert checkpoint.load_sharded(path, fresh, fresh_opt) == {"step": 2}
    steps(fresh, fresh_opt, range(2, 4))
    full = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
    return max_abs_diff(full, [p.full_tensor() for p in fresh.parameters()])  # type: ignore[attr-defined]


def test_fsdp2_sharded_checkpoint_resumes_exactly(tmp_path: Any) -> None:
    diffs = run_ranks(_fsdp2_resume, 2, str(tmp_path / "fsdp2"), timeout_s=60)
    assert max(diffs) == 0.0, diffs


def _kind_mismatch(rank: int, world_size: int, path: str) -> str:
    module = seeded_mlp()
    opt = OSS(module.parameters(), optim=torch.optim.Adam, lr=1e-2)
    checkpoint.save_sharded(path, module, opt)
    try:
        checkpoint.load_sharded(path, module, torch.optim.Adam(module.parameters()))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_loading_oss_state_into_plain_optimizer_says_what_to_do(tmp_path: Any) -> None:
    messages = run_ranks(_kind_mismatch, 2, str(tmp_path / "kind"), timeout_s=60)
    assert all("holds 'oss' optimizer state" in m and "optimizer=None" in m for m in messages), messages


def test_failed_write_keeps_previous_checkpoint_and_leaves_no_temp_file(tmp_path: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "model.pt")
    module = seeded_mlp()
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    checkpoint.save_consolidated(path, module, opt, {"step": 1})
    before = open(path, "rb").read()

    real_save = torch.save

    def half_write(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        real_save(obj, f, *args, **kwargs)
        f.truncate(10)  # a crash after a partial write
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_write)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_consolidated(path, module, opt, {"step": 2})
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["model.pt"]
    assert checkpoint.load_consolidated(path, seeded_mlp(seed=3), None) == {"step": 1}


def test_load_errors_name_the_path_and_the_fix(tmp_path: Any) -> None:
    module = seeded_mlp()
    with pytest.raises(FileNotFoundError, match="save one first with save_consolidated"):
        checkpoint.load_consolidated(str(tmp_path / "missing.pt"), module)
    with pytest.raises(FileNotFoundError, match="save one first with save_sharded"):
        checkpoint.load_sharded(str(tmp_path / "missing"), module)
    torch.save({"format": "other"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a shardopt consolidated checkpoint"):
        checkpoint.load_consolidated(str(tmp_path / "other.pt"), module)
    with pytest.raises(TypeError, match="must be an nn.Module"):
        checkpoint.save_consolidated(str(tmp_path / "x.pt"), "model", None)  # type: ignore[arg-type]


def _zero3_save(rank: int, world_size: int, path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(seeded_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_fsdp(model, opt, rank, range(3))
    checkpoint.save_sharded(path, model, opt, {"step": 3})
    return model.state_dict(), FSDP.full_optim_state_dict(model, opt, rank0_only=False)


def _zero3_load(rank: int, world_size: int, path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(seeded_mlp(seed=4))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    assert checkpoint.load_sharded(path, model, opt) == {"step": 3}
    return model.state_dict(), FSDP.full_optim_state_dict(model, opt, rank0_only=False)


def _train_fsdp(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(rank_batch(rank, step)).pow(2).mean().backward()
        opt.step()


def test_save_sharded_writes_zero3_pieces_that_load_at_another_world_size(tmp_path: Any) -> None:
    path = str(tmp_path / "z3")
    model_state, osd = run_ranks(_zero3_save, 2, path, timeout_s=60)[0]
    for loaded_model, loaded_osd in run_ranks(_zero3_load, 3, path, timeout_s=60):
        assert max_abs_diff(loaded_model.values(), model_state.values()) == 0.0
        assert loaded_osd["param_groups"] == osd["param_groups"]
        for name, entry in osd["state"].items():
            for key, value in entry.items():
                assert torch.equal(loaded_osd["state"][name][key], value), (name, key)


def _frozen_resume(rank: int, world_size: int, folder: str, sharded: bool) -> float:
    """Train, freeze a layer (its Adam state is parked), save, resume in fresh objects,
    unfreeze, train on: the parked state must come back exactly."""
    save = checkpoint.save_sharded if sharded else checkpoint.save_consolidated
    load = checkpoint.load_sharded if sharded else checkpoint.load_consolidated
    path = os.path.join(folder, "sharded" if sharded else "file.pt")
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
    _train(model, opt, rank, range(3))
    model[2].requires_grad_(False)
    opt.refresh_trainable()
    _train(model, opt, rank, range(3, 4))
    save(path, model, opt, {"step": 4})
    model[2].requires_grad_(True)
    opt.refresh_trainable()
    _train(model, opt, rank, range(4, 7))
    fresh = seeded_mlp(seed=5)
    fresh_opt = OSS(fresh.parameters(), optim=torch.optim.Adam, lr=1e-2)
    fresh[2].requires_grad_(False)
    fresh_opt.refresh_trainable()
    load(path, fresh, fresh_opt)
    fresh[2].requires_grad_(True)
    fresh_opt.refresh_trainable()
    _train(fresh, fresh_opt, rank, range(4, 7))
    return max_abs_diff(fresh.parameters(), model.parameters())


def test_parked_state_of_frozen_parameters_survives_both_checkpoint_kinds(tmp_path: Any) -> None:
    for sharded in (False, True):
        folder = tmp_path / ("sharded" if sharded else "consolidated")
        folder.mkdir()
        for diff in run_ranks(_frozen_resume, 2, str(folder), sharded):
            assert diff == 0.0, (sharded, diff)


def _flip_a_byte_inside_a_tensor(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    blob = torch.load(path, weights_only=True)
    weight = blob["model"]["2.weight"].contiguous().numpy().tobytes()
    at = bytes(data).find(weight[:64])
    assert at > 0
    data[at + 17] ^= 0x40
    open(path, "wb").write(bytes(data))


def test_integrity_corruption_and_mismatches_fail_before_anything_is_loaded(tmp_path: Any) -> None:
    path = str(tmp_path / "model.pt")
    module = seeded_mlp()
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    module(rank_batch(0, 0)).sum().backward()
    opt.step()
    checkpoint.save_consolidated(path, module, opt, {"step": 1})
    # a flipped bit inside a tensor's data is found by its checksum
    corrupt = str(tmp_path / "corrupt.pt")
    open(corrupt, "wb").write(open(path, "rb").read())
    _flip_a_byte_inside_a_tensor(corrupt)
    target = seeded_mlp(seed=9)
    before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(ValueError, match="is corrupted: 1 record.s. fail their checksum, first '2.weight'"):
        checkpoint.load_consolidated(corrupt, target)
    # a model of another shape: refused naming the parameter, and nothing was copied
    wider = seeded_mlp(seed=9, width=17)
    wider_before = [p.detach().clone() for p in wider.parameters()]
    with pytest.raises(ValueError, match=r"'0.weight' has shape \(16, 8\) in the checkpoint but \(17, 8\).*Nothing"):
        checkpoint.load_consolidated(path, wider)
    assert all(torch.equal(a, b) for a, b in zip(wider.parameters(), wider_before))
    # an optimizer state that does not fit its parameters is refused at load, not at the next step
    blob = torch.load(path, weights_only=True)
    blob["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)
    del blob["checksums"]
    torch.save(blob, tmp_path / "bad_optim.pt")
    target_opt = torch.optim.Adam(target.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"optimizer state 'exp_avg' of parameter 0 has shape \(3,\) in the "
                                         r"checkpoint but the parameter has \(16, 8\).*Nothing was loaded"):
        checkpoint.load_consolidated(str(tmp_path / "bad_optim.pt"), target, target_opt)
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), before)) and not target_opt.state
    # a file without checksums (format /1) still loads
    blob = torch.load(path, weights_only=True)
    blob["format"] = "shardopt.consolidated/1"
    del blob["checksums"]
    torch.save(blob, tmp_path / "old.pt")
    assert checkpoint.load_consolidated(str(tmp_path / "old.pt"), target, target_opt) == {"step": 1}
    assert max_abs_diff(target.parameters(), module.parameters()) == 0.0


def test_stale_temp_files_of_a_killed_save_are_removed_by_the_next_save(tmp_path: Any) -> None:
    path = str(tmp_path / "model.pt")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".model.pt.tmp-{files.writer_tag()}-{dead.pid}"
    stale.write_bytes(b"half a checkpoint")
    checkpoint.save_consolidated(path, seeded_mlp(), None, {"step": 1})
    assert sorted(os.listdir(tmp_path)) == ["model.pt"]


def test_save_sharded_refuses_a_file_or_a_foreign_folder_and_leaves_it_alone(tmp_path: Any) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("the user's file")
    with pytest.raises(ValueError, match="is a file, but a sharded checkpoint is a folder"):
        checkpoint.save_sharded(str(a_file), seeded_mlp(), None)
    assert a_file.read_text() == "the user's file" and sorted(os.listdir(tmp_path)) == ["notes.txt"]
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(ValueError, match="holds something else than a shardopt checkpoint"):
        checkpoint.save_sharded(str(folder), seeded_mlp(), None)
    assert os.listdir(folder) == ["cat.jpg"]
    with pytest.raises(ValueError, match="is a folder, but a consolidated checkpoint is a file"):
        checkpoint.check_writable(str(folder), sharded=False)
    if os.path.isdir("/proc"):
        with pytest.raises(ValueError, match="cannot be written: no files can be created in '/proc'"):
            checkpoint.check_writable("/proc/ckpt", sharded=True)
    checkpoint.check_writable(str(tmp_path / "new" / "deeper" / "ckpt"), sharded=True)  # created on save


def _save_beside_a_gpu(rank: int, world_size: int, path: str) -> float:
    """A CPU job on a machine where CUDA is visible (faked in this rank: this torch has none, so
    any use of CUDA raises): the sharded save and load stay on the CPU."""
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]  # this rank process only
    module = seeded_mlp()
    opt = OSS(module.parameters(), optim=torch.optim.Adam, lr=1e-2)
    _train(module, opt, rank, range(2))
    checkpoint.save_sharded(path, module, opt, {"step": 2})
    fresh = seeded_mlp(seed=1)
    fresh_opt = OSS(fresh.parameters(), optim=torch.optim.Adam, lr=1e-2)
    assert checkpoint.load_sharded(path, fresh, fresh_opt) == {"step": 2}
    return max_abs_diff(module.parameters(), fresh.parameters())


def test_sharded_save_of_cpu_state_touches_no_gpu_where_one_is_visible(tmp_path: Any) -> None:
    assert max(run_ranks(_save_beside_a_gpu, 2, str(tmp_path / "ckpt"), timeout_s=60)) == 0.0
