"""ShardedTrainer with ``Sharding(checkpoint="sharded")`` on real ranks: resuming continues
exactly like the uninterrupted run at 2 ranks and like a resume from the full checkpoint at 3
ranks; ``shardopt convert`` turns the folder into ``model.safetensors`` that
``from_pretrained`` loads."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from transformers import GPT2LMHeadModel

from shardopt.app.cli import main as shardopt_main
from shardopt.integrations.transformers import (
    SHARDED_CHECKPOINT_DIR,
    ShardedTrainer,
    Sharding,
)
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff
from tests.test_integration_transformers import (
    STAGES,
    _args,
    _env,
    _gpt,
    _params,
    _Tokens,
    _train,
)

pytestmark = pytest.mark.distributed


def _sharding(stage: str, checkpoint: str) -> Sharding:
    base = STAGES[stage]
    return Sharding(stage=base.stage, wrapper_kwargs=base.wrapper_kwargs, checkpoint=checkpoint)


def _at_2(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _env(rank, world_size)
    out: dict[str, Any] = {}
    for stage in STAGES:
        for kind in ("full", "sharded"):
            folder = os.path.join(tmp, f"{stage}-{kind}")
            model, _ = _train(_sharding(stage, kind), folder, save_strategy="steps", save_steps=2)
            out[f"{stage}/{kind}"] = _params(model)
        folder = os.path.join(tmp, f"{stage}-sharded")
        out[f"{stage}/has_folder"] = os.path.isdir(os.path.join(folder, "checkpoint-2", SHARDED_CHECKPOINT_DIR))
        resumed, trainer = _train(_sharding(stage, "sharded"), folder, resume=os.path.join(folder, "checkpoint-2"))
        out[f"{stage}/resumed"] = max_abs_diff(_params(resumed), out[f"{stage}/sharded"])
        out[f"{stage}/steps"] = trainer.state.global_step
    return out


def _at_3(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _env(rank, world_size)
    out: dict[str, Any] = {}
    for stage in STAGES:
        runs = {}
        for kind in ("full", "sharded"):
            folder = os.path.join(tmp, f"{stage}-{kind}")
            model, trainer = _train(_sharding(stage, kind), os.path.join(tmp, f"{stage}-{kind}-at3"),
                                    resume=os.path.join(folder, "checkpoint-2"))
            runs[kind] = _params(model)
            out[f"{stage}/{kind}/steps"] = trainer.state.global_step
        out[stage] = max_abs_diff(runs["sharded"], runs["full"])
    return out


def test_sharded_trainer_checkpoints_resume_exactly_and_convert_for_from_pretrained() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        at_2 = run_ranks(_at_2, 2, tmp, timeout_s=300)
        at_3 = run_ranks(_at_3, 3, tmp, timeout_s=300)
        loaded = {}
        for stage in STAGES:
            checkpoint = os.path.join(tmp, f"{stage}-sharded", "checkpoint-4")
            assert not os.path.exists(os.path.join(checkpoint, "model.safetensors"))  # no gathered weights
            code = shardopt_main(["convert", os.path.join(checkpoint, SHARDED_CHECKPOINT_DIR),
                                  os.path.join(checkpoint, "model.safetensors")])
            assert code == 0
            loaded[stage] = _params(GPT2LMHeadModel.from_pretrained(checkpoint))
    for out in at_2:
        for stage in STAGES:
            assert out[f"{stage}/has_folder"], out
            assert max_abs_diff(out[f"{stage}/sharded"], out[f"{stage}/full"]) == 0.0, stage
            assert out[f"{stage}/resumed"] == 0.0 and out[f"{stage}/steps"] == 4, out
    for out in at_3:
        for stage in STAGES:
            assert out[f"{stage}/sharded/steps"] == out[f"{stage}/full/steps"] == 4, out
            assert out[stage] == 0.0, out
    for stage in STAGES:
        assert max_abs_diff(loaded[stage], at_2[0][f"{stage}/sharded"]) == 0.0, stage


def test_sharded_checkpoints_refuse_save_only_model_and_convert_refuses_a_file(tmp_path: Any,
                                                                                capsys: Any) -> None:
    with pytest.raises(ValueError, match="Sharding\\(checkpoint='everything'\\): checkpoint must be 'full'"):
        Sharding(checkpoint="everything")
    with pytest.raises(ValueError, match="save_only_model=True would write neither"):
        ShardedTrainer(model=_gpt(), args=_args(str(tmp_path), save_only_model=True),
                       sharding=Sharding(checkpoint="sharded"))
    not_a_folder = tmp_path / "weights.pt"
    torch.save({}, not_a_folder)
    with pytest.raises(SystemExit) as exit_info:
        shardopt_main(["convert", str(not_a_folder), str(tmp_path / "out.safetensors")])
    assert exit_info.value.code == 2
    assert "is not a folder; pass the folder a sharded save wrote" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        shardopt_main(["convert", str(tmp_path), str(tmp_path / "out.safetensors")])
    assert "no sharded checkpoint at" in capsys.readouterr().err


def _best(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _env(rank, world_size)
    out: dict[str, Any] = {}
    for stage in STAGES:
        for kind in ("full", "sharded"):
            folder = os.path.join(tmp, f"best-{stage}-{kind}")
            model = _gpt()
            args = _args(folder, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1,
                         load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
                         per_device_eval_batch_size=2)
            trainer = ShardedTrainer(model=model, args=args, train_dataset=_Tokens(), eval_dataset=_Tokens(8),
                                     sharding=_sharding(stage, kind))
            trainer.train()
            out[f"{stage}/{kind}"] = _params(model)
            out[f"{stage}/{kind}/best"] = trainer.state.best_model_checkpoint
    return out


def test_load_best_model_at_end_loads_the_best_checkpoint_at_every_stage() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (out, _) = run_ranks(_best, 2, tmp, timeout_s=300)
        best_weights = {stage: _params(GPT2LMHeadModel.from_pretrained(out[f"{stage}/full/best"]))
                        for stage in STAGES}
    for stage in STAGES:
        # greater_is_better=True on the eval loss, which falls: the best is the first checkpoint,
        # so loading it is visible (the final weights differ from it).
        assert out[f"{stage}/full/best"].endswith("checkpoint-1"), out
        assert max_abs_diff(out[f"{stage}/full"], best_weights[stage]) == 0.0, stage
        assert max_abs_diff(out[f"{stage}/sharded"], best_weights[stage]) == 0.0, stage
