"""Hugging Face Trainer with shardopt (ShardedTrainer, stages 1/2/3) on 2 real ranks against
the plain Trainer (Accelerate's DDP): same parameters and logged grad_norm with gradient
accumulation and clipping, bf16, checkpoint/resume, and dataset column filtering."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402

from shardopt.integrations.transformers import ShardedTrainer, Sharding  # noqa: E402
from shardopt.nn import FullyShardedDataParallel, ShardedDataParallel  # noqa: E402
from shardopt.nn.fsdp import ModuleClassPolicy  # noqa: E402
from shardopt.optim import OSS  # noqa: E402
from shardopt.testing import run_ranks  # noqa: E402
from tests.helpers.clip import NORM_RTOL, clip_with_fed_norm  # noqa: E402
from tests.helpers.data import max_abs_diff  # noqa: E402

pytestmark = pytest.mark.distributed

CLIP = 0.05


def _gpt() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed random token rows with a column the model does not take: a string, which the
    default collator cannot batch, so training fails unless the column is dropped."""

    def __init__(self, rows: int = 32) -> None:
        self.ids = torch.randint(0, 64, (rows, 8), generator=torch.Generator().manual_seed(3))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i], "source": f"row {i}"}


def _args(out: str, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = dict(
        output_dir=out, use_cpu=True, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=4, learning_rate=1e-2, weight_decay=0.1, warmup_steps=1, max_grad_norm=CLIP,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


class _FedNormTrainer(Trainer):
    """The plain (DDP) Trainer clipping by given total norms, one per optimizer step
    (Note [fed clip norms] in tests/helpers/clip.py)."""

    def __init__(self, *args: Any, fed_norms: list[float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fed_norms = iter(fed_norms)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_with_fed_norm(model.parameters(), self.args.max_grad_norm, next(self._fed_norms))


def _train(sharding: Sharding | None, out: str, resume: str | None = None, fed_norms: list[float] | None = None,
           **kw: Any) -> tuple[nn.Module, Any]:
    model = _gpt()
    args = _args(out, **kw)
    if fed_norms is not None:
        trainer: Trainer = _FedNormTrainer(model=model, args=args, train_dataset=_Tokens(), fed_norms=fed_norms)
    elif sharding is None:
        trainer = Trainer(model=model, args=args, train_dataset=_Tokens())
    else:
        trainer = ShardedTrainer(model=model, args=args, train_dataset=_Tokens(), sharding=sharding)
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _norms(trainer: Any) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


STAGES = {
    "zero1": Sharding(stage=1),
    "zero2": Sharding(stage=2),
    "zero3": Sharding(stage=3, wrapper_kwargs={"auto_wrap_policy": ModuleClassPolicy((GPT2Block,))}),
}


def _env(rank: int, world_size: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    warnings.filterwarnings("ignore")


def _parity(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _env(rank, world_size)
    out: dict[str, Any] = {}
    runs = [("fp32", CLIP, STAGES), ("bf16", CLIP, STAGES), ("noclip", 0.0, {"zero3": STAGES["zero3"]})]
    for name, clip, stages in runs:
        kw = {"bf16": name == "bf16", "max_grad_norm": clip}
        ref, ref_trainer = _train(None, os.path.join(tmp, "ddp"), **kw)
        out[f"{name}/norms"] = _norms(ref_trainer)
        for stage, sharding in stages.items():
            model, trainer = _train(sharding, os.path.join(tmp, stage), **kw)
            key = f"{name}/{stage}"
            out[key] = max_abs_diff(_params(model), _params(ref))
            out[f"{key}/norm"] = max(abs(a - b) / b for a, b in zip(_norms(trainer), _norms(ref_trainer), strict=True))
            if stage == "zero3" and clip:  # Note [fed clip norms]
                fed, _ = _train(None, os.path.join(tmp, "ddp-fed"), fed_norms=_norms(trainer), **kw)
                out[f"{key}/fed"] = max_abs_diff(_params(model), _params(fed))
            out[f"{key}/plain"] = (
                trainer.model_wrapped is model
                and not any(isinstance(m, (ShardedDataParallel, FullyShardedDataParallel)) for m in model.modules())
                and model.lm_head.weight is model.transformer.wte.weight  # still tied
            )
            out[f"{key}/columns"] = trainer._signature_columns
    return out


def test_sharded_trainer_trains_like_the_ddp_trainer_and_logs_the_global_grad_norm() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_parity, 2, tmp, timeout_s=240)
    for out in results:
        assert min(out["fp32/norms"]) > 5 * CLIP, out  # clipping is active every step
        for key in [k for k in out if k.endswith("/plain")]:
            assert out[key], (key, out)
            columns = out[key.replace("/plain", "/columns")]
            assert "input_ids" in columns and "labels" in columns and "source" not in columns
        for precision in ("fp32", "bf16"):
            for stage in ("zero1", "zero2"):
                assert out[f"{precision}/{stage}"] == 0.0 and out[f"{precision}/{stage}/norm"] == 0.0, out
            # ZeRO-3's clip norm may differ from torch's in its last bits, and a flipped bit can
            # move a later bf16 rounding (Note [fed clip norms]): compare with DDP clipping by
            # ZeRO-3's own norms, bit for bit, and bound the norms by their summation error.
            assert out[f"{precision}/zero3/fed"] == 0.0, out
            assert out[f"{precision}/zero3/norm"] <= NORM_RTOL, out
        assert out["noclip/zero3"] == 0.0, out  # exact without clipping
        assert out["noclip/zero3/norm"] <= NORM_RTOL, out


def _resume(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _env(rank, world_size)
    out: dict[str, Any] = {}
    for stage in ("zero1", "zero2", "zero3"):
        folder = os.path.join(tmp, stage)
        full, _ = _train(STAGES[stage], folder, save_strategy="steps", save_steps=2)
        resumed, trainer = _train(STAGES[stage], folder, resume=os.path.join(folder, "checkpoint-2"))
        out[stage] = max_abs_diff(_params(resumed), _params(full))
        out[f"{stage}/steps"] = trainer.state.global_step
        # The checkpoint holds the full model, loadable by transformers alone.
        plain = GPT2LMHeadModel.from_pretrained(os.path.join(folder, "checkpoint-4"))
        out[f"{stage}/from_pretrained"] = max_abs_diff(_params(plain), _params(full))
    return out


def test_checkpoint_resume_continues_like_the_uninterrupted_run() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_resume, 2, tmp, timeout_s=240)
    for out in results:
        for stage in ("zero1", "zero2", "zero3"):
            assert out[f"{stage}/steps"] == 4, out
            assert out[stage] == 0.0 and out[f"{stage}/from_pretrained"] == 0.0, out


def test_sharding_config_refuses_options_of_another_stage() -> None:
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        Sharding(stage=4)
    with pytest.raises(ValueError, match=r"Sharding\(stage=1\) uses Accelerate's DDP"):
        Sharding(stage=1, wrapper_kwargs={"reduce_buffer_size": 0})
    with pytest.raises(ValueError, match=r"Sharding\(stage=3\) shards with FullyShardedDataParallel"):
        Sharding(stage=3, oss_kwargs={"broadcast_fp16": True})


def _plain_trainer_with_oss(rank: int, world_size: int, tmp: str) -> str:
    _env(rank, world_size)
    model = _gpt()
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    trainer = Trainer(model=model, args=_args(tmp, max_steps=1), train_dataset=_Tokens(), optimizers=(optimizer, None))
    try:
        trainer.train()
    except RuntimeError as e:
        return str(e)
    return ""


def test_oss_in_a_plain_trainer_is_refused_with_a_message_naming_sharded_trainer() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_plain_trainer_with_oss, 2, tmp, timeout_s=120)
    for rank, message in enumerate(results):
        # Accelerate's prepare (inside train()) round-trips the optimizer's state dict.
        assert message.startswith(f"[rank {rank}] OSS.state_dict() has no consolidated state "), message
        assert "it was called by a plain transformers.Trainer" in message, message
        assert "use shardopt.integrations.transformers.ShardedTrainer" in message, message
