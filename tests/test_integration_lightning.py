"""Lightning strategies shardopt_zero1/2/3 on 2 real ranks against Lightning's own DDP:
same parameters with gradient accumulation, clipping, an LR scheduler, bf16/fp16 mixed
precision, and checkpoint/resume; the module is plain after fit."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardopt

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from shardopt.integrations.convert import rebind_scheduler, to_oss  # noqa: E402
from shardopt.integrations.lightning import ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy  # noqa: E402
from shardopt.nn import FullyShardedDataParallel, ShardedDataParallel  # noqa: E402
from shardopt.nn.fsdp import ModuleClassPolicy  # noqa: E402
from shardopt.optim import OSS  # noqa: E402
from shardopt.testing import run_ranks  # noqa: E402
from tests.helpers.clip import clip_with_fed_norm, norms_within, recorded_clip_norms  # noqa: E402
from tests.helpers.data import max_abs_diff  # noqa: E402

pytestmark = pytest.mark.distributed

CLIP = 0.05
BATCH, ACCUM = 4, 2
# Tiny's 820 gradient elements (measured on an AVX-512 Xeon, default and avx2 dispatch: 6.8e-8,
# one ulp, for ZeRO-1/2 with the 32 x 16 weight split; 0 for ZeRO-3).
NUMEL = 820


class Tiny(L.LightningModule):
    """An MLP regressor with AdamW + a step-wise LR schedule; records the largest
    pre-clipping gradient norm it saw (meaningful where gradients are not sharded)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.max_norm_seen = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x).float(), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        # per-parameter norms over every rank, under any strategy (a ZeRO-2 rank holds only its gradients)
        norms = list(shardopt.grad_norms(self).values())
        total = torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0
        self.max_norm_seen = max(self.max_norm_seen, total)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(
            [{"params": self.net[0].parameters(), "lr": 2e-2}, {"params": self.net[2:].parameters()}],
            lr=1e-2, weight_decay=0.1,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class FedNormTiny(Tiny):
    """Tiny clipping by given total norms, one per optimizer step (Note [fed clip norms] in
    tests/helpers/clip.py): the DDP reference for ZeRO-3 with clipping."""

    def __init__(self, fed_norms: list[torch.Tensor]) -> None:
        super().__init__()
        self.fed_norms = iter(fed_norms)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_with_fed_norm(params, gradient_clip_val, next(self.fed_norms))


class NormRecordingTiny(Tiny):
    """Tiny clipping as Lightning does under DDP, recording torch's total norm of each clip."""

    def __init__(self) -> None:
        super().__init__()
        self.clip_norms: list[torch.Tensor] = []

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        # the total torch.nn.utils.clip_grad_norm_ computes, before Lightning's own clip
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.clip_norms.append(torch.nn.utils.get_total_norm(grads).detach().clone())
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


def _data() -> TensorDataset:
    # 2 ranks x 6 batches of 4: 3 optimizer steps per epoch with ACCUM=2.
    gen = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(48, 8, generator=gen), torch.randn(48, 4, generator=gen))


def _strategy(mode: str) -> Any:
    if mode == "zero3_units":  # one unit per Linear, inside the root unit
        return ZeRO3Strategy(fsdp_kwargs={"auto_wrap_policy": ModuleClassPolicy((nn.Linear,))})
    if mode == "zero1_whole":  # no parameter split across ranks
        return ZeRO1Strategy(oss_kwargs={"split_large_params": False})
    return {"ddp": "ddp", "zero1": "shardopt_zero1", "zero2": "shardopt_zero2", "zero3": "shardopt_zero3"}[mode]


def _fit(mode: str, root: str, precision: Any = "32-true", epochs: int = 1, ckpt: str | None = None,
         save: bool = False, clip: float | None = CLIP,
         fed_norms: list[torch.Tensor] | None = None, record_norms: bool = False) -> tuple[Tiny, Any]:
    model = FedNormTiny(fed_norms) if fed_norms is not None else NormRecordingTiny() if record_norms else Tiny()
    callbacks = [ModelCheckpoint(dirpath=root, filename=f"{mode}-{{epoch}}", save_top_k=-1)] if save else []
    plugins = [precision] if not isinstance(precision, str) else None
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=_strategy(mode), max_epochs=epochs,
        precision=precision if isinstance(precision, str) else None, plugins=plugins,
        accumulate_grad_batches=ACCUM, gradient_clip_val=clip, callbacks=callbacks,
        logger=False, enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(model, DataLoader(_data(), batch_size=BATCH), ckpt_path=ckpt)
    return model, trainer


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _ranks_env(rank: int, world_size: int) -> None:
    """Let Lightning use the process group run_ranks made: processes launched externally."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")



def _fp32(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _ranks_env(rank, world_size)
    x = torch.randn(3, 8)
    out: dict[str, Any] = {}
    for clip in (CLIP, None):
        ref, _ = _fit("ddp", tmp, clip=clip, record_norms=clip is not None)
        out[f"{clip}/max_norm_seen"] = ref.max_norm_seen
        modes = ("zero1", "zero1_whole", "zero2", "zero3", "zero3_units") if clip else ("zero3", "zero3_units")
        for mode in modes:
            with recorded_clip_norms() as norms:
                model, trainer = _fit(mode, tmp, clip=clip)
            key = f"{clip}/{mode}"
            out[key] = max_abs_diff(_params(model), _params(ref))
            out[f"{key}/max_norm_seen"] = model.max_norm_seen
            if isinstance(trainer.optimizers[0], OSS):
                names = {p: n for n, p in model.named_parameters()}
                opt = trainer.optimizers[0]
                out[f"{key}/split"] = [names[opt.params[i]] for i in opt.plan.split_params]
            if clip:  # Note [fed clip norms]
                fed, _ = _fit("ddp", tmp, clip=clip, fed_norms=norms)
                out[f"{key}/fed"] = max_abs_diff(_params(model), _params(fed))
                assert isinstance(ref, NormRecordingTiny) and len(norms) == len(ref.clip_norms) == 3, (norms, ref)
                out[f"{key}/norms"] = [(float(a), float(b)) for a, b in zip(ref.clip_norms, norms, strict=True)]
            # After fit the module is plain: no wrapper, full parameters, callable.
            again = Tiny()
            again.load_state_dict(model.state_dict())
            out[f"{key}/plain"] = (
                trainer.strategy.model is model
                and not any(isinstance(m, (FullyShardedDataParallel, ShardedDataParallel)) for m in model.modules())
                and max_abs_diff([model(x)], [again(x)]) == 0.0
            )
            out[f"{key}/optimizer"] = type(trainer.optimizers[0]).__name__
            out[f"{key}/precision"] = type(trainer.strategy.precision_plugin).__name__
    return out


def test_zero1_zero2_zero3_train_like_ddp_with_accumulation_clipping_and_scheduler() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_fp32, 2, tmp, timeout_s=240)
    for out in results:
        assert out[f"{CLIP}/max_norm_seen"] > 5 * CLIP, out  # clipping is active every step
        for mode in ("zero1", "zero2", "zero3", "zero3_units"):  # shardopt.grad_norms under every strategy
            # split and ZeRO-3 rows are summed per block: (log2(512) + 1) * 2**-24 = 6e-7 relative for
            # the largest (32 x 16) weight (tests/test_grad_norms.py), and ZeRO-3's clip leaves the
            # parameters a few ulps from DDP's by the later steps: 1e-6 (measured 0 for ZeRO-1/2, 8.8e-8
            # for ZeRO-3, also under avx2)
            seen, want = out[f"{CLIP}/{mode}/max_norm_seen"], out[f"{CLIP}/max_norm_seen"]
            assert abs(seen - want) <= 1e-6 * want, (mode, seen, want)
        for key in [k for k in out if k.endswith("/plain")]:
            assert out[key], (key, out)
            assert out[key.replace("/plain", "/precision")] == "ShardedPrecision"
        assert out[f"{CLIP}/zero1/optimizer"] == out[f"{CLIP}/zero2/optimizer"] == "OSS"
        assert out[f"{CLIP}/zero3/optimizer"] == "AdamW"
        # Nothing split: ZeRO-1's clip norm is torch's bit for bit, and so are the parameters.
        assert out[f"{CLIP}/zero1_whole/split"] == [], out
        assert all(a == b for a, b in out[f"{CLIP}/zero1_whole/norms"]), out
        assert out[f"{CLIP}/zero1_whole"] == 0.0, out
        # By default the 32 x 16 weight is larger than a rank's share (410 of 820 elements) and is
        # split: its norm is the norm of its blocks' norms, so the clip norm, and with it every
        # parameter, may differ from DDP's in the last bits (measured here: one ulp of the first
        # step's norm, parameters 3e-8 apart; Note [fed clip norms] in tests/helpers/clip.py), as
        # ZeRO-3's norm summed from flat shards may. So every clipped run is compared bit for bit
        # with DDP clipping by that run's own norms (the rest of the arithmetic is the same), and
        # its norms with torch's within total_norm_rtol(NUMEL).
        assert out[f"{CLIP}/zero1/split"] == out[f"{CLIP}/zero2/split"] == ["net.2.weight"], out
        for mode in ("zero1", "zero1_whole", "zero2", "zero3", "zero3_units"):
            assert out[f"{CLIP}/{mode}/fed"] == 0.0, (mode, out)
            assert norms_within(out[f"{CLIP}/{mode}/norms"], NUMEL), (mode, out[f"{CLIP}/{mode}/norms"])
        # ZeRO-3 is exact without clipping, Lightning's zero_grad between forward and backward included.
        assert out["None/zero3"] == 0.0 and out["None/zero3_units"] == 0.0, out


def _mixed(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _ranks_env(rank, world_size)
    out: dict[str, Any] = {}
    # With clipping every mode is compared with DDP clipping by the mode's own norms: ZeRO-3's
    # clip norm, and ZeRO-1/2's with the 32 x 16 weight split, are not bitwise torch's, and
    # under autocast a one-ulp clip coefficient can flip a bf16 rounding (Note [fed clip norms]
    # in tests/helpers/clip.py). The norms are compared with torch's within total_norm_rtol(NUMEL).
    runs = {"bf16-mixed": {CLIP: ("zero1", "zero2", "zero3"), None: ("zero3",)},
            "16-mixed": {CLIP: ("zero2",), None: ("zero3",)}}
    for precision, by_clip in runs.items():
        for clip, modes in by_clip.items():
            ref, _ = _fit("ddp", tmp, precision=MixedPrecision(precision, "cpu"), clip=clip,  # type: ignore[arg-type]
                          record_norms=clip is not None)
            for mode in modes:
                with recorded_clip_norms() as norms:
                    model, trainer = _fit(mode, tmp, precision=MixedPrecision(precision, "cpu"), clip=clip)  # type: ignore[arg-type]
                key = f"{precision}/{mode}" + ("/clip" if clip else "")
                if clip:
                    ref_for_mode, _ = _fit("ddp", tmp, precision=MixedPrecision(precision, "cpu"), clip=clip,  # type: ignore[arg-type]
                                           fed_norms=norms)
                    assert isinstance(ref, NormRecordingTiny) and len(norms) == len(ref.clip_norms) == 3, (norms, ref)
                    out[f"{key}/norms"] = [(float(a), float(b)) for a, b in zip(ref.clip_norms, norms, strict=True)]
                else:
                    ref_for_mode = ref
                out[key] = max_abs_diff(_params(model), _params(ref_for_mode))
                plugin = trainer.strategy.precision_plugin
                out[f"{key}/plugin"] = type(plugin).__name__, type(plugin.scaler).__name__
    return out


def test_bf16_and_fp16_mixed_precision_train_like_ddp() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_mixed, 2, tmp, timeout_s=240)
    for out in results:
        assert out["bf16-mixed/zero2/clip/plugin"] == ("ShardedMixedPrecision", "NoneType"), out
        assert out["16-mixed/zero2/clip/plugin"] == out["16-mixed/zero3/plugin"] == (
            "ShardedMixedPrecision", "ShardedGradScaler"), out
        assert max(v for k, v in out.items() if not k.endswith(("/plugin", "/norms"))) == 0.0, out
        for key in [k for k in out if k.endswith("/norms")]:
            assert len(out[key]) == 3, (key, out[key])
            assert norms_within(out[key], NUMEL), (key, out[key])


def _resume(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _ranks_env(rank, world_size)
    out: dict[str, Any] = {}
    for mode in ("zero1", "zero2", "zero3_units"):
        full, _ = _fit(mode, tmp, epochs=2, save=True)
        resumed, trainer = _fit(mode, tmp, epochs=2, ckpt=os.path.join(tmp, f"{mode}-epoch=0.ckpt"))
        out[mode] = max_abs_diff(_params(resumed), _params(full))
        out[f"{mode}/steps"] = trainer.global_step
        # The checkpoint is plain: full weights, and for OSS a state dict torch's AdamW loads.
        ckpt = torch.load(os.path.join(tmp, f"{mode}-epoch=1.ckpt"), weights_only=False)
        plain = Tiny()
        plain.load_state_dict(ckpt["state_dict"])
        out[f"{mode}/plain_load"] = max_abs_diff(_params(plain), _params(full))
        if mode != "zero3_units":  # ZeRO-3's optimizer state is keyed by parameter name
            plain.configure_optimizers()["optimizer"].load_state_dict(ckpt["optimizer_states"][0])
    return out


def test_checkpoint_resume_continues_like_the_uninterrupted_run() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_resume, 2, tmp, timeout_s=240)
    for out in results:
        for mode in ("zero1", "zero2", "zero3_units"):
            assert out[f"{mode}/steps"] == 6, out
            assert out[mode] == 0.0, out
            assert out[f"{mode}/plain_load"] == 0.0, out


def test_unsupported_precision_and_arguments_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="supports precision '32-true', 'bf16-mixed', '16-mixed', 'bf16-true' and '16-true', got '64-true'"):
        L.Trainer(accelerator="cpu", devices=2, strategy="shardopt_zero2", precision="64-true")
    with pytest.raises(TypeError, match=r"unexpected arguments \['find_unused_parameters'\].*sdp_kwargs"):
        ZeRO2Strategy(find_unused_parameters=True)
    with pytest.raises(TypeError, match="clips the gradients of its OSS optimizers, got a SGD"):
        ZeRO2Strategy().clip_grad_norm(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), 1.0)


class _Slow(torch.optim.SGD):
    """An optimizer whose constructor needs an argument its defaults do not keep."""

    def __init__(self, params: Any, lr: float, slowdown: float) -> None:
        super().__init__(params, lr=lr * slowdown)


class _Halving(torch.optim.SGD):
    """An optimizer whose constructor changes a default it is given back."""

    def __init__(self, params: Any, lr: float = 0.1, **kwargs: Any) -> None:
        super().__init__(params, lr=lr / 2, **kwargs)


def _convert(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = nn.Linear(2, 2)

    def message(fn: Any) -> str:
        try:
            fn()
        except (TypeError, ValueError) as e:
            return str(e)
        return ""

    out["lbfgs"] = message(lambda: to_oss(torch.optim.LBFGS(model.parameters())))
    out["not_optimizer"] = message(lambda: to_oss(object()))  # type: ignore[arg-type]
    out["rebuild"] = message(lambda: to_oss(_Slow(model.parameters(), lr=0.1, slowdown=2.0)))
    out["defaults"] = message(lambda: to_oss(_Halving(model.parameters(), lr=0.2)))
    out["scheduler"] = message(lambda: rebind_scheduler(object(), model, model))  # type: ignore[arg-type]
    out["oss_kwargs"] = message(lambda: to_oss(torch.optim.SGD(model.parameters(), lr=0.1), offlaod="cpu"))
    # State carries over: a stepped Adam, converted, steps on exactly as the original.
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    adam.step()
    oss = to_oss(adam)
    expected = {k: v.clone() for k, v in adam.state[model.weight].items()}
    out["state"] = max_abs_diff(oss.state[model.weight].values(), expected.values())
    return out


def test_optimizers_that_cannot_be_sharded_are_refused_and_state_carries_over() -> None:
    (out,) = run_ranks(_convert, 1)
    assert "cannot shard a LBFGS with OSS: its line search" in out["lbfgs"]
    assert "expected a torch.optim.Optimizer to shard, got object" in out["not_optimizer"]
    assert "cannot rebuild _Slow as OSS(params, optim=_Slow, **defaults)" in out["rebuild"]
    assert "rebuilding _Halving changed its defaults ['lr']" in out["defaults"]
    assert "cannot rebind LR scheduler object" in out["scheduler"]
    # A misspelt OSS argument is named as such, not blamed on the optimizer's constructor.
    assert "oss_kwargs ['offlaod'] are not OSS arguments ('offlaod': did you mean 'offload'?)" in out["oss_kwargs"]
    assert out["state"] == 0.0


class _PartOptimized(Tiny):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net[0].parameters(), lr=0.1)


class _ReturnsOSS(Tiny):
    def configure_optimizers(self) -> Any:
        return OSS(self.parameters(), optim=torch.optim.SGD, lr=0.1)


def _zero3_errors(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    _ranks_env(rank, world_size)
    out: dict[str, str] = {}

    def fit(model: Tiny, clip: float | None) -> L.Trainer:
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy="shardopt_zero3", max_steps=1,
                            gradient_clip_val=clip, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp)
        trainer.fit(model, DataLoader(_data(), batch_size=BATCH))
        return trainer

    for key, model, clip in (("oss", _ReturnsOSS(), None), ("part", _PartOptimized(), 1.0)):
        try:
            fit(model, clip)
        except (TypeError, ValueError) as e:
            out[key] = str(e)
    trainer = fit(Tiny(), None)
    try:
        trainer.save_checkpoint(os.path.join(tmp, "after.ckpt"))
    except RuntimeError as e:
        out["after_fit"] = str(e)
    trainer.save_checkpoint(os.path.join(tmp, "weights.ckpt"), weights_only=True)
    try:
        trainer.strategy.clip_grad_norm(trainer.optimizers[0], 1.0)
    except RuntimeError as e:
        out["clip_after_fit"] = str(e)
    return out


def test_zero3_refuses_oss_partial_optimizers_with_clipping_and_optimizer_state_after_fit() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (out,) = run_ranks(_zero3_errors, 1, tmp)
    assert "'shardopt_zero3' shards the optimizer state itself; return a plain torch.optim" in out["oss"]
    assert "clips by the norm of the whole model, but this optimizer does not hold" in out["part"]
    assert "which teardown released after fit" in out["after_fit"]
    assert "clips the wrapped model's gradients, which exist only during fit" in out["clip_after_fit"]
