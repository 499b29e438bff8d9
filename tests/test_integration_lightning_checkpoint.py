"""Lightning strategies with ``checkpoint="sharded"``: every rank writes its part of a folder
(no gather on rank 0); resuming continues exactly like the uninterrupted run at the same
world size, and at another world size (saved at 2 ranks, resumed at 3) exactly like a resume
from the full checkpoint; ``convert_sharded`` turns the folder into plain weights."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint

from shardopt.integrations.checkpoints import convert_sharded
from shardopt.integrations.lightning import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy
from shardopt.nn.fsdp import ModuleClassPolicy
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff
from tests.helpers.lightning import TinyRegressor

pytestmark = pytest.mark.distributed

MODES = ("zero1", "zero2", "zero3_units")


class Tiny(TinyRegressor):
    """The shared regressor, one AdamW group."""


def _strategy(mode: str, checkpoint: str) -> Any:
    if mode == "zero1":
        return ZeRO1Strategy(checkpoint=checkpoint)
    if mode == "zero2":
        return ZeRO2Strategy(checkpoint=checkpoint)
    return ZeRO3Strategy(checkpoint=checkpoint, fsdp_kwargs={"auto_wrap_policy": ModuleClassPolicy((nn.Linear,))})


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(48, 8, generator=gen), torch.randn(48, 4, generator=gen))


def _fit(mode: str, checkpoint: str, world_size: int, root: str, ckpt: str | None = None,
         save: bool = False) -> tuple[Tiny, Any]:
    model = Tiny()
    folder = os.path.join(root, f"{mode}-{checkpoint}")
    callbacks = [ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)] if save else []
    trainer = L.Trainer(
        accelerator="cpu", devices=world_size, strategy=_strategy(mode, checkpoint), max_epochs=2,
        accumulate_grad_batches=2, gradient_clip_val=0.05, callbacks=callbacks, logger=False,
        enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )
    trainer.fit(model, DataLoader(_data(), batch_size=4), ckpt_path=ckpt)
    return model, trainer


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _env(rank: int, world_size: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")


def _save_and_resume_at_2(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _env(rank, world_size)
    out: dict[str, Any] = {}
    for mode in MODES:
        full, _ = _fit(mode, "full", world_size, tmp, save=True)
        sharded, _ = _fit(mode, "sharded", world_size, tmp, save=True)
        out[f"{mode}/sharded_vs_full"] = max_abs_diff(_params(sharded), _params(full))
        resumed, trainer = _fit(mode, "sharded", world_size, tmp,
                                ckpt=os.path.join(tmp, f"{mode}-sharded", "epoch=0.ckpt"))
        out[f"{mode}/resumed"] = max_abs_diff(_params(resumed), _params(sharded))
        out[f"{mode}/steps"] = trainer.global_step
        out[f"{mode}/final"] = _params(sharded)
        out[f"{mode}/is_folder"] = os.path.isdir(os.path.join(tmp, f"{mode}-sharded", "epoch=1.ckpt"))
    return out


def _resume_at_3(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _env(rank, world_size)
    out: dict[str, Any] = {}
    for mode in MODES:
        from_full, _ = _fit(mode, "full", world_size, tmp, ckpt=os.path.join(tmp, f"{mode}-full", "epoch=0.ckpt"))
        from_sharded, trainer = _fit(mode, "sharded", world_size, tmp,
                                     ckpt=os.path.join(tmp, f"{mode}-sharded", "epoch=0.ckpt"))
        out[mode] = max_abs_diff(_params(from_sharded), _params(from_full))
        out[f"{mode}/steps"] = trainer.global_step
    return out


def test_sharded_checkpoint_resumes_exactly_at_the_same_and_at_another_world_size() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        at_2 = run_ranks(_save_and_resume_at_2, 2, tmp, timeout_s=300)
        at_3 = run_ranks(_resume_at_3, 3, tmp, timeout_s=300)
        converted = {}
        for mode in MODES:
            out = os.path.join(tmp, f"{mode}.pt")
            convert_sharded(os.path.join(tmp, f"{mode}-sharded", "epoch=1.ckpt"), out)
            converted[mode] = torch.load(out, weights_only=False)["state_dict"]
    for out in at_2:
        for mode in MODES:
            assert out[f"{mode}/is_folder"], out
            assert out[f"{mode}/sharded_vs_full"] == 0.0, out  # the checkpoint kind does not change training
            assert out[f"{mode}/resumed"] == 0.0 and out[f"{mode}/steps"] == 6, out
    for out in at_3:
        for mode in MODES:
            # 2 steps at 2 ranks (3 per epoch), then 16 rows per rank at 3 ranks: 2 steps.
            assert out[f"{mode}/steps"] == 5, out
            assert out[mode] == 0.0, out
    for mode in MODES:  # the converted folder holds the final weights, with their shapes
        plain = Tiny()
        plain.load_state_dict(converted[mode])
        assert max_abs_diff(_params(plain), at_2[0][f"{mode}/final"]) == 0.0, mode


def test_unknown_checkpoint_kind_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"ZeRO2Strategy\(checkpoint='dcp'\): checkpoint must be 'full'"):
        ZeRO2Strategy(checkpoint="dcp")
