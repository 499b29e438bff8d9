"""Hugging Face ``Trainer`` with shardopt: ZeRO-1, ZeRO-2 or ZeRO-3.

:class:`ShardedTrainer` is ``transformers.Trainer`` plus :class:`ShardedTrainerMixin`;
mix the mixin into another ``Trainer`` subclass the same way (``class
MyTrainer(ShardedTrainerMixin, SFTTrainer)``). Choose the stage with
:class:`Sharding`::

    trainer = ShardedTrainer(model=model, args=args, train_dataset=ds, sharding=Sharding(stage=2))

What changes against a plain ``Trainer`` (everything else is the Trainer's own):

* the optimizer the Trainer builds (or the one passed in ``optimizers=``) is rebuilt as
  :class:`~shardopt.optim.OSS` (stages 1, 2) and the scheduler rebound; for stage 3 the
  model is wrapped in :class:`~shardopt.nn.FullyShardedDataParallel` first and the plain
  optimizer is built on its sharded parameters;
* stage 1 keeps Accelerate's DDP; stages 2 and 3 hand Accelerate their own wrapper (for
  autocast only), so it is not wrapped in DDP on top. Accumulation then runs under the
  wrapper's ``no_sync`` (Accelerate calls it);
* ``Sharding(offload="cpu")`` (stages 1, 2) keeps the OSS's masters, their gradients and the
  optimizer state in host memory and steps there (Note [offload in the integrations] in
  :mod:`shardopt.integrations.offload`); with ``oss_kwargs={"delay_update_after": k}`` the update
  is delayed, and written before the model is saved or evaluated and when ``train()`` ends (Note
  [delayed update in the integrations] there);
* ``max_grad_norm`` clips by the global norm and the logged ``grad_norm`` is the global
  one (Note [clipping sharded gradients] in :mod:`shardopt.integrations.lightning`);
* checkpoints hold the full model and a plain, consolidated optimizer state (stage 3: the
  full, name-keyed one), and ``resume_from_checkpoint`` loads them;
* unused dataset columns are dropped by the inner model's ``forward`` signature, not the
  wrapper's ``forward(*inputs, **kwargs)``;
* after ``train()`` the model is plain again (stage 3 gathers its full parameters).

Note [low-precision parameters with fp32 masters]
``TrainingArguments(bf16=True)`` keeps the Trainer's meaning here: autocast over the
model's parameters (fp32 parameters, 4 + 12/N bytes per parameter with AdamW at stage 2),
so a ShardedTrainer stays a drop-in ``Trainer`` and trains exactly like it. DeepSpeed's
bf16 (bf16 parameters, fp32 masters, 2 + 14/N) is ``Sharding(param_dtype=torch.bfloat16)``:
stages 1 and 2 cast the model to bf16 and build the OSS with ``master_dtype=torch.float32``
(the owner keeps the master, the moments and the fp32 gradient); stage 3 rounds the weights
to bf16 but keeps them fp32 and wraps with ``MixedPrecision(param_dtype=bf16,
reduce_dtype=bf16, buffer_dtype=bf16)``, so its fp32 flat shards are the masters. fp16
parameters also need ``fp16=True``: Accelerate's loss scaling, with a ShardedGradScaler that
unscales the masters' fp32 gradients. After ``train()`` the model holds the low-precision
weights. Tables: docs/integrations-precision.md.

Note [fp16 parameters without autocast]
Accelerate makes a loss scaler for ``fp16=True`` only on a GPU-like device (on a CPU it sets
neither autocast nor a scaler, silently). fp16 parameters need loss scaling wherever they
live, so with ``Sharding(param_dtype=torch.float16)`` and no scaler from Accelerate the mixin
installs a ShardedGradScaler itself: Accelerate's ``backward`` scales the loss with it and its
optimizer wrapper steps through it; clipping unscales through it directly, since
``accelerator.unscale_gradients`` does nothing without native AMP.

Note [Accelerate reads the optimizer's state dict]
``accelerator.prepare(optimizer)`` wraps it in an ``AcceleratedOptimizer`` that calls
``optimizer.state_dict()`` at once (to move the state to the device) and loads it back.
``OSS.state_dict()`` needs a consolidation first, a collective, so the mixin consolidates
on every rank right after building the optimizer; for a new optimizer that state is empty
and the exchange is a few bytes.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from shardopt.integrations.extras import raise_missing_extra

try:
    from transformers import Trainer
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
except ModuleNotFoundError as e:
    raise_missing_extra(e, __name__, "hf")

from shardopt.checkpoint import load_sharded
from shardopt.integrations.checkpoints import (
    CheckpointKind,
    load_trainer_checkpoint,
    parse_checkpoint_kind,
    save_trainer_checkpoint,
)
from shardopt.integrations.convert import rebind_scheduler, release, to_oss, wrap_units_first
from shardopt.integrations.offload import check_given_oss, refuse_zero3_offload, resolve_offload
from shardopt.nn import FullyShardedDataParallel, MixedPrecision, ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler
from shardopt.clipping import ClipArgs
from shardopt.optim.grad_norm import clip_params

__all__ = [
    "SHARDED_CHECKPOINT_DIR",
    "ShardedTrainer",
    "ShardedTrainerMixin",
    "Sharding",
    "clip_in_module_order",
    "init_from_model_weights",
]

SHARDED_CHECKPOINT_DIR = "shardopt_sharded"  # inside each checkpoint-N folder with checkpoint="sharded"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sharding:
    """Which ZeRO stage a :class:`ShardedTrainer` trains with, and its wrappers' options.

    Attributes:
        stage: 1 (DDP + OSS), 2 (ShardedDataParallel + OSS) or 3 (FullyShardedDataParallel).
        oss_kwargs: extra :class:`~shardopt.optim.OSS` arguments (stages 1, 2).
        wrapper_kwargs: extra ShardedDataParallel (stage 2) or FullyShardedDataParallel
            (stage 3) arguments, e.g. ``{"auto_wrap_policy": ModuleClassPolicy((Block,))}``.
        param_dtype: train with parameters in this dtype (``torch.bfloat16``,
            ``torch.float16``) and fp32 master weights on their owner, as DeepSpeed's bf16
            does (Note [low-precision parameters with fp32 masters]); ``None``: the
            model's own dtype. ``float16`` needs ``TrainingArguments(fp16=True)`` for loss
            scaling.
        master_dtype: the masters' dtype with ``param_dtype`` (default ``torch.float32``).
        checkpoint: ``"full"`` (checkpoints hold the full model and the plain optimizer
            state, gathered on rank 0) or ``"sharded"`` (every rank writes its part of a
            ``shardopt_sharded`` folder inside each checkpoint, loadable at any world size;
            ``shardopt convert`` turns it into ``model.safetensors``; Note [sharded trainer
            checkpoints] in :mod:`shardopt.integrations.checkpoints`).
        offload: ``"cpu"`` (stages 1, 2): the OSS keeps the masters (an fp32 parameter's exact
            copy), their gradients and the optimizer state in host memory and steps there, as
            DeepSpeed's ``offload_optimizer`` (Note [offload in the integrations] in
            :mod:`shardopt.integrations.offload`); ``None`` (default), or ``oss_kwargs["offload"]``.

    Raises:
        ValueError: ``stage`` is not 1, 2 or 3, wrapper options for stage 1, a
            ``param_dtype`` that is not bf16/fp16, ``master_dtype`` without it, another
            ``checkpoint``, an ``offload`` other than ``None``/``"cpu"`` (or one that disagrees
            with ``oss_kwargs``), or ``offload`` at stage 3.
    """

    stage: int = 2
    oss_kwargs: Mapping[str, Any] = field(default_factory=dict)
    wrapper_kwargs: Mapping[str, Any] = field(default_factory=dict)
    param_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None
    checkpoint: CheckpointKind | str = CheckpointKind.FULL
    offload: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "checkpoint", parse_checkpoint_kind(self.checkpoint, "Sharding"))
        if self.stage not in (1, 2, 3):
            raise ValueError(f"Sharding(stage={self.stage!r}): stage must be 1, 2 or 3")
        if self.stage == 3:
            refuse_zero3_offload(self.offload, "Sharding", "Sharding(stage=2, offload='cpu')", stage="stage=3, ")
        object.__setattr__(self, "offload", resolve_offload(self.offload, self.oss_kwargs, "Sharding"))
        if self.param_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"Sharding(param_dtype={self.param_dtype!r}): param_dtype must be torch.bfloat16, "
                             "torch.float16 or None (train in the model's own dtype)")
        if self.master_dtype is not None and self.param_dtype is None:
            raise ValueError(f"Sharding(master_dtype={self.master_dtype!r}) keeps masters of low-precision "
                             "parameters: also pass param_dtype=torch.bfloat16 (or torch.float16)")
        if self.param_dtype is not None and self.master_dtype is None:
            object.__setattr__(self, "master_dtype", torch.float32)
        if self.stage == 1 and self.wrapper_kwargs:
            raise ValueError("Sharding(stage=1) uses Accelerate's DDP; wrapper_kwargs are for stages 2 and 3")
        if self.stage == 3 and self.oss_kwargs:
            raise ValueError("Sharding(stage=3) shards with FullyShardedDataParallel; oss_kwargs are for stages 1, 2")

    def oss_options(self) -> dict[str, Any]:
        """The :class:`~shardopt.optim.OSS` arguments of stages 1 and 2: ``oss_kwargs`` with
        ``offload``, and ``master_dtype`` unless ``oss_kwargs`` holds one."""
        options = {**self.oss_kwargs, "offload": self.offload}
        if self.master_dtype is not None:
            options.setdefault("master_dtype", self.master_dtype)
        return options


def _inner_optimizer(optimizer: Any) -> Any:
    """The optimizer under Accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    while isinstance(getattr(optimizer, "optimizer", None), Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _innermost(module: nn.Module) -> nn.Module:
    """The model under any DDP, ShardedDataParallel or FullyShardedDataParallel wrappers."""
    while isinstance(module, (nn.parallel.DistributedDataParallel, ShardedDataParallel, FullyShardedDataParallel)):
        module = module.module
    return module


if TYPE_CHECKING:  # the mixin is checked as the Trainer it is mixed into
    _Base = Trainer
else:
    _Base = object


class ShardedTrainerMixin(_Base):
    """Train a ``transformers.Trainer`` with ZeRO-1/2/3 (see the module docstring).

    Args:
        *args: the ``Trainer``'s arguments.
        sharding: the stage and wrapper options (default: ``Sharding(stage=2)``).
        **kwargs: the ``Trainer``'s keyword arguments.

    Raises:
        ValueError: the ``TrainingArguments`` ask for DeepSpeed or Accelerate's FSDP too.
    """

    def __init__(self, *args: Any, sharding: Sharding | None = None, **kwargs: Any) -> None:
        self.sharding = sharding or Sharding()
        self._root: FullyShardedDataParallel | None = None
        self._wrapper: nn.Module | None = None
        self._shapes: dict[str, torch.Size] = {}
        self._gathered: dict[str, Any] | None = None
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, nn.Module) and self.sharding.param_dtype is not None:
            _to_low_precision(model, self.sharding.param_dtype, keep_fp32=self.sharding.stage == 3)
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "ShardedTrainer shards with shardopt; remove deepspeed=/fsdp= from TrainingArguments "
                "(choose the stage with sharding=Sharding(stage=...))"
            )
        if self.sharding.checkpoint is CheckpointKind.SHARDED and self.args.save_only_model:
            raise ValueError("Sharding(checkpoint='sharded') writes the weights with the optimizer's shards; "
                             "save_only_model=True would write neither: use checkpoint='full' with it")
        if self.sharding.param_dtype == torch.float16 and not self.args.fp16:
            raise ValueError("Sharding(param_dtype=torch.float16) needs loss scaling: pass "
                             "TrainingArguments(fp16=True) (or use param_dtype=torch.bfloat16)")

    # ------------------------------------------------------------------ setup
    def create_accelerator_and_postprocess(self) -> None:
        """Accelerate's setup, with its fp16 ``GradScaler`` replaced by a ShardedGradScaler
        (an inf/nan in one rank's shard makes every rank skip the step)."""
        super().create_accelerator_and_postprocess()
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is None and self.sharding.param_dtype == torch.float16:  # Note [fp16 parameters without autocast]
            self.accelerator.scaler = ShardedGradScaler(device=self.args.device.type)
        elif scaler is not None and not isinstance(scaler, ShardedGradScaler):
            self.accelerator.scaler = ShardedGradScaler(
                init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
                backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(),
                enabled=scaler.is_enabled(), device=self.args.device.type,
            )

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """The Trainer's placement, skipped at stage 3 while the model is on the meta
        device: each unit is materialised on its device when it is wrapped (Note [HF ZeRO-3
        from the meta device])."""
        if self.sharding.stage == 3 and _has_meta(model):
            return
        super()._move_model_to_device(model, device)  # type: ignore[misc]

    def _plain_model(self) -> nn.Module:
        assert self.model is not None, "the Trainer was built without a model"
        return self.model

    def _fsdp_root(self) -> FullyShardedDataParallel:
        if self._root is None:
            options = dict(self.sharding.wrapper_kwargs)
            low = self.sharding.param_dtype
            if low is not None:  # Note [low-precision parameters with fp32 masters]
                options.setdefault("mixed_precision", MixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low))
            model = self._plain_model()
            self._shapes = {name: p.shape for name, p in model.named_parameters()}
            if _has_meta(model):  # Note [HF ZeRO-3 from the meta device]
                options.setdefault("param_init_fn", init_from_model_weights(model, self.args.device))
                options = wrap_units_first(model, options)
            self._root = FullyShardedDataParallel(model, **options)
        return self._root

    def _oss(self) -> OSS:
        optimizer = _inner_optimizer(self.optimizer)
        assert isinstance(optimizer, OSS), f"stage {self.sharding.stage} builds an OSS, found {type(optimizer)}"
        return optimizer

    def _finish_update(self) -> None:
        """Write a delayed update into the parameters before they are read (a collective; nothing pending: nothing)."""
        optimizer = _inner_optimizer(self.optimizer)
        if isinstance(optimizer, OSS):
            optimizer.finish_update()

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate``, at parameters holding every update (:meth:`_finish_update`)."""
        self._finish_update()
        return super().evaluate(*args, **kwargs)  # type: ignore[no-any-return]

    def create_optimizer(self, model: nn.Module | None = None) -> Optimizer:
        """The Trainer's optimizer, sharded.

        Stages 1 and 2 rebuild it as OSS (rebinding a scheduler passed in ``optimizers=``)
        and consolidate its state on every rank (Note [Accelerate reads the optimizer's
        state dict]). Stage 3 wraps the model first, so the optimizer is built on the
        sharded parameters (their names, which decide weight decay, are unchanged).

        Raises:
            TypeError: stage 3 was given an OSS.
            ValueError: the optimizer cannot be sharded (see ``to_oss``), or an OSS passed in
                ``optimizers=`` lacks ``Sharding.offload``.
        """
        if self.sharding.stage == 3:
            self._fsdp_root()
            optimizer = super().create_optimizer(self.model)
            if isinstance(_inner_optimizer(optimizer), OSS):
                raise TypeError("Sharding(stage=3) shards the optimizer state itself; pass a plain torch.optim "
                                "optimizer, not an OSS")
            return optimizer
        optimizer = _inner_optimizer(super().create_optimizer(model))
        if not isinstance(optimizer, OSS):
            oss = to_oss(optimizer, **self.sharding.oss_options())
            if self.lr_scheduler is not None:
                rebind_scheduler(self.lr_scheduler, optimizer, oss)
            self.optimizer = optimizer = oss
        check_given_oss(optimizer, self.sharding.offload, "Sharding")  # one passed in optimizers= is kept
        optimizer.consolidate_state_dict(recipient_rank=-1)  # Note [Accelerate reads the optimizer's state dict]
        return optimizer

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """Stage 2/3: the ShardedDataParallel / FullyShardedDataParallel wrapper, prepared by
        Accelerate for autocast only (no DDP on top). Stage 1: the Trainer's (DDP)."""
        if self._wrapper is not None:
            return self._wrapper
        if self.sharding.stage == 1 or not training:
            return super()._wrap_model(model, training, dataloader)
        if self.sharding.stage == 3:
            wrapper: nn.Module = self._fsdp_root()
        else:
            wrapper = ShardedDataParallel(self._plain_model(), self._oss(), **self.sharding.wrapper_kwargs)
        self._wrapper = self.accelerator.prepare_model(wrapper, device_placement=False, evaluation_mode=True)
        return self._wrapper

    def _set_signature_columns_if_needed(self) -> None:
        """Keep the dataset columns the inner model's ``forward`` takes (and the labels)."""
        inner = _innermost(self._plain_model())
        if self._signature_columns is None and inner is not self.model:
            columns = [*inspect.signature(inner.forward).parameters, *{"label", "label_ids", *self.label_names}]
            self._signature_columns = columns  # type: ignore[assignment]
        super()._set_signature_columns_if_needed()

    # ------------------------------------------------------------------ clipping
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Clip by the global norm of the full gradients; returns it (what is logged).

        Stage 1 holds full gradients after DDP, so the Trainer's own clipping is right,
        unless fp32 masters hold the owners' gradients.
        """
        if self.sharding.stage == 1 and self.sharding.master_dtype is None:
            return super()._clip_grad_norm(model)
        return self._global_norm(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The global gradient norm (computed without clipping when none was clipped)."""
        if (self.sharding.stage == 1 and self.sharding.master_dtype is None) or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm)
        return self._global_norm(float("inf"))

    def _global_norm(self, max_norm: float) -> torch.Tensor:
        scaler = self.accelerator.scaler
        if scaler is not None and not self.accelerator.native_amp:  # Note [fp16 parameters without autocast]
            scaler.unscale_(_inner_optimizer(self.optimizer))
        else:
            self.accelerator.unscale_gradients()  # fp16: clip the true gradients (no-op otherwise)
        if self._root is not None:
            return self._root.clip_grad_norm_(max_norm)
        return clip_in_module_order(self._oss(), list(self._plain_model().parameters()), max_norm)

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """Stage 3: write the full state dict :meth:`save_model` gathered on every rank."""
        if self._root is not None and state_dict is None:
            state_dict = self._gathered if self._gathered is not None else self._root.state_dict(rank0_only=True)
        super()._save(output_dir, state_dict=state_dict)

    def _sharded_target(self) -> tuple[nn.Module, Optimizer, dict[str, torch.Size]]:
        if self._root is not None:
            return self._root, _inner_optimizer(self.optimizer), dict(self._shapes)
        plain = self._plain_model()
        return plain, self._oss(), {name: p.shape for name, p in plain.named_parameters()}

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; with ``checkpoint="sharded"`` a checkpoint's weights are
        written with the optimizer's shards instead (only the model's config here), so no
        rank gathers the full model."""
        self._finish_update()  # the model as the optimizer state will be saved (Note [delayed update in the integrations])
        if self._root is not None and (self.sharding.checkpoint is not CheckpointKind.SHARDED or not _internal_call):
            # The gather is a collective: every rank runs it here, since transformers < 5.23
            # calls _save on the writing rank only (5.23 on every rank).
            self._gathered = self._root.state_dict(rank0_only=True)
            try:
                super().save_model(output_dir, _internal_call)
            finally:
                self._gathered = None
            return
        if self.sharding.checkpoint is not CheckpointKind.SHARDED or not _internal_call:
            super().save_model(output_dir, _internal_call)
            return
        config = getattr(self._plain_model(), "config", None)
        if self.args.should_save and output_dir is not None and config is not None:
            os.makedirs(output_dir, exist_ok=True)
            config.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Write a plain optimizer state: OSS consolidated on rank 0; stage 3 the full,
        name-keyed state (``FullyShardedDataParallel.full_optim_state_dict``). Sharded:
        every rank writes its part of ``SHARDED_CHECKPOINT_DIR`` (weights included)."""
        if self.sharding.checkpoint is CheckpointKind.SHARDED:
            model, optimizer, shapes = self._sharded_target()
            save_trainer_checkpoint(os.path.join(output_dir, SHARDED_CHECKPOINT_DIR), model, optimizer, {}, shapes)
            if self.args.should_save and self.lr_scheduler is not None:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            return
        if self._root is None:
            self._oss().consolidate_state_dict(recipient_rank=0)
            super()._save_optimizer_and_scheduler(output_dir)
            return
        full = FullyShardedDataParallel.full_optim_state_dict(self._root, _inner_optimizer(self.optimizer))
        super()._save_optimizer_and_scheduler(output_dir)  # the scheduler (and this rank's shard, replaced next)
        if self.args.should_save:
            torch.save(full, os.path.join(output_dir, OPTIMIZER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Stage 3: reshard the full optimizer state onto this rank's slices. Sharded: load
        the weights and the optimizer from the folder (at any world size)."""
        if checkpoint is not None and os.path.isdir(os.path.join(checkpoint, SHARDED_CHECKPOINT_DIR)):
            model, optimizer, _ = self._sharded_target()
            load_trainer_checkpoint(os.path.join(checkpoint, SHARDED_CHECKPOINT_DIR), model, optimizer)
            assert self.lr_scheduler is not None, "the Trainer builds its scheduler before loading a checkpoint"
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
            return
        if self._root is None or checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        optimizer = _inner_optimizer(self.optimizer)
        full = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
        optimizer.load_state_dict(FullyShardedDataParallel.shard_full_optim_state_dict(full, self._root, optimizer))
        assert self.lr_scheduler is not None, "the Trainer builds its scheduler before loading a checkpoint"
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Stage 3 after training: load the full weights through ``summon_full_params``. A
        sharded checkpoint's weights are loaded with its optimizer state instead."""
        if os.path.isdir(os.path.join(resume_from_checkpoint, SHARDED_CHECKPOINT_DIR)):
            return
        if self._root is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        with self._root.summon_full_params(writeback=True):
            super()._load_from_checkpoint(resume_from_checkpoint, self.model)

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: load the best checkpoint's weights into the sharded
        model (a collective). transformers has no public hook for this step (it runs inside
        ``train()``, before ``on_train_end`` and before the model is plain again), so it is
        overridden like ``_load_from_checkpoint``: stage 3 loads through
        ``summon_full_params``; a sharded checkpoint loads with ``load_sharded`` (weights
        only; OSS masters then follow the loaded weights)."""
        best = self.state.best_model_checkpoint
        assert best is not None, "the Trainer loads the best model only once it has one"
        folder = os.path.join(best, SHARDED_CHECKPOINT_DIR)
        if os.path.isdir(folder):
            load_sharded(folder, self._sharded_target()[0], None)
        elif self._root is None:
            super()._load_best_model()
        else:
            with self._root.summon_full_params(writeback=True):
                super()._load_best_model()

    # ------------------------------------------------------------------ teardown
    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; afterwards the model is plain (stage 3: full parameters, in new
        ``nn.Parameter`` objects; the optimizer and scheduler are rebuilt by the next
        ``train()``). A collective; after an exception the model stays wrapped."""
        result = super().train(*args, **kwargs)
        self._finish_update()
        self._unwrap()
        return result

    def _unwrap(self) -> None:
        if isinstance(self._wrapper, ShardedDataParallel):
            self._wrapper.close()
        if self._root is not None:
            plain = release(self._root)
            if self.sharding.param_dtype is not None:  # Note [low-precision parameters with fp32 masters]
                plain.to(dtype=self.sharding.param_dtype)
            self.optimizer, self.lr_scheduler = None, None
        self._root = self._wrapper = None
        self.model_wrapped = self._plain_model()


def _has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def init_from_model_weights(model: nn.Module, device: torch.device | str) -> Callable[[nn.Module], None]:
    """A ``param_init_fn`` that materialises a Hugging Face model's meta tensors with the
    model's own initialiser, one FullyShardedDataParallel unit at a time.

    Args:
        model: the ``PreTrainedModel`` (built on the meta device) whose ``_init_weights``
            initialises each submodule (GPT-2's ``Conv1D`` and scaled ``c_proj`` included).
        device: where the unit's tensors are allocated.

    Returns:
        ``fn(unit)``: gives every submodule of ``unit`` that holds a meta tensor real
        storage (``to_empty``, that submodule only) and then calls
        ``model._init_weights`` on each submodule whose subtree held one, children before
        parents (``nn.Module.apply``'s order, which ``PreTrainedModel.init_weights`` uses,
        so a parent's override such as GPT-2's scaled ``c_proj`` wins). Units already
        wrapped are left alone.

    Raises:
        TypeError: ``model`` has no ``_init_weights`` (not a ``PreTrainedModel``); pass your
            own ``param_init_fn`` in ``Sharding(wrapper_kwargs=...)``.

    Note [HF ZeRO-3 from the meta device]
    ``Sharding(stage=3)`` accepts a model built under ``torch.device("meta")``: the Trainer
    does not place it (``_move_model_to_device`` is skipped while meta tensors remain), and
    the units the ``auto_wrap_policy`` selects are wrapped innermost first
    (``wrap_units_first``), each materialised by this function, flattened and sharded before
    the next; the root then materialises what is left (embeddings, final norm). A rank so
    holds one unit in full at a time plus its shards. GPT-2's ``Conv1D`` has no
    ``reset_parameters()``, so FullyShardedDataParallel's default (``to_empty`` +
    ``reset_parameters``) would refuse it; the model's ``_init_weights`` knows it. The
    weights follow the same distributions as an eager build but not the same random draws
    (the order of draws differs), and every rank draws the same ones (the Trainer seeds
    every rank alike; FullyShardedDataParallel checks the ranks agree). Non-persistent
    buffers are initialised only as far as ``_init_weights`` does (transformers 5 does
    rotary ``inv_freq``). After ``train()`` the model is gathered in full (the plain-model
    contract of ``ShardedTrainer``).
    """
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        raise TypeError(f"init_from_model_weights(model={type(model).__name__}): the model has no _init_weights "
                        "(not a transformers PreTrainedModel); pass param_init_fn=fn in Sharding(wrapper_kwargs=...)")

    def own_meta(sub: nn.Module) -> bool:
        return any(t is not None and t.is_meta for t in [*sub._parameters.values(), *sub._buffers.values()])

    def visit(sub: nn.Module) -> bool:
        if isinstance(sub, FullyShardedDataParallel):
            return False
        touched = [visit(child) for child in sub.children()]
        if own_meta(sub):
            sub.to_empty(device=device, recurse=False)
            touched.append(True)
        if any(touched):
            init(sub)
        return any(touched)

    def param_init_fn(unit: nn.Module) -> None:
        with torch.no_grad():
            visit(unit)

    return param_init_fn


def _to_low_precision(model: nn.Module, dtype: torch.dtype, keep_fp32: bool) -> None:
    """Cast ``model``'s floating parameters and buffers to ``dtype``, or (``keep_fp32``,
    stage 3) round them to ``dtype`` in place and keep their dtype."""
    if not keep_fp32:
        model.to(dtype=dtype)
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point() and not tensor.is_meta:
                tensor.copy_(tensor.to(dtype))


def clip_in_module_order(oss: OSS, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``OSS.clip_grad_norm`` (L2) with the per-parameter norms combined in ``params``' order.

    The Trainer clips DDP's gradients with ``clip_grad_norm_(model.parameters())``, which
    stacks the per-tensor norms in module order. How it works: the sharded clip of
    :func:`shardopt.optim.grad_norm.clip_params` over the parameters ``oss`` holds, in
    ``params``' order (Note [sharded norm in torch's order] there): each owner takes the norm
    of each gradient it holds (with masters, the master's fp32 gradient, folded in first), one
    all-reduce gathers them, every rank takes the same norm and scales the gradients it owns.

    Args:
        oss: the optimizer over the parameters (decides who owns which gradient).
        params: the model's parameters in module order (each once).
        max_norm: the largest allowed total norm.

    Returns:
        The total norm before clipping.
    """
    held = {id(p) for p in oss.params}
    return clip_params([oss], [p for p in params if id(p) in held], ClipArgs(max_norm))


class ShardedTrainer(ShardedTrainerMixin, Trainer):
    """``transformers.Trainer`` training with shardopt's ZeRO-1/2/3; see
    :class:`ShardedTrainerMixin` and the module docstring."""
