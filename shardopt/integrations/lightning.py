"""Lightning strategies: ZeRO-1, ZeRO-2 and ZeRO-3 with shardopt.

Importing this module registers three names in Lightning's ``StrategyRegistry``:

==================  =====================================================  =====================
name                what it does                                           class
==================  =====================================================  =====================
``shardopt_zero1``  DDP + :class:`~shardopt.optim.OSS`                      :class:`ZeRO1Strategy`
``shardopt_zero2``  :class:`~shardopt.nn.ShardedDataParallel` + OSS         :class:`ZeRO2Strategy`
``shardopt_zero3``  :class:`~shardopt.nn.FullyShardedDataParallel`          :class:`ZeRO3Strategy`
==================  =====================================================  =====================

``configure_optimizers`` stays as it is (a plain ``torch.optim`` optimizer and its LR
schedulers): ZeRO-1/2 rebuild the optimizer as OSS and rebind the schedulers
(:mod:`shardopt.integrations.convert`); ZeRO-3 wraps the model first, so the optimizer is
built on the sharded parameters. Gradient accumulation uses the wrapper's ``no_sync``;
``gradient_clip_val`` with the norm algorithm clips by the global norm (Note [clipping
sharded gradients]); precision ``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"`` (with
:class:`~shardopt.optim.grad_scaler.ShardedGradScaler`), and ``"bf16-true"`` / ``"16-true"``
meaning what DeepSpeed users expect: low-precision parameters with fp32 master weights on
their owner (Note [true precision means fp32 masters]); ``offload="cpu"`` (ZeRO-1/2) keeps the
masters and optimizer state in host memory (Note [offload in the integrations]); checkpoints
hold plain, full state dicts; after ``fit`` the LightningModule is a plain module again.

Note [true precision means fp32 masters]
Lightning's ``"bf16-true"`` under DDP casts the module to bf16 and steps the optimizer on the
bf16 parameters (Adam's moments in bf16 too). DeepSpeed's bf16 keeps bf16 parameters and an
fp32 copy of each (the master) that the optimizer steps, so small updates are not rounded
away. With the shardopt strategies ``"bf16-true"``/``"16-true"`` mean DeepSpeed's: ZeRO-1/2
cast the module to the low dtype and build the OSS with ``master_dtype=torch.float32`` (the
owner of a parameter keeps its master, moments and fp32 gradient); ZeRO-3 rounds the module's
weights to the low dtype but keeps them fp32 and wraps with ``MixedPrecision(param_dtype=low,
reduce_dtype=low, buffer_dtype=low)``: the fp32 flat shards are the masters, units are gathered
and gradients reduced in the low dtype. ``"16-true"`` adds a ShardedGradScaler (fp16 gradients
overflow without loss scaling); unscaling runs on the fp32 master gradients. Bytes per
parameter are tabled in docs/integrations-precision.md. After ``fit`` the module holds the
low-precision weights (the masters are not kept: save a checkpoint to keep them).
The plugin runs Lightning's closure itself before ``optimizer.step()``: ``OSS.step(closure)``
with masters folds ``param.grad`` into the masters *before* the closure, so with gradient
accumulation under DDP the earlier micro-batches' local gradients would leave ``param.grad``
before the last backward's all-reduce sums them (measured: first-step updates of the wrong
sign, 4e-2 off at lr 2e-2).

Note [clipping sharded gradients]
Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters on
each rank. Under ZeRO-2 and ZeRO-3 a rank holds only its shard of the gradients, so every
rank would compute a different, too small norm and clip by it: silently wrong. The
strategies install precision plugins whose ``clip_grad_by_norm`` calls
``OSS.clip_grad_norm`` (ZeRO-1/2) or ``FullyShardedDataParallel.clip_grad_norm_`` (ZeRO-3),
which combine the ranks' parts into the norm of the full gradient. Clipping by value is
elementwise and stays Lightning's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Generator, Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from shardopt.integrations.extras import raise_missing_extra

try:
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
except ModuleNotFoundError as e:
    raise_missing_extra(e, __name__, "lightning")

from shardopt.integrations.checkpoints import (
    CheckpointKind,
    load_trainer_checkpoint,
    parse_checkpoint_kind,
    save_trainer_checkpoint,
)
from shardopt.integrations.convert import (
    rebind_scheduler,
    release,
    to_oss,
    wrap_units_first,
)
from shardopt.integrations.lightning_precision import (
    ShardedHalfPrecision,
    ShardedMixedPrecision,
    ShardedPrecision,
    sharded_scaler,
    unwrap_optimizer,
)
from shardopt.integrations.lightning_delay import FinishesDelayedUpdates
from shardopt.integrations.offload import check_given_oss, refuse_zero3_offload, resolve_offload
from shardopt.nn import FullyShardedDataParallel, ShardedDataParallel
from shardopt.nn import MixedPrecision as FSDPMixedPrecision
from shardopt.optim import OSS

__all__ = [
    "ShardedHalfPrecision", "ShardedMixedPrecision", "ShardedPrecision", "ZeRO1Strategy", "ZeRO2Strategy",
    "ZeRO3Strategy",
]

logger = logging.getLogger(__name__)

class _ShardedStrategy(DDPStrategy):
    """What the three strategies share: their precision plugins, ``no_sync`` for
    accumulation, full or sharded checkpoints and a plain module after teardown.
    Subclasses define how a model is wrapped and how gradients are clipped.

    Args:
        checkpoint: ``"full"`` (one file: the full model and the plain optimizer state,
            gathered on rank 0) or ``"sharded"`` (a folder every rank writes its part to,
            loadable at any world size; Note [sharded trainer checkpoints] in
            :mod:`shardopt.integrations.checkpoints`).
        **kwargs: Lightning ``DDPStrategy`` arguments.

    Raises:
        ValueError: ``checkpoint`` is neither.
    """

    def __init__(self, checkpoint: str = "full", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.checkpoint = parse_checkpoint_kind(checkpoint, type(self).__name__)

    strategy_name = ""
    keeps_fp32_module = False  # ZeRO-3: see Note [true precision means fp32 masters]

    @property
    def precision_plugin(self) -> Precision:
        """The precision plugin, converted to clip by the global norm (see module docstring)."""
        if self._precision_plugin is None:
            self._precision_plugin = self._sharded_precision(Precision())
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else self._sharded_precision(plugin)

    def _sharded_precision(self, plugin: Precision) -> Precision:
        if isinstance(plugin, (ShardedPrecision, ShardedMixedPrecision, ShardedHalfPrecision)):
            plugin.clip_norm = self.clip_grad_norm
            if isinstance(plugin, ShardedHalfPrecision):
                plugin.keep_fp32_module = self.keeps_fp32_module
            return plugin
        if type(plugin) is HalfPrecision:
            return ShardedHalfPrecision(plugin.precision, self.clip_grad_norm, keep_fp32_module=self.keeps_fp32_module)
        if type(plugin) is Precision:
            return ShardedPrecision(self.clip_grad_norm)
        if type(plugin) is MixedPrecision:
            scaler = None if plugin.scaler is None else sharded_scaler(plugin.scaler, plugin.device)
            return ShardedMixedPrecision(plugin.precision, plugin.device, self.clip_grad_norm, scaler)
        name = getattr(plugin, "precision", type(plugin).__name__)
        raise ValueError(
            f"strategy {self.strategy_name!r} supports precision '32-true', 'bf16-mixed', '16-mixed', 'bf16-true' "
            f"and '16-true', got "
            f"{name!r} ({type(plugin).__name__}); pass Trainer(precision=...) with one of those"
        )

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> torch.Tensor:
        """Clip every rank's gradients by the global norm (Note [clipping sharded gradients])."""
        raise NotImplementedError

    def _low_dtype(self) -> torch.dtype | None:
        """The parameters' dtype under ``"bf16-true"``/``"16-true"``, else ``None``."""
        plugin = self.precision_plugin
        return plugin.low_dtype if isinstance(plugin, ShardedHalfPrecision) else None

    def _wrapped(self) -> ShardedDataParallel | FullyShardedDataParallel | None:
        model = self.model
        return model if isinstance(model, (ShardedDataParallel, FullyShardedDataParallel)) else None

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally (the wrapper's ``no_sync``)."""
        wrapped = self._wrapped()
        context = wrapped.no_sync() if wrapped is not None else super().block_backward_sync()
        with context:
            yield None

    def _require_empty_ddp_kwargs(self, wrapper: str) -> None:
        # LightningCLI (jsonargparse) fills in every DDP argument the **kwargs reach, at its
        # default: those change nothing and are dropped; a value set by the user is refused.
        defaults = {name: p.default for name, p in inspect.signature(DistributedDataParallel.__init__).parameters.items()}
        set_by_user = {k: v for k, v in self._ddp_kwargs.items() if k not in defaults or v != defaults[k]}
        self._ddp_kwargs = set_by_user
        if set_by_user:
            raise TypeError(
                f"{type(self).__name__} got unexpected arguments {sorted(set_by_user)}: they would go to "
                f"DistributedDataParallel, which this strategy does not use; pass {wrapper} arguments as "
                f"{wrapper.lower()}_kwargs={{...}}"
            )


    # ------------------------------------------------------------------ sharded checkpoints
    def _sharded(self) -> bool:
        return self.checkpoint is CheckpointKind.SHARDED

    def _checkpoint_model(self) -> torch.nn.Module:
        """What ``save_sharded`` takes: the module under the OSS (ZeRO-3: the root)."""
        module = self.lightning_module
        assert module is not None, "checkpoints are saved and loaded while fitting, with a LightningModule"
        return module

    def _param_shapes(self) -> dict[str, torch.Size]:
        return {name: p.shape for name, p in self._checkpoint_model().named_parameters()}

    def _only_optimizer(self) -> Optimizer | None:
        optimizers = [unwrap_optimizer(o) for o in self.optimizers]
        if len(optimizers) > 1:
            raise ValueError(f"{self.strategy_name!r} with checkpoint='sharded' saves one optimizer, got "
                             f"{len(optimizers)}; return one optimizer from configure_optimizers or use "
                             "checkpoint='full'")
        return optimizers[0] if optimizers else None

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Sharded checkpoints load into the wrapped model and the built optimizer."""
        return self._sharded()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Full: rank 0 writes the file Lightning built. Sharded: every rank writes its
        part of the folder ``filepath`` (a collective), the trainer's state included."""
        if not self._sharded():
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_trainer_checkpoint(str(filepath), self._checkpoint_model(), self._only_optimizer(), state,
                                self._param_shapes())

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Sharded: load the folder into the model and the optimizer (at any world size; a
        collective) and hand Lightning the trainer's state."""
        if not self._sharded():
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = load_trainer_checkpoint(str(checkpoint_path), self._checkpoint_model(), self._only_optimizer())
        return {**state, "state_dict": {}, "optimizer_states": [{} for _ in self.optimizers]}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: nothing (``save_checkpoint`` writes the shards); full: Lightning's."""
        return {} if self._sharded() else super().lightning_module_state_dict()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Sharded: already loaded by :meth:`load_checkpoint`; full: Lightning's."""
        if not self._sharded():
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Sharded: already loaded by :meth:`load_checkpoint`; full: Lightning's."""
        if not self._sharded():
            super().load_optimizer_state_dict(checkpoint)


class _OSSStrategy(FinishesDelayedUpdates, _ShardedStrategy):
    """ZeRO-1/2: rebuild the optimizers of ``configure_optimizers`` as OSS (delayed updates: FinishesDelayedUpdates)."""

    def __init__(self, oss_kwargs: Mapping[str, Any] | None = None, offload: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.oss_kwargs = dict(oss_kwargs or {})
        self.offload = resolve_offload(offload, self.oss_kwargs, type(self).__name__)

    def setup_optimizers(self, trainer: Trainer) -> None:
        """Build the user's optimizers, rebuild each as OSS and rebind its LR schedulers.

        Raises:
            ValueError: an optimizer cannot be sharded (see :func:`~shardopt.integrations.convert.to_oss`), a
                scheduler cannot be rebound, or an OSS returned by ``configure_optimizers`` lacks the ``offload``.
        """
        super().setup_optimizers(trainer)
        converted = []
        for optimizer in self.optimizers:
            optimizer = unwrap_optimizer(optimizer)
            if not any(g["params"] for g in optimizer.param_groups):  # configure_optimizers returned None
                converted.append(optimizer)
                continue
            oss = to_oss(optimizer, **self._oss_options())
            check_given_oss(oss, self.offload, type(self).__name__)  # to_oss keeps an OSS as it is
            for config in self.lr_scheduler_configs:
                rebind_scheduler(config.scheduler, optimizer, oss)
            converted.append(oss)
        self.optimizers = converted

    def _oss_options(self) -> dict[str, Any]:
        """``oss_kwargs`` with ``offload``, and fp32 masters under ``"bf16-true"``/``"16-true"``
        unless given (Note [true precision means fp32 masters])."""
        options = {**self.oss_kwargs, "offload": self.offload}
        if self._low_dtype() is not None:
            options.setdefault("master_dtype", torch.float32)
        return options

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> torch.Tensor:
        """``OSS.clip_grad_norm``: torch's norm of the full gradients, bit for bit unless the OSS
        split a parameter across ranks (then within torch's summation error).

        Raises:
            TypeError: ``optimizer`` is not an OSS.
        """
        if not isinstance(optimizer, OSS):
            raise TypeError(f"{self.strategy_name!r} clips the gradients of its OSS optimizers, got a "
                            f"{type(optimizer).__name__}; clip through the trainer (gradient_clip_val)")
        return optimizer.clip_grad_norm(max_norm)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The plain ``torch.optim`` state dict, consolidated on global rank 0 (a collective; other ranks return
        ``{}``: only rank 0 writes the checkpoint). Sharded: ``{}`` (the folder holds the state)."""
        optimizer = unwrap_optimizer(optimizer)
        if self._sharded():
            return {}
        if not isinstance(optimizer, OSS):
            return super().optimizer_state(optimizer)
        optimizer.consolidate_state_dict(recipient_rank=0)
        return optimizer.state_dict() if self.is_global_zero else {}


class ZeRO1Strategy(_OSSStrategy):
    """ZeRO-1: Lightning's DDP with the optimizer rebuilt as :class:`~shardopt.optim.OSS`.

    How it works: DDP all-reduces gradients as usual; each rank steps the optimizer state
    of the parameters it owns and OSS gathers the updated parameters. Checkpoints hold the
    consolidated, plain optimizer state (loadable at any world size or without shardopt).

    Args:
        oss_kwargs: extra :class:`~shardopt.optim.OSS` arguments (``broadcast_fp16``; with ``offload``,
            ``delay_update_after``: Note [delayed update in the integrations]).
        offload: ``"cpu"``: the OSS keeps masters, their gradients and the optimizer state in
            host memory and steps there (Note [offload in the integrations]); default ``None``.
        **kwargs: Lightning ``DDPStrategy`` arguments, DDP's own included.

    Raises:
        ValueError: ``offload`` is not ``None``/``"cpu"`` or disagrees with ``oss_kwargs``.
        ValueError, TypeError: a bad ``oss_kwargs["delay_update_after"]`` (named, with the fix).
    """

    strategy_name = "shardopt_zero1"


class ZeRO2Strategy(_OSSStrategy):
    """ZeRO-2: :class:`~shardopt.nn.ShardedDataParallel` with the optimizer rebuilt as OSS.

    How it works: the LightningModule is wrapped once its optimizers are OSS (the wrapper
    reads their ownership plan); gradients are reduced to their owner only. Accumulation
    runs under ``ShardedDataParallel.no_sync``; clipping uses ``OSS.clip_grad_norm``. At
    teardown the wrapper is closed, leaving the plain module.

    Args:
        oss_kwargs: extra :class:`~shardopt.optim.OSS` arguments.
        sdp_kwargs: extra :class:`~shardopt.nn.ShardedDataParallel` arguments
            (``reduce_buffer_size``, ``reduce_dtype``, ...).
        offload: as for :class:`ZeRO1Strategy` (``"cpu"``: the optimizer state in host memory).
        **kwargs: Lightning ``DDPStrategy`` arguments other than DDP's own.

    Raises:
        TypeError: DDP arguments were passed.
        ValueError: a bad ``offload`` or ``oss_kwargs["delay_update_after"]``, as for :class:`ZeRO1Strategy`.
    """

    strategy_name = "shardopt_zero2"

    def __init__(self, oss_kwargs: Mapping[str, Any] | None = None, sdp_kwargs: Mapping[str, Any] | None = None,
                 offload: str | None = None, **kwargs: Any) -> None:
        super().__init__(oss_kwargs, offload, **kwargs)
        self._require_empty_ddp_kwargs("SDP")
        self.sdp_kwargs = dict(sdp_kwargs or {})

    def configure_ddp(self) -> None:
        """Nothing here: the model is wrapped in :meth:`setup_optimizers`, once the OSS exist."""

    def setup_optimizers(self, trainer: Trainer) -> None:
        """Rebuild the optimizers as OSS, then wrap the model in ShardedDataParallel."""
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING or isinstance(self.model, ShardedDataParallel):
            return
        sharded = [o for o in self.optimizers if isinstance(o, OSS)]
        assert self.model is not None
        self.model = ShardedDataParallel(self.model, sharded, **self.sdp_kwargs)

    def teardown(self) -> None:
        """Close the wrapper (its hooks are removed) and leave the plain LightningModule."""
        if isinstance(self.model, ShardedDataParallel):
            self.model.close()
            self.model = self.lightning_module
        super().teardown()


class ZeRO3Strategy(_ShardedStrategy):
    """ZeRO-3: the LightningModule wrapped in :class:`~shardopt.nn.FullyShardedDataParallel`.

    How it works: the model is wrapped before ``configure_optimizers`` runs, so the plain
    ``torch.optim`` optimizer it returns is built on the sharded parameters (each rank
    steps its slice). Accumulation runs under ``FullyShardedDataParallel.no_sync``, clipping
    uses its ``clip_grad_norm_``. Checkpoints hold the full model state dict and the full,
    name-keyed optimizer state (gathered on rank 0, resharded on load at any world size);
    the checkpoint is restored after the model is wrapped. At teardown the full parameters
    are gathered into new parameters of the plain module and the units are removed, so the
    module works after ``fit`` (and can be wrapped again).

    Args:
        fsdp_kwargs: :class:`~shardopt.nn.FullyShardedDataParallel` arguments
            (``auto_wrap_policy``, ``sharding_strategy``, ``mixed_precision``, ...).
        init_on_meta: build the modules ``configure_model`` creates on the meta device;
            each unit is then materialised on its own when it is wrapped (``param_init_fn``
            in ``fsdp_kwargs``, else each submodule's ``reset_parameters()``) and sharded
            before the next, so no rank holds the whole model (Note [ZeRO-3 without the
            full model]).
        gather_on_teardown: after ``fit``, gather the full parameters into the plain
            module on every rank (default). ``False`` leaves the module wrapped and
            sharded (save with ``checkpoint="sharded"`` and ``shardopt convert``).
        offload: must be ``None``: ZeRO-3 offload is not built yet (Note [offload in the
            integrations]); :class:`ZeRO2Strategy` offloads the optimizer state.
        **kwargs: Lightning ``DDPStrategy`` arguments other than DDP's own.

    Raises:
        TypeError: DDP arguments were passed.
        ValueError: ``offload`` is not ``None``.

    Note [ZeRO-3 without the full model]
    Lightning's DDP path moves the whole model to the device (``model_to_device``) before
    wrapping. With ``init_on_meta=True`` the modules made in ``configure_model`` hold no
    memory until FullyShardedDataParallel wraps them: with an ``auto_wrap_policy`` the
    innermost units are wrapped (materialised, flattened, sharded, their full copy freed)
    first, so the peak is one unit in full plus the shards made so far. ``model_to_device``
    is skipped while meta tensors remain (FSDP places each unit on its device itself).
    Modules made in ``__init__`` are real as usual. Under ``"bf16-true"`` the weights that
    ``reset_parameters`` makes are not rounded to bf16 first (the fp32 masters keep them).
    """

    strategy_name = "shardopt_zero3"
    keeps_fp32_module = True

    def __init__(self, fsdp_kwargs: Mapping[str, Any] | None = None, init_on_meta: bool = False,
                 gather_on_teardown: bool = True, offload: str | None = None, **kwargs: Any) -> None:
        refuse_zero3_offload(offload, type(self).__name__, "ZeRO2Strategy(offload='cpu')")
        super().__init__(**kwargs)
        self._require_empty_ddp_kwargs("FSDP")
        self.init_on_meta = init_on_meta
        self.gather_on_teardown = gather_on_teardown
        self.fsdp_kwargs = dict(fsdp_kwargs or {})
        self._failed = False
        self._shapes: dict[str, torch.Size] = {}

    def configure_ddp(self) -> None:
        """Wrap the LightningModule in FullyShardedDataParallel."""
        assert self.model is not None
        self._shapes = {name: p.shape for name, p in self.model.named_parameters()}
        options = self._fsdp_options()
        if any(t.is_meta for t in [*self.model.parameters(), *self.model.buffers()]):
            options = wrap_units_first(self.model, options)
        self.model = FullyShardedDataParallel(self.model, **options)

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device with ``init_on_meta`` (Note [ZeRO-3
        without the full model])."""
        context = torch.device("meta") if self.init_on_meta else contextlib.nullcontext()
        with context:
            yield None

    def model_to_device(self) -> None:
        """Skipped while meta tensors remain: each unit is materialised on its device."""
        assert self.model is not None
        if not any(t.is_meta for t in [*self.model.parameters(), *self.model.buffers()]):
            super().model_to_device()

    def _checkpoint_model(self) -> torch.nn.Module:
        root = self._root()
        if root is None:
            raise RuntimeError(f"{self.strategy_name!r} with checkpoint='sharded' saves the shards of the wrapped "
                               "model, which exist only during fit; save during fit (ModelCheckpoint)")
        return root

    def _param_shapes(self) -> dict[str, torch.Size]:
        return dict(self._shapes)

    def _fsdp_options(self) -> dict[str, Any]:
        """``fsdp_kwargs``, with units gathered and reduced in the low dtype under
        ``"bf16-true"``/``"16-true"`` unless given (Note [true precision means fp32 masters])."""
        low = self._low_dtype()
        if low is None:
            return self.fsdp_kwargs
        policy = FSDPMixedPrecision(param_dtype=low, reduce_dtype=low, buffer_dtype=low)
        return {"mixed_precision": policy, **self.fsdp_kwargs}

    def setup_optimizers(self, trainer: Trainer) -> None:
        """Build the user's optimizers on the sharded parameters.

        Raises:
            TypeError: an optimizer is an OSS (the state is already sharded by ZeRO-3).
        """
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            if isinstance(unwrap_optimizer(optimizer), OSS):
                raise TypeError(
                    f"{self.strategy_name!r} shards the optimizer state itself; return a plain torch.optim "
                    "optimizer from configure_optimizers, not an OSS"
                )

    def _root(self) -> FullyShardedDataParallel | None:
        return self.model if isinstance(self.model, FullyShardedDataParallel) else None

    def clip_grad_norm(self, optimizer: Optimizer, max_norm: float) -> torch.Tensor:
        """``FullyShardedDataParallel.clip_grad_norm_`` over the whole model.

        Raises:
            RuntimeError: the model is not wrapped (called outside ``fit``).
            ValueError: the optimizer does not hold every trainable parameter (the model's
                norm is not the optimizer's then).
        """
        root = self._root()
        if root is None:
            raise RuntimeError(f"{self.strategy_name!r} clips the wrapped model's gradients, which exist only "
                               "during fit; outside fit use torch.nn.utils.clip_grad_norm_ on the plain module")
        held = {p for g in optimizer.param_groups for p in g["params"]}
        if any(p.requires_grad and p not in held for p in root.parameters()):
            raise ValueError(
                f"{self.strategy_name!r} clips by the norm of the whole model, but this optimizer does not hold "
                "every trainable parameter; use one optimizer over all of them, or clip by value"
            )
        return root.clip_grad_norm_(max_norm)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: a checkpoint is loaded into the wrapped model and its sharded optimizer."""
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict with the LightningModule's own names (gathered on rank 0;
        a collective); nothing when sharded."""
        root = self._root()
        if root is None or self._sharded():
            return super().lightning_module_state_dict()
        return root.state_dict(rank0_only=True)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full, name-keyed optimizer state on rank 0 (a collective; ``{}`` elsewhere).

        Raises:
            RuntimeError: the model is not wrapped (saving optimizer state after ``fit``).
        """
        root = self._root()
        if self._sharded() and root is not None:
            return {}
        if root is None:
            raise RuntimeError(
                f"{self.strategy_name!r}: the optimizer state lives in the shards of the wrapped model, which "
                "teardown released after fit; save checkpoints during fit (ModelCheckpoint), or after fit with "
                "trainer.save_checkpoint(path, weights_only=True)"
            )
        return FullyShardedDataParallel.full_optim_state_dict(root, unwrap_optimizer(optimizer), rank0_only=True)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the full state dict into the shards (every rank reads the checkpoint)."""
        root = self._root()
        if root is None or self._sharded():
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        root.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Reshard each full optimizer state onto this rank's slices and load it."""
        if self._sharded():
            return
        root = self._root()
        assert root is not None, "optimizers are restored only while fitting, after the model is wrapped"
        for optimizer, full in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            optimizer = unwrap_optimizer(optimizer)
            optimizer.load_state_dict(FullyShardedDataParallel.shard_full_optim_state_dict(full, root, optimizer))

    def on_exception(self, exception: BaseException) -> None:
        """Remember the failure: teardown then skips the (collective) gather of parameters."""
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """Gather the full parameters into the plain LightningModule and remove the units.

        A collective on success. After an exception the peers may never join it, so the
        module is left wrapped (and a warning logged).
        """
        root = self._root()
        if root is not None and self._failed:
            logger.warning("%s: fit failed; the LightningModule keeps its sharded parameters", self.strategy_name)
        elif root is not None and self.gather_on_teardown:
            plain = release(root)
            low = self._low_dtype()
            if low is not None:  # the module the user asked for: low-precision weights
                plain.to(dtype=low)
            self.model = self.lightning_module
        super().teardown()


def _register() -> None:
    for cls in (ZeRO1Strategy, ZeRO2Strategy, ZeRO3Strategy):
        if cls.strategy_name not in StrategyRegistry:
            StrategyRegistry.register(cls.strategy_name, cls, description=(cls.__doc__ or "").split("\n")[0])


_register()
