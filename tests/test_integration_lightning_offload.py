"""Lightning ``ZeRO1Strategy``/``ZeRO2Strategy(offload="cpu")`` on 2 real ranks (Note [offload in
the integrations] in shardopt.integrations.offload): fp32 training with accumulation, clipping
and an LR schedule ends bit for bit where the same run without offload ends (parameters and
every training step's loss), and so does ``"bf16-true"`` (fp32 masters on the host); the OSS
really is offloaded; a checkpoint (full and sharded) saved with offload resumes without it, and
the reverse, exactly. ZeRO-3 and bad values are refused with the fix.

Why exact: on a CPU an offloaded OSS runs the same kernels on the same values
(tests/test_offload.py)."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from shardopt.integrations.lightning import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy  # noqa: E402
from shardopt.nn import ShardedDataParallel  # noqa: E402
from shardopt.optim import OSS  # noqa: E402
from shardopt.testing import run_ranks  # noqa: E402
from tests.helpers.data import max_abs_diff  # noqa: E402
from tests.helpers.lightning import TinyRegressor  # noqa: E402

pytestmark = pytest.mark.distributed

MODES = ("zero1", "zero2")
EPOCHS = 2  # 3 optimizer steps per epoch: the resumed runs start at step 3


class Tiny(TinyRegressor):
    """The shared regressor with two AdamW groups; keeps every training step's loss and, at
    each optimizer step, whether every master this rank steps is a host tensor apart from its
    parameter (``None`` would mean no master: fp32 without offload)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []
        self.offloaded: list[bool] = []

    def param_groups(self) -> Any:
        return [{"params": self.net[0].parameters(), "lr": 2e-2}, {"params": self.net[2:].parameters()}]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        opt = self.trainer.optimizers[0]
        held = [(p, opt.master_of(p)) for p in opt.params if opt.grad_holder(p) is not None]
        self.offloaded.append(opt.offload == "cpu" and bool(held) and all(
            m is not None and m is not p and m.device.type == "cpu" and m.dtype == torch.float32 for p, m in held))


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(48, 8, generator=gen), torch.randn(48, 4, generator=gen))


def _fit(mode: str, offload: str | None, kind: str, root: str, precision: str = "32-true",
         ckpt: str | None = None, save: bool = False) -> Tiny:
    model = Tiny()
    cls = ZeRO1Strategy if mode == "zero1" else ZeRO2Strategy
    folder = os.path.join(root, f"{mode}-{offload}-{kind}-{precision}")
    callbacks = [ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)] if save else []
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=cls(offload=offload, checkpoint=kind), max_epochs=EPOCHS,
        precision=precision, accumulate_grad_batches=2, gradient_clip_val=0.05, callbacks=callbacks, logger=False,
        enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )
    trainer.fit(model, DataLoader(_data(), batch_size=4), ckpt_path=ckpt)
    return model


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _offload_runs(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    out: dict[str, Any] = {}
    for mode in MODES:
        for kind in ("full", "sharded"):
            runs = {offload: _fit(mode, offload, kind, tmp, save=True) for offload in (None, "cpu")}
            plain, offloaded = runs[None], runs["cpu"]
            key = f"{mode}/{kind}"
            out[f"{key}/params"] = max_abs_diff(_params(offloaded), _params(plain))
            out[f"{key}/losses"] = max_abs_diff(offloaded.losses, plain.losses)
            out[f"{key}/steps"] = (len(plain.losses), len(offloaded.offloaded))
            out[f"{key}/offloaded"] = offloaded.offloaded
            out[f"{key}/plain_offloaded"] = plain.offloaded
            for saved, resumed in ((None, "cpu"), ("cpu", None)):  # across offload, both ways
                ckpt = os.path.join(tmp, f"{mode}-{saved}-{kind}-32-true", "epoch=0.ckpt")
                again = _fit(mode, resumed, kind, os.path.join(tmp, "resumed"), ckpt=ckpt)
                at = f"{key}/saved-{saved}-resumed-{resumed}"
                out[f"{at}/params"] = max_abs_diff(_params(again), _params(plain))
                out[f"{at}/losses"] = max_abs_diff(again.losses, plain.losses[len(plain.losses) // EPOCHS:])
        bf16 = {offload: _fit(mode, offload, "full", tmp, precision="bf16-true") for offload in (None, "cpu")}
        out[f"{mode}/bf16/params"] = max_abs_diff(_params(bf16["cpu"]), _params(bf16[None]))
        out[f"{mode}/bf16/losses"] = max_abs_diff(bf16["cpu"].losses, bf16[None].losses)
        out[f"{mode}/bf16/offloaded"] = bf16["cpu"].offloaded
    return out


def test_offloaded_zero1_zero2_train_and_resume_bit_for_bit_like_without_offload() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_offload_runs, 2, tmp, timeout_s=300)
    for out in results:
        for mode in MODES:
            for kind in ("full", "sharded"):
                key = f"{mode}/{kind}"
                assert out[f"{key}/steps"] == (12, 6), out  # 2 epochs x 6 micro-batches, 3 steps each
                assert out[f"{key}/offloaded"] == [True] * 6, (key, out[f"{key}/offloaded"])
                assert not any(out[f"{key}/plain_offloaded"]), key  # the check sees the difference
                assert out[f"{key}/params"] == 0.0 and out[f"{key}/losses"] == 0.0, (key, out)
                for saved, resumed in ((None, "cpu"), ("cpu", None)):
                    at = f"{key}/saved-{saved}-resumed-{resumed}"
                    assert out[f"{at}/params"] == 0.0 and out[f"{at}/losses"] == 0.0, (at, out)
            assert out[f"{mode}/bf16/offloaded"] == [True] * 6, out
            assert out[f"{mode}/bf16/params"] == 0.0 and out[f"{mode}/bf16/losses"] == 0.0, out


def test_offload_options_are_checked_when_the_strategy_is_built() -> None:
    assert ZeRO2Strategy(oss_kwargs={"offload": "cpu"}).offload == "cpu"  # the same option, spelled as an OSS one
    assert ZeRO1Strategy(offload="cpu", oss_kwargs={"offload": "cpu"}).offload == "cpu"
    assert ZeRO1Strategy().offload is None
    ZeRO3Strategy(offload=None)  # the default: nothing to refuse
    with pytest.raises(ValueError, match=r"ZeRO3Strategy\(offload='cpu'\): ZeRO-3 offload is not available yet .*"
                                         r"use ZeRO2Strategy\(offload='cpu'\) to keep the optimizer state and masters "
                                         r"in host memory, or leave offload=None"):
        ZeRO3Strategy(offload="cpu")
    with pytest.raises(ValueError, match=r"ZeRO2Strategy\(offload='nvme'\): offload must be None or 'cpu', got "
                                         r"'nvme' \(NVMe offload is not implemented\); pass offload='cpu'"):
        ZeRO2Strategy(offload="nvme")
    with pytest.raises(ValueError, match=r"ZeRO1Strategy\(offload=True\): offload must be None or 'cpu', got True"):
        ZeRO1Strategy(offload=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ZeRO1Strategy\(oss_kwargs=\{'offload': 'gpu'\}\): offload must be None"):
        ZeRO1Strategy(oss_kwargs={"offload": "gpu"})
    with pytest.raises(ValueError, match=r"ZeRO2Strategy\(offload='cpu'\) disagrees with oss_kwargs=\{'offload': "
                                         r"None\}; pass offload once, as ZeRO2Strategy\(offload=...\)"):
        ZeRO2Strategy(offload="cpu", oss_kwargs={"offload": None})


class _ReturnsOSS(Tiny):
    def configure_optimizers(self) -> Any:
        return OSS(self.parameters(), optim=torch.optim.AdamW, lr=1e-2)


def _given_oss(rank: int, world_size: int, tmp: str) -> str:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZeRO2Strategy(offload="cpu"), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp)
    try:
        trainer.fit(_ReturnsOSS(), DataLoader(_data(), batch_size=4))
    except ValueError as e:
        return str(e)
    return ""


def test_an_oss_returned_without_the_strategys_offload_is_refused() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (message,) = run_ranks(_given_oss, 1, tmp)
    assert message.startswith("ZeRO2Strategy(offload='cpu') got an OSS built with offload=None, which is used as it "
                              "was built; build it with OSS(..., offload='cpu'), or hand over a plain torch.optim "
                              "optimizer"), message


# ---------------------------------------------------------------------- the delayed parameter update

DELAY = 2
"""``oss_kwargs={"delay_update_after": DELAY}``: steps 0 and 1 ordinary, the later ones delayed."""
SAVE_AFTER = 4
"""The plain run saves the weights alone after step 4 (delayed: its update pending), from a callback."""


class _Delayed(TinyRegressor):
    """The shared regressor (AdamW and a per-step LR schedule); keeps each training step's loss and what the
    OSS reports at the end of training."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []
        self.reported: tuple[Any, Any] | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_losses.append(super().training_step(batch, batch_idx).detach().clone())

    def on_train_end(self) -> None:
        opt = self.trainer.optimizers[0]
        self.reported = (type(opt).__name__, opt.delay_update_after)


class _SaveWeights(L.Callback):  # type: ignore[misc]
    """``trainer.save_checkpoint(path, weights_only=True)`` once step ``SAVE_AFTER`` is done: no optimizer
    state is consolidated, so only the strategy's own hook writes the pending update first."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == SAVE_AFTER + 1:
            trainer.save_checkpoint(self.path, weights_only=True)


def _rank_data(rank: int) -> DataLoader[Any]:
    """This rank's half of the data, unshuffled, in batches of 4 (given to Lightning as it is)."""
    return DataLoader(_data(), batch_size=4, sampler=DistributedSampler(_data(), 2, rank, shuffle=False))


def _fit_delayed(mode: str, kind: str, root: str, ckpt: str | None = None) -> _Delayed:
    """Two epochs of ``mode`` with ``offload="cpu"`` and the delay, with clipping; ``kind`` "full" or "sharded": one
    batch of validation, then a checkpoint, at each epoch's end; "plain": no validation, the weights alone after
    step ``SAVE_AFTER`` (``weights.ckpt``)."""
    model = _Delayed()
    cls = ZeRO1Strategy if mode == "zero1" else ZeRO2Strategy
    folder = os.path.join(root, f"delayed-{mode}-{kind}")
    callbacks = [_SaveWeights(os.path.join(folder, "weights.ckpt"))] if kind == "plain" else [
        ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1)]
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=EPOCHS, gradient_clip_val=0.05, logger=False, callbacks=callbacks,
        strategy=cls(offload="cpu", oss_kwargs={"delay_update_after": DELAY},
                     checkpoint="full" if kind == "plain" else kind),
        enable_checkpointing=kind != "plain", enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, use_distributed_sampler=False, limit_val_batches=1, num_sanity_val_steps=0,
    )
    data = _rank_data(int(os.environ["LOCAL_RANK"]))
    trainer.fit(model, data, None if kind == "plain" else data, ckpt_path=ckpt)
    return model


def _oss_reference(rank: int, mode: str, finish_after: set[int], validate: bool) -> dict[str, Any]:
    """The same training without Lightning: the seeded net under DDP (ZeRO-1) or ShardedDataParallel (ZeRO-2),
    OSS(AdamW, offload="cpu", delay_update_after=DELAY), clipping, the schedule, this rank's data; the pending
    update written (``finish_update()``, as a save does) after each step of ``finish_after`` and at the end;
    with ``validate``, the loss of the first batch at each epoch's end, after its update is written. The
    parameters at the end and after each step of ``finish_after``, every step's loss and the validation losses."""
    net = TinyRegressor().net
    opt = OSS(net.parameters(), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1, offload="cpu",
              delay_update_after=DELAY)
    wrapped = DDP(net) if mode == "zero1" else ShardedDataParallel(net, opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    out: dict[str, Any] = {"losses": [], "val_losses": []}
    for _ in range(EPOCHS):
        for x, y in _rank_data(rank):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(wrapped(x).float(), y.float())
            out["losses"].append(loss.detach().clone())
            loss.backward()
            opt.clip_grad_norm(0.05)
            opt.step()
            sched.step()
            if len(out["losses"]) - 1 in finish_after:
                opt.finish_update()
                out[len(out["losses"]) - 1] = _params(net)
        if validate:
            opt.finish_update()
            x, y = next(iter(_rank_data(rank)))
            with torch.no_grad():
                out["val_losses"].append(torch.nn.functional.mse_loss(net(x).float(), y.float()))
    opt.finish_update()  # the end of training
    out["params"] = _params(net)
    if isinstance(wrapped, ShardedDataParallel):
        wrapped.close()
    return out


def _delay_runs(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    out: dict[str, Any] = {}
    steps = 12  # 2 epochs of 6 batches
    for mode in MODES:
        run = _fit_delayed(mode, "plain", tmp)
        ref = _oss_reference(rank, mode, {SAVE_AFTER}, validate=False)
        saved = torch.load(os.path.join(tmp, f"delayed-{mode}-plain", "weights.ckpt"), weights_only=True)["state_dict"]
        out[f"{mode}/plain/reported"] = run.reported
        out[f"{mode}/plain/params"] = max_abs_diff(_params(run), ref["params"])
        out[f"{mode}/plain/losses"] = max_abs_diff(run.losses, ref["losses"])
        out[f"{mode}/plain/saved weights"] = max_abs_diff(list(saved.values()), ref[SAVE_AFTER])
        ref = _oss_reference(rank, mode, set(), validate=True)  # validation, then a checkpoint, at each epoch's end
        for kind in ("full", "sharded"):
            run = _fit_delayed(mode, kind, tmp)
            key = f"{mode}/{kind}"
            out[f"{key}/reported"] = run.reported
            out[f"{key}/params"] = max_abs_diff(_params(run), ref["params"])
            out[f"{key}/losses"] = max_abs_diff(run.losses, ref["losses"])
            out[f"{key}/validation losses"] = max_abs_diff(run.val_losses, ref["val_losses"])
            ckpt = os.path.join(tmp, f"delayed-{mode}-{kind}", "epoch=0.ckpt")
            again = _fit_delayed(mode, kind, os.path.join(tmp, "resumed"), ckpt=ckpt)
            out[f"{key}/resumed/params"] = max_abs_diff(_params(again), ref["params"])
            out[f"{key}/resumed/losses"] = max_abs_diff(again.losses, ref["losses"][steps // EPOCHS:])
            out[f"{key}/resumed/validation losses"] = max_abs_diff(again.val_losses, ref["val_losses"][1:])
    return out


def test_delay_update_after_in_oss_kwargs_reaches_the_oss_and_zero1_zero2_train_save_and_resume_as_oss_does() -> None:
    """Lightning's ``"32-true"`` steps with a closure, which a delayed OSS refuses: the strategy runs it first. The
    end of training, validation and a checkpoint (weights alone too) write the pending update before reading the
    model."""
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_delay_runs, 2, tmp, timeout_s=300)
    for out in results:
        reported = {k: v for k, v in out.items() if k.endswith("/reported")}
        assert len(reported) == 6 and all(v == ("OSS", DELAY) for v in reported.values()), reported
        numbers = {k: v for k, v in out.items() if not k.endswith("/reported")}
        assert len(numbers) == 2 * (3 + 2 * 6), sorted(numbers)
        assert all(v == 0.0 for v in numbers.values()), numbers


def test_a_bad_delay_update_after_is_refused_when_the_strategy_is_built() -> None:
    assert ZeRO2Strategy(offload="cpu", oss_kwargs={"delay_update_after": 0}).offload == "cpu"
    with pytest.raises(ValueError, match=r"ZeRO2Strategy\(oss_kwargs=\{'delay_update_after': -1\}\): delay_update_after "
                                         r"must be >= 0 .*got -1; pass 0 to delay from the first step"):
        ZeRO2Strategy(offload="cpu", oss_kwargs={"delay_update_after": -1})
    with pytest.raises(TypeError, match=r"ZeRO1Strategy\(oss_kwargs=\{'delay_update_after': 1.5\}\): delay_update_after "
                                        r"must be an int .*got float 1.5"):
        ZeRO1Strategy(offload="cpu", oss_kwargs={"delay_update_after": 1.5})
    with pytest.raises(ValueError, match=r"ZeRO1Strategy\(oss_kwargs=\{'delay_update_after': 2\}\) needs offload='cpu'"
                                         r".*; pass ZeRO1Strategy\(offload='cpu', oss_kwargs=\{'delay_update_after': 2\}\), "
                                         r"or drop delay_update_after"):
        ZeRO1Strategy(oss_kwargs={"delay_update_after": 2})
