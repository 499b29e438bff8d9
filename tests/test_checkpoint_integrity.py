"""Checkpoints lose nothing and never half-load: parked state survives every path, damage
is found by checksums on every rank, a load that does not fit changes nothing, and a save
never removes what is not its own."""

from __future__ import annotations

import copy
import glob
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from shardopt import checkpoint, comm, files
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks)

Snapshot = tuple[list[torch.Tensor], dict[str, Any]]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    """Data-parallel steps, gradients summed parameter by parameter in a fixed order."""
    for step in steps:
        opt.zero_grad(set_to_none=step % 2 == 0)
        model(rank_batch(rank, step)).pow(2).mean().backward()
        for param in model.parameters():
            if param.requires_grad:
                comm.all_reduce(param.grad, None).wait()  # type: ignore[arg-type]
        opt.step()


def _adam(model: torch.nn.Module) -> OSS:
    return OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)


def _snapshot(model: torch.nn.Module, opt: OSS) -> Snapshot:
    """Every parameter and the whole (consolidated, deep-copied) optimizer state."""
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict(all_ranks=True))


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys(), (a["state"].keys(), b["state"].keys())
    for index, entry in a["state"].items():
        assert entry.keys() == b["state"][index].keys(), index
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][name])), (index, name)


# ---------------------------------------------------------------------- parked state


def _save_with_a_frozen_layer(rank: int, world_size: int, folder: str) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Train, freeze layer 2 (its Adam state is parked), save both kinds, then go on
    uninterrupted: unfreeze and train 3 more steps."""
    model = seeded_mlp()
    opt = _adam(model)
    _train(model, opt, rank, range(3))
    model[2].requires_grad_(False)
    opt.refresh_trainable()
    _train(model, opt, rank, range(3, 4))
    checkpoint.save_sharded(os.path.join(folder, "sharded"), model, opt, {"step": 4})
    checkpoint.save_consolidated(os.path.join(folder, "file.pt"), model, opt, {"step": 4})
    saved = copy.deepcopy(opt.state_dict(all_ranks=True))
    model[2].requires_grad_(True)
    opt.refresh_trainable()
    _train(model, opt, rank, range(4, 7))
    return saved, [p.detach().clone() for p in model.parameters()]


def _resume_with_a_frozen_layer(rank: int, world_size: int, folder: str,
                                sharded: bool) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Fresh objects frozen the same way, load, unfreeze, train the same 3 steps."""
    model = seeded_mlp(seed=5)
    opt = _adam(model)
    model[2].requires_grad_(False)
    opt.refresh_trainable()
    if sharded:
        assert checkpoint.load_sharded(os.path.join(folder, "sharded"), model, opt) == {"step": 4}
    else:
        assert checkpoint.load_consolidated(os.path.join(folder, "file.pt"), model, opt) == {"step": 4}
    loaded = copy.deepcopy(opt.state_dict(all_ranks=True))
    model[2].requires_grad_(True)
    opt.refresh_trainable()
    _train(model, opt, rank, range(4, 7))
    return loaded, [p.detach().clone() for p in model.parameters()]


def test_parked_state_survives_save_sharded_at_the_same_and_another_world_size(tmp_path: Any) -> None:
    saved, uninterrupted = run_ranks(_save_with_a_frozen_layer, 2, str(tmp_path), timeout_s=60)[0]
    assert {4, 5} <= saved["state"].keys()  # layer 2's parked Adam state is in the saved state
    for world_size in (2, 3):
        sharded = run_ranks(_resume_with_a_frozen_layer, world_size, str(tmp_path), True, timeout_s=60)
        consolidated = run_ranks(_resume_with_a_frozen_layer, world_size, str(tmp_path), False, timeout_s=60)
        _assert_same_state(sharded[0][0], saved)
        _assert_same_state(consolidated[0][0], saved)
        for (_, a), (_, b) in zip(sharded, consolidated):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), world_size
        if world_size == 2:  # the same data as the uninterrupted run: the same parameters
            assert all(torch.equal(x, y) for x, y in zip(sharded[0][1], uninterrupted))


# ---------------------------------------------------------------------- checksums


def _flip_inside(folder: str, tensor: torch.Tensor) -> None:
    """Flip one bit inside ``tensor``'s bytes where a .distcp file of ``folder`` holds them."""
    needle = tensor.contiguous().numpy().tobytes()[:64]
    for name in glob.glob(os.path.join(folder, "*.distcp")):
        data = bytearray(Path(name).read_bytes())
        at = bytes(data).find(needle)
        if at >= 0:
            data[at + 17] ^= 0x40
            Path(name).write_bytes(bytes(data))
            return
    raise AssertionError("tensor not found in the folder")


def _save_adam(rank: int, world_size: int, path: str) -> dict[str, Any]:
    model = seeded_mlp()
    opt = _adam(model)
    _train(model, opt, rank, range(2))
    checkpoint.save_sharded(path, model, opt, {"step": 2})
    return copy.deepcopy(opt.state_dict(all_ranks=True))


def _failed_load(path: str, model: torch.nn.Module, opt: OSS) -> tuple[str, bool]:
    """``load_sharded`` that should fail: (its error, whether model and optimizer are unchanged)."""
    params, state = _snapshot(model, opt)
    try:
        checkpoint.load_sharded(path, model, opt)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    after_params, after_state = _snapshot(model, opt)
    unchanged = all(torch.equal(a, b) for a, b in zip(params, after_params))
    try:
        _assert_same_state(after_state, state)
    except AssertionError:
        unchanged = False
    return message, unchanged


def _load_adam_expecting_error(rank: int, world_size: int, path: str) -> tuple[str, bool]:
    """(the error, whether the model and the optimizer are as before the load)."""
    model = seeded_mlp(seed=3)
    opt = _adam(model)
    _train(model, opt, rank, range(1))
    return _failed_load(path, model, opt)


def test_damaged_optimizer_entry_of_one_rank_fails_the_load_on_every_rank_and_changes_nothing(tmp_path: Any) -> None:
    path = str(tmp_path / "ck")
    saved = run_ranks(_save_adam, 2, path, timeout_s=60)[0]
    _flip_inside(path, saved["state"][0]["exp_avg_sq"])  # owned (and checked) by one rank only
    for message, unchanged in run_ranks(_load_adam_expecting_error, 2, path, timeout_s=60):
        assert "is corrupted: 1 record(s) fail their checksum, first 'optim/0.exp_avg_sq'" in message, message
        assert path in message and "Nothing was loaded" in message and "(found by rank " in message, message
        assert unchanged


def test_truncated_data_file_of_a_sharded_folder_is_refused_naming_the_folder(tmp_path: Any) -> None:
    path = str(tmp_path / "ck")
    checkpoint.save_sharded(path, seeded_mlp(), None, {"step": 1})
    data_file = glob.glob(os.path.join(path, "*.distcp"))[0]
    with open(data_file, "r+b") as f:
        f.truncate(os.path.getsize(data_file) // 2)
    target = seeded_mlp(seed=1)
    before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(ValueError, match=f"checkpoint '{path}' cannot be read: rank 0 failed with .*the folder is "
                                         "damaged or holds another model: restore it from a backup"):
        checkpoint.load_sharded(path, target)
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))


def test_damaged_metadata_file_of_a_sharded_folder_is_refused(tmp_path: Any) -> None:
    path = str(tmp_path / "ck")
    checkpoint.save_sharded(path, seeded_mlp(), None, {"step": 1})
    meta_path = os.path.join(path, "shardopt_meta.pt")
    meta = torch.load(meta_path, weights_only=True)
    assert meta["format"] == "shardopt.sharded/3"
    meta["extra"]["step"] = 2  # a changed value under the old checksum
    torch.save(meta, meta_path)
    with pytest.raises(ValueError, match=f"checkpoint '{path}' is corrupted: shardopt_meta.pt fails its checksum"):
        checkpoint.load_sharded(path, seeded_mlp(seed=1))


def test_changed_hyperparameter_in_a_consolidated_file_fails_its_checksum(tmp_path: Any) -> None:
    path = str(tmp_path / "model.pt")
    module = seeded_mlp()
    checkpoint.save_consolidated(path, module, torch.optim.Adam(module.parameters(), lr=1e-2), {"step": 1})
    blob = torch.load(path, weights_only=True)
    assert blob["format"] == "shardopt.consolidated/3"
    blob["optimizer"]["param_groups"][0]["lr"] = 1.0  # a flipped bit in a pickled float
    torch.save(blob, path)
    target = seeded_mlp(seed=2)
    before = [p.detach().clone() for p in target.parameters()]
    with pytest.raises(ValueError, match=r"is corrupted: .*fail their checksum, first 'param_groups/0/lr'"):
        checkpoint.load_consolidated(path, target, torch.optim.Adam(target.parameters(), lr=1e-2))
    assert all(torch.equal(a, b) for a, b in zip(before, target.parameters()))


def test_older_formats_without_checksums_still_load(tmp_path: Any) -> None:
    path = str(tmp_path / "ck")
    module = seeded_mlp()
    checkpoint.save_sharded(path, module, None, {"step": 1})
    meta_path = os.path.join(path, "shardopt_meta.pt")
    meta = torch.load(meta_path, weights_only=True)
    for old in ("shardopt.sharded/1", "shardopt.sharded/2"):
        stripped = {k: v for k, v in meta.items() if k not in ("checksums", "meta_crc", "group_sizes")}
        torch.save({**stripped, "format": old}, meta_path)
        target = seeded_mlp(seed=4)
        assert checkpoint.load_sharded(path, target) == {"step": 1}
        assert all(torch.equal(a, b) for a, b in zip(target.parameters(), module.parameters()))
    file_path = str(tmp_path / "model.pt")
    checkpoint.save_consolidated(file_path, module, None, {"step": 1})
    blob = torch.load(file_path, weights_only=True)
    for old, keep in (("shardopt.consolidated/1", ()), ("shardopt.consolidated/2", ("model", "optimizer"))):
        sums = {k: v for k, v in blob["checksums"].items() if k in keep}
        torch.save({**blob, "format": old, "checksums": sums or None}, file_path)
        assert checkpoint.load_consolidated(file_path, seeded_mlp(seed=4)) == {"step": 1}


# ---------------------------------------------------------------------- validate before loading


def _oss_load_state_dict_errors(rank: int, world_size: int) -> list[tuple[str, bool]]:
    model = seeded_mlp()
    opt = _adam(model)
    _train(model, opt, rank, range(2))
    good = copy.deepcopy(opt.state_dict(all_ranks=True))
    wrong_shape = copy.deepcopy(good)
    wrong_shape["state"][2]["exp_avg"] = torch.zeros(3)
    wrong_shape["param_groups"][0]["lr"] = 99.0  # must not be applied either
    not_a_dict = copy.deepcopy(good)
    not_a_dict["state"][0] = torch.zeros(1)
    two_groups = copy.deepcopy(good)
    two_groups["param_groups"] = [{**good["param_groups"][0], "params": [0, 1, 2]},
                                  {**good["param_groups"][0], "params": [3, 4, 5]}]
    results = []
    for bad in (wrong_shape, not_a_dict, two_groups):
        before = copy.deepcopy(opt.state_dict(all_ranks=True))
        try:
            opt.load_state_dict(bad)
            message = "no error"
        except (ValueError, TypeError) as exc:
            message = f"{type(exc).__name__}: {exc}"
        try:
            _assert_same_state(copy.deepcopy(opt.state_dict(all_ranks=True)), before)
            unchanged = True
        except AssertionError:
            unchanged = False
        results.append((message, unchanged))
    return results


def test_oss_load_state_dict_refuses_state_that_does_not_fit_and_changes_nothing() -> None:
    for results in run_ranks(_oss_load_state_dict_errors, 2, timeout_s=60):
        (shape_message, shape_unchanged), (type_message, type_unchanged), (group_message, group_unchanged) = results
        assert ("state_dict['state'][2]['exp_avg'] has shape (3,) but parameter 2 has shape (32, 16)"
                in shape_message), shape_message
        assert "load a state dict saved from the same model" in shape_message, shape_message
        assert "TypeError: state_dict['state'][0] is a Tensor, not a dict of state values" in type_message, type_message
        assert "parameter groups of sizes [3, 3]" in group_message, group_message
        assert shape_unchanged and type_unchanged and group_unchanged


def _load_into(rank: int, world_size: int, path: str, variant: str) -> tuple[str, bool]:
    """Load the checkpoint into objects that do not fit it; report the error and whether
    anything changed."""
    model = seeded_mlp(seed=3, width=17 if variant == "wider" else 16)
    params = list(model.parameters())
    if variant == "regrouped":  # same count, other split: hyperparameters would land on the wrong group
        opt = OSS([{"params": params[:4]}, {"params": params[4:], "lr": 0.5}], optim=torch.optim.Adam, lr=1e-2)
    elif variant == "reordered":  # same groups, other order: state shapes do not fit the parameters
        opt = OSS(params[::-1], optim=torch.optim.Adam, lr=1e-2)
    else:
        opt = _adam(model)
    _train(model, opt, rank, range(1))
    return _failed_load(path, model, opt)


def _save_two_groups(rank: int, world_size: int, path: str) -> None:
    model = seeded_mlp()
    params = list(model.parameters())
    opt = OSS([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], optim=torch.optim.Adam, lr=1e-2)
    _train(model, opt, rank, range(2))
    checkpoint.save_sharded(path, model, opt)


def test_sharded_load_that_does_not_fit_names_the_mismatch_and_changes_nothing(tmp_path: Any) -> None:
    path = str(tmp_path / "ck")
    run_ranks(_save_adam, 2, path, timeout_s=60)
    expected = {
        "wider": "'0.weight' has shape (16, 8) in the checkpoint but (17, 8) in the model",
        "reordered": "optimizer state 'exp_avg' of parameter 0 has shape (16, 8) in the checkpoint but the "
                     "parameter has (4,)",
    }
    for variant, text in expected.items():
        for message, unchanged in run_ranks(_load_into, 2, path, variant, timeout_s=60):
            assert text in message and path in message and "Nothing was loaded" in message, (variant, message)
            assert unchanged, variant
    grouped = str(tmp_path / "grouped")
    run_ranks(_save_two_groups, 2, grouped, timeout_s=60)
    for message, unchanged in run_ranks(_load_into, 2, grouped, "regrouped", timeout_s=60):
        assert "optimizer groups of sizes [2, 4] but the optimizer has [4, 2]" in message, message
        assert unchanged


# ---------------------------------------------------------------------- temporary folders


def test_save_sharded_leaves_neighbouring_user_files_alone(tmp_path: Any) -> None:
    path = str(tmp_path / "ck")
    (tmp_path / "ck.tmp").mkdir()
    (tmp_path / "ck.tmp" / "mine.txt").write_text("the user's")
    (tmp_path / "ck.old").write_text("the user's too")
    for step in (1, 2):  # the second save replaces the first
        checkpoint.save_sharded(path, seeded_mlp(), None, {"step": step})
    assert (tmp_path / "ck.tmp" / "mine.txt").read_text() == "the user's"
    assert (tmp_path / "ck.old").read_text() == "the user's too"
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.old", "ck.tmp"]
    assert checkpoint.read_extra(path) == {"step": 2}


def test_failed_sharded_save_removes_its_staging_folder_and_keeps_the_previous_one(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "ck")
    checkpoint.save_sharded(path, seeded_mlp(), None, {"step": 1})
    real_save = checkpoint.dcp.save

    def write_then_fail(state: Any, checkpoint_id: str, **kwargs: Any) -> None:
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)  # files written, then the disk fills up
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.dcp, "save", write_then_fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_sharded(path, seeded_mlp(seed=1), None, {"step": 2})
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert checkpoint.load_sharded(path, seeded_mlp(seed=2)) == {"step": 1}


def test_staging_folder_left_by_a_killed_sharded_save_is_removed_by_the_next_save(tmp_path: Any) -> None:
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)  # rank 0 of the killed save
    stale = tmp_path / f".ck.shardopt-staging-{files.writer_tag()}-{gone}"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half a checkpoint")
    checkpoint.save_sharded(str(tmp_path / "ck"), seeded_mlp(), None, {"step": 1})
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_save_killed_between_its_renames_leaves_the_previous_checkpoint_findable(tmp_path: Any) -> None:
    path = str(tmp_path / "ck")
    checkpoint.save_sharded(path, seeded_mlp(), None, {"step": 1})
    old = str(tmp_path / ".ck.shardopt-old")
    os.replace(path, old)  # where a kill between the two renames leaves it
    with pytest.raises(FileNotFoundError, match=f"a save was killed while replacing it and the previous checkpoint "
                                                f"is in '{old}'; rename that folder to '{path}'"):
        checkpoint.load_sharded(path, seeded_mlp())
    checkpoint.save_sharded(path, seeded_mlp(), None, {"step": 2})
    assert sorted(os.listdir(tmp_path)) == ["ck"] and checkpoint.read_extra(path) == {"step": 2}


def test_check_writable_names_a_file_in_the_middle_of_the_path(tmp_path: Any) -> None:
    (tmp_path / "notes.txt").write_text("x")
    for sharded in (True, False):
        with pytest.raises(ValueError, match=r"notes.txt' is a file, not a folder: the checkpoint cannot be "
                                             r"created under it; pick another path"):
            checkpoint.check_writable(str(tmp_path / "notes.txt" / "ck"), sharded=sharded)
    checkpoint.check_writable(str(tmp_path / "notes.txt"), sharded=False)  # an existing file is replaced
