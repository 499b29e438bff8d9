"""A load that does not fit changes nothing, at every entry point (Note [checkpoint integrity]).

Each entry point gets a file of another model (same names, other shapes), and the
consolidated and ZeRO-3 paths also a file of a model with other names ("appears to be of another
model") and one holding a dtype the model cannot take (complex into float). Model
and optimizer must be bit-identical afterwards. Before, ``FullyShardedDataParallel.load_state_dict``
copied what fitted and raised afterwards, leaving a half-loaded model. Temporary files of a
killed save are removed by the next save or load in their folder and never read as a
checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from shardopt import checkpoint, files
from shardopt.nn import FullyShardedDataParallel as FSDP
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks)


def _other_names() -> nn.Module:
    torch.manual_seed(5)
    return nn.ModuleDict({"encoder": nn.Linear(8, 16), "head": nn.Linear(16, 4)})


def _complex_mlp() -> nn.Module:
    model = seeded_mlp()
    model[0].weight = nn.Parameter(model[0].weight.detach().to(torch.complex64))
    return model


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    for entry in opt.state.values():
        tensors += [v.detach().clone() for v in entry.values() if isinstance(v, torch.Tensor)]
    return tensors


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _attempt(model: nn.Module, opt: torch.optim.Optimizer, load: Callable[[], Any]) -> tuple[str, bool]:
    before = _snapshot(model, opt)
    try:
        load()
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    return message, _same(before, _snapshot(model, opt))


def _train_oss(rank: int) -> tuple[nn.Module, OSS]:
    model = seeded_mlp(seed=1)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
    model(rank_batch(rank, 0)).sum().backward()
    opt.step()
    return model, opt


def _train_fsdp(rank: int) -> tuple[FSDP, torch.optim.Optimizer]:
    model = FSDP(seeded_mlp(seed=1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(rank_batch(rank, 0)).sum().backward()
    opt.step()
    return model, opt


def _every_entry_point(rank: int, world_size: int, folder: str) -> dict[str, tuple[str, bool]]:
    wider = seeded_mlp(width=24)
    wider_opt = OSS(wider.parameters(), optim=torch.optim.Adam, lr=1e-2)
    wider(rank_batch(rank, 0)).sum().backward()
    wider_opt.step()
    checkpoint.save_consolidated(os.path.join(folder, "wider.pt"), wider, wider_opt)
    checkpoint.save_sharded(os.path.join(folder, "wider"), wider, wider_opt)
    wider_osd = wider_opt.state_dict(all_ranks=True)
    checkpoint.save_consolidated(os.path.join(folder, "other.pt"), _other_names(), None)
    checkpoint.save_consolidated(os.path.join(folder, "complex.pt"), _complex_mlp(), None)
    wide_fsdp = FSDP(seeded_mlp(width=24))
    wide_fsdp_opt = torch.optim.Adam(wide_fsdp.parameters(), lr=1e-2)
    checkpoint.save_sharded(os.path.join(folder, "wider_fsdp"), wide_fsdp, wide_fsdp_opt)
    wide_full = wide_fsdp.state_dict()
    other_full = _other_names().state_dict()
    complex_full = _complex_mlp().state_dict()

    out: dict[str, tuple[str, bool]] = {}
    model, opt = _train_oss(rank)
    out["load_consolidated"] = _attempt(model, opt, lambda: checkpoint.load_consolidated(
        os.path.join(folder, "wider.pt"), model, opt))
    out["load_consolidated, other model"] = _attempt(model, opt, lambda: checkpoint.load_consolidated(
        os.path.join(folder, "other.pt"), model, None))
    out["load_consolidated, complex"] = _attempt(model, opt, lambda: checkpoint.load_consolidated(
        os.path.join(folder, "complex.pt"), model, None))
    out["load_sharded"] = _attempt(model, opt, lambda: checkpoint.load_sharded(
        os.path.join(folder, "wider"), model, opt))
    out["OSS.load_state_dict"] = _attempt(model, opt, lambda: opt.load_state_dict(wider_osd))

    fsdp, fsdp_opt = _train_fsdp(rank)
    out["load_consolidated into FSDP"] = _attempt(fsdp, fsdp_opt, lambda: checkpoint.load_consolidated(
        os.path.join(folder, "wider.pt"), fsdp, None))
    out["load_sharded into FSDP"] = _attempt(fsdp, fsdp_opt, lambda: checkpoint.load_sharded(
        os.path.join(folder, "wider_fsdp"), fsdp, fsdp_opt))
    out["FSDP.load_state_dict"] = _attempt(fsdp, fsdp_opt, lambda: fsdp.load_state_dict(wide_full))
    out["FSDP.load_state_dict, other model"] = _attempt(fsdp, fsdp_opt, lambda: fsdp.load_state_dict(other_full))
    out["FSDP.load_state_dict, complex"] = _attempt(fsdp, fsdp_opt, lambda: fsdp.load_state_dict(complex_full))
    other_sharded = FSDP(seeded_mlp(seed=7)).sharded_state_dict()  # same layout, other values...
    other_sharded[list(other_sharded)[-1]] = torch.zeros(3)  # ...and one entry that does not fit
    out["FSDP.load_sharded_state_dict"] = _attempt(fsdp, fsdp_opt,
                                                   lambda: fsdp.load_sharded_state_dict(other_sharded))
    return out


EXPECTED = {
    "load_consolidated": "'0.weight' has shape (24, 8) in the checkpoint but (16, 8) in the model",
    "load_consolidated, other model": "appears to be of another model: none of its",
    "load_consolidated, complex": "'0.weight' is torch.complex64 in the checkpoint but torch.float32 in the model",
    "load_sharded": "'0.weight' has shape (24, 8) in the checkpoint but (16, 8) in the model",
    "OSS.load_state_dict": "shape",
    "load_consolidated into FSDP": "'0.weight' has shape (24, 8) in the checkpoint but (16, 8) in the model",
    "load_sharded into FSDP": "'0.weight' has shape (192,) in the checkpoint but (128,) in the model",  # flat
    "FSDP.load_state_dict": "'0.weight' has shape (24, 8) in the checkpoint but (16, 8) in the model",
    "FSDP.load_state_dict, other model": "appears to be of another model: none of its",
    "FSDP.load_state_dict, complex": "'0.weight' is torch.complex64 in the checkpoint but torch.float32",
    "FSDP.load_sharded_state_dict": "the sharded state dict does not fit this model (e.g. a piece of shape (3,)",
}


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_load_entry_point_refuses_a_mismatched_file_and_changes_nothing(tmp_path: Path,
                                                                               world_size: int) -> None:
    for results in run_ranks(_every_entry_point, world_size, str(tmp_path), timeout_s=120):
        assert set(results) == set(EXPECTED)
        for name, (message, unchanged) in results.items():
            assert EXPECTED[name] in message, (name, message)
            assert "Nothing was loaded" in message or name == "OSS.load_state_dict", (name, message)
            assert unchanged, (name, message)


def _save_then_load(rank: int, world_size: int, folder: str, kind: str) -> list[str]:
    model = seeded_mlp()
    path = os.path.join(folder, "ck.pt")
    checkpoint.save_consolidated(path, model, None)
    if kind == "save":
        checkpoint.save_consolidated(os.path.join(folder, "next.pt"), model, None)
    else:
        checkpoint.load_consolidated(path, model, None)
    return sorted(os.listdir(folder))


@pytest.mark.parametrize("kind", ["save", "load"])
def test_temp_file_of_a_killed_save_is_removed_by_the_next_save_or_load_in_its_folder(tmp_path: Path,
                                                                                     kind: str) -> None:
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)  # a pid that is surely gone: the save that wrote the file was killed
    stray = tmp_path / f".old.pt.tmp-{files.writer_tag()}-{dead}"
    stray.write_bytes(b"x" * 1024)
    live = tmp_path / f".busy.pt.tmp-{files.writer_tag()}-{os.getpid()}"  # a save still running: left alone
    live.write_bytes(b"y")
    listing = run_ranks(_save_then_load, 2, str(tmp_path), kind, timeout_s=60)[0]
    assert stray.name not in listing and live.name in listing, listing


def test_a_temp_file_is_never_read_as_a_checkpoint(tmp_path: Path) -> None:
    for name in (f".ck.pt.tmp-{files.writer_tag()}-{os.getpid()}", f".ck.pt.tmp-{os.getpid()}"):  # older names too
        path = tmp_path / name
        path.write_bytes(b"partial")
        with pytest.raises(ValueError, match="is the temporary file of an unfinished save, not a checkpoint"):
            checkpoint.load_consolidated(str(path), seeded_mlp(), None)
