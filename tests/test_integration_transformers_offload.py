"""ShardedTrainer with ``Sharding(offload="cpu")`` on 2 real ranks (Note [offload in the
integrations] in shardopt.integrations.offload): stages 1 and 2 with accumulation, clipping
and warm-up, fp32 and bf16 parameters with fp32 masters, end bit for bit where the same run
without offload ends (parameters, logged losses and grad norms); the OSS really is offloaded;
a checkpoint (full and sharded) saved with offload resumes without it, and the reverse,
exactly. Bad values, stage 3 and an OSS passed in without offload are refused with the fix.

Why exact: on a CPU an offloaded OSS runs the same kernels on the same values
(tests/test_offload.py)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from transformers import TrainerCallback  # noqa: E402

from shardopt.integrations.transformers import ShardedTrainer, Sharding  # noqa: E402
from shardopt.optim import OSS  # noqa: E402
from shardopt.testing import run_ranks  # noqa: E402
from tests.helpers.data import max_abs_diff  # noqa: E402
from tests.test_integration_transformers import _args, _env, _gpt, _params, _Tokens  # noqa: E402

pytestmark = pytest.mark.distributed

STAGES = (1, 2)


class _Offloaded(TrainerCallback):  # type: ignore[misc]
    """At each optimizer step: whether the OSS is offloaded and every master this rank steps is
    a host tensor apart from its parameter (``None`` would mean no master: fp32 without offload)."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = kwargs["optimizer"].optimizer  # under Accelerate's AcceleratedOptimizer
        held = [(p, opt.master_of(p)) for p in opt.params if opt.grad_holder(p) is not None]
        self.seen.append(isinstance(opt, OSS) and opt.offload == "cpu" and bool(held) and all(
            m is not None and m is not p and m.device.type == "cpu" and m.dtype == torch.float32 for p, m in held))


def _train(sharding: Sharding, out: str, resume: str | None = None, **kw: Any) -> tuple[nn.Module, Any, list[bool]]:
    model = _gpt()
    seen = _Offloaded()
    trainer = ShardedTrainer(model=model, args=_args(out, **kw), train_dataset=_Tokens(), sharding=sharding,
                             callbacks=[seen])
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer, seen.seen


def _logged(trainer: Any, name: str) -> list[float]:
    return [h[name] for h in trainer.state.log_history if name in h]


def _offload_runs(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _env(rank, world_size)
    out: dict[str, Any] = {}
    for stage in STAGES:
        for kind in ("full", "sharded"):
            runs = {offload: _train(Sharding(stage=stage, checkpoint=kind, offload=offload),
                                    os.path.join(tmp, f"{stage}-{kind}-{offload}"), save_strategy="steps", save_steps=2)
                    for offload in (None, "cpu")}
            (plain, plain_trainer, plain_seen), (model, trainer, seen) = runs[None], runs["cpu"]
            key = f"{stage}/{kind}"
            out[f"{key}/params"] = max_abs_diff(_params(model), _params(plain))
            out[f"{key}/logged"] = [_logged(trainer, n) == _logged(plain_trainer, n) and len(_logged(plain_trainer, n))
                                    for n in ("loss", "grad_norm")]
            out[f"{key}/offloaded"], out[f"{key}/plain_offloaded"] = seen, plain_seen
            for saved, resumed in ((None, "cpu"), ("cpu", None)):  # across offload, both ways
                again, again_trainer, _ = _train(Sharding(stage=stage, checkpoint=kind, offload=resumed),
                                                 os.path.join(tmp, "resumed", f"{stage}-{kind}-{saved}"),
                                                 resume=os.path.join(tmp, f"{stage}-{kind}-{saved}", "checkpoint-2"))
                at = f"{key}/saved-{saved}-resumed-{resumed}"
                out[f"{at}/params"] = max_abs_diff(_params(again), _params(plain))
                out[f"{at}/losses"] = _logged(again_trainer, "loss") == _logged(plain_trainer, "loss")
        bf16 = {offload: _train(Sharding(stage=stage, param_dtype=torch.bfloat16, offload=offload),
                                os.path.join(tmp, f"bf16-{stage}-{offload}")) for offload in (None, "cpu")}
        out[f"{stage}/bf16/params"] = max_abs_diff(_params(bf16["cpu"][0]), _params(bf16[None][0]))
        out[f"{stage}/bf16/losses"] = _logged(bf16["cpu"][1], "loss") == _logged(bf16[None][1], "loss")
        out[f"{stage}/bf16/offloaded"] = bf16["cpu"][2]
    return out


def test_offloaded_stages_1_and_2_train_and_resume_bit_for_bit_like_without_offload() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_offload_runs, 2, tmp, timeout_s=400)
    for out in results:
        for stage in STAGES:
            for kind in ("full", "sharded"):
                key = f"{stage}/{kind}"
                assert out[f"{key}/offloaded"] == [True] * 4, (key, out[f"{key}/offloaded"])
                assert not any(out[f"{key}/plain_offloaded"]), key  # the check sees the difference
                assert out[f"{key}/params"] == 0.0 and out[f"{key}/logged"] == [4, 4], (key, out)
                for saved, resumed in ((None, "cpu"), ("cpu", None)):
                    at = f"{key}/saved-{saved}-resumed-{resumed}"
                    assert out[f"{at}/params"] == 0.0 and out[f"{at}/losses"], (at, out)
            assert out[f"{stage}/bf16/offloaded"] == [True] * 4, out
            assert out[f"{stage}/bf16/params"] == 0.0 and out[f"{stage}/bf16/losses"], out


def test_sharding_checks_offload_when_it_is_built() -> None:
    assert Sharding(oss_kwargs={"offload": "cpu"}).offload == "cpu"  # the same option, spelled as an OSS one
    assert Sharding(stage=1, offload="cpu").oss_options() == {"offload": "cpu"}
    assert Sharding(offload="cpu", param_dtype=torch.bfloat16).oss_options() == {
        "offload": "cpu", "master_dtype": torch.float32}
    assert Sharding(stage=3).offload is None
    with pytest.raises(ValueError, match=r"Sharding\(stage=3, offload='cpu'\): ZeRO-3 offload is not available yet "
                                         r".*use Sharding\(stage=2, offload='cpu'\) to keep the optimizer state and "
                                         r"masters in host memory, or leave offload=None"):
        Sharding(stage=3, offload="cpu")
    with pytest.raises(ValueError, match=r"Sharding\(offload='nvme'\): offload must be None or 'cpu', got 'nvme' "
                                         r"\(NVMe offload is not implemented\); pass offload='cpu'"):
        Sharding(offload="nvme")
    with pytest.raises(ValueError, match=r"Sharding\(oss_kwargs=\{'offload': True\}\): offload must be None or "
                                         r"'cpu', got True"):
        Sharding(oss_kwargs={"offload": True})
    with pytest.raises(ValueError, match=r"Sharding\(offload='cpu'\) disagrees with oss_kwargs=\{'offload': None\}; "
                                         r"pass offload once, as Sharding\(offload=...\)"):
        Sharding(offload="cpu", oss_kwargs={"offload": None})


def _given_oss(rank: int, world_size: int, tmp: str) -> str:
    _env(rank, world_size)
    model = _gpt()
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    trainer = ShardedTrainer(model=model, args=_args(tmp, max_steps=1), train_dataset=_Tokens(),
                             optimizers=(optimizer, None), sharding=Sharding(offload="cpu"))
    try:
        trainer.train()
    except ValueError as e:
        return str(e)
    return ""


def test_an_oss_passed_in_without_the_shardings_offload_is_refused() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (message,) = run_ranks(_given_oss, 1, tmp, timeout_s=120)
    assert message.startswith("Sharding(offload='cpu') got an OSS built with offload=None, which is used as it was "
                              "built; build it with OSS(..., offload='cpu'), or hand over a plain torch.optim "
                              "optimizer"), message


# ---------------------------------------------------------------------- the delayed parameter update

DELAY = 1
"""``oss_kwargs={"delay_update_after": DELAY}``: step 0 ordinary, steps 1-3 delayed."""


class _Pending(TrainerCallback):  # type: ignore[misc]
    """What the OSS reports at each optimizer step; at each evaluation whether an update was pending (the callback's
    own ``finish_update()`` then changes the parameters); the parameters when ``train()`` fires on_train_end."""

    def __init__(self) -> None:
        self.reported: list[Any] = []
        self.pending_at_evaluate: list[bool] = []
        self.at_train_end: list[torch.Tensor] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.reported.append(kwargs["optimizer"].optimizer.delay_update_after)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        before = _params(model)
        kwargs["optimizer"].optimizer.finish_update()  # every rank evaluates
        self.pending_at_evaluate.append(max_abs_diff(_params(model), before) != 0.0)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.at_train_end = _params(kwargs["model"])


def _delayed_train(sharding: Sharding, out: str, resume: str | None = None, **kw: Any) -> tuple[nn.Module, Any, _Pending]:
    model = _gpt()
    seen = _Pending()
    trainer = ShardedTrainer(model=model, args=_args(out, **kw), train_dataset=_Tokens(), eval_dataset=_Tokens(8),
                             sharding=sharding, callbacks=[seen])
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer, seen


def _delay_runs(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Per stage: a run evaluated after steps 3 and 4 (the Trainer evaluates at the end too), one neither evaluated
    nor saved; per checkpoint kind, a run saved every 2 steps and one resumed from its step-2 checkpoint."""
    _env(rank, world_size)
    out: dict[str, Any] = {}
    for stage in STAGES:
        def sharding(kind: str = "full", stage: int = stage) -> Sharding:
            return Sharding(stage=stage, checkpoint=kind, offload="cpu", oss_kwargs={"delay_update_after": DELAY})

        _, _, seen = _delayed_train(sharding(), os.path.join(tmp, f"eval-{stage}"), eval_strategy="steps", eval_steps=3)
        out[f"{stage}/reported"] = seen.reported
        out[f"{stage}/pending at evaluate"] = seen.pending_at_evaluate
        model, trainer, seen = _delayed_train(sharding(), os.path.join(tmp, f"plain-{stage}"))
        out[f"{stage}/train() wrote the last update"] = max_abs_diff(_params(model), seen.at_train_end) != 0.0
        before = _params(model)
        trainer.optimizer.optimizer.finish_update()
        out[f"{stage}/nothing pending after train()"] = max_abs_diff(_params(model), before) == 0.0
        for kind in ("full", "sharded"):
            folder = os.path.join(tmp, f"{stage}-{kind}")
            model, trainer, _ = _delayed_train(sharding(kind), folder, save_strategy="steps", save_steps=2)
            again, again_trainer, _ = _delayed_train(sharding(kind), os.path.join(tmp, "resumed", f"{stage}-{kind}"),
                                                     resume=os.path.join(folder, "checkpoint-2"))
            out[f"{stage}/{kind}/resumed params"] = max_abs_diff(_params(again), _params(model))
            out[f"{stage}/{kind}/resumed losses"] = _logged(again_trainer, "loss") == _logged(trainer, "loss")
    return out


def test_delay_update_after_reaches_the_oss_and_the_trainer_writes_it_before_evaluating_saving_and_at_the_end() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_delay_runs, 2, tmp, timeout_s=400)
    for out in results:
        for stage in STAGES:
            assert out[f"{stage}/reported"] == [DELAY] * 4, out
            assert out[f"{stage}/pending at evaluate"] == [False, False], out  # evaluate() wrote it first
            assert out[f"{stage}/train() wrote the last update"] and out[f"{stage}/nothing pending after train()"], out
            for kind in ("full", "sharded"):
                assert out[f"{stage}/{kind}/resumed params"] == 0.0, (stage, kind, out)
                assert out[f"{stage}/{kind}/resumed losses"], (stage, kind, out)


def test_sharding_checks_delay_update_after_when_it_is_built() -> None:
    assert Sharding(offload="cpu", oss_kwargs={"delay_update_after": 3}).oss_options() == {
        "delay_update_after": 3, "offload": "cpu"}
    with pytest.raises(ValueError, match=r"Sharding\(oss_kwargs=\{'delay_update_after': 2\}\) needs offload='cpu'.*"
                                         r"pass Sharding\(offload='cpu', oss_kwargs=\{'delay_update_after': 2\}\)"):
        Sharding(oss_kwargs={"delay_update_after": 2})
    with pytest.raises(TypeError, match=r"Sharding\(oss_kwargs=\{'delay_update_after': True\}\): delay_update_after "
                                        r"must be an int .*got bool True"):
        Sharding(offload="cpu", oss_kwargs={"delay_update_after": True})
