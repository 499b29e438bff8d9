"""Lightning precision plugins of the shardopt strategies: clipping by the global norm
(Note [clipping sharded gradients] in :mod:`shardopt.integrations.lightning`), a
ShardedGradScaler for fp16, and ``"bf16-true"``/``"16-true"`` with fp32 masters (Note [true
precision means fp32 masters] there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from shardopt.integrations.extras import raise_missing_extra

try:
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
except ModuleNotFoundError as e:
    raise_missing_extra(e, __name__, "lightning")

from shardopt.optim import OSS, ShardedGradScaler

__all__ = ["ShardedHalfPrecision", "ShardedMixedPrecision", "ShardedPrecision", "sharded_scaler", "unwrap_optimizer"]

ClipNorm = Callable[[Optimizer, float], torch.Tensor]


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer under Lightning's ``LightningOptimizer`` (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _delays(optimizer: Any) -> bool:
    """Whether ``optimizer`` is an OSS with ``delay_update_after``, whose ``step()`` refuses a closure."""
    inner = unwrap_optimizer(optimizer)
    return isinstance(inner, OSS) and inner.delay_update_after is not None


def _closure_then_step(plugin: Precision, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
    """Lightning's step with the closure (training step, backward, then clipping and
    ``on_before_optimizer_step``) run first and none passed to ``step()`` (Note [delayed update in the
    integrations] in :mod:`shardopt.integrations.offload`); returns the closure's result."""
    closure_result = plugin._wrap_closure(model, optimizer, closure)
    optimizer.step(**kwargs)
    return closure_result


class ShardedPrecision(Precision):
    """Lightning's ``"32-true"`` precision with clipping by the global gradient norm.

    Args:
        clip_norm: ``clip_norm(optimizer, max_norm)`` clips the gradients of every rank by
            their global norm and returns it (Note [clipping sharded gradients]).
    """

    def __init__(self, clip_norm: ClipNorm) -> None:
        super().__init__()
        self.clip_norm = clip_norm

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Clip by the norm of the full gradient (a collective: every rank clips)."""
        self.clip_norm(unwrap_optimizer(optimizer), float(clip_val))

    def optimizer_step(  # type: ignore[override]  # Lightning narrows fabric's signature likewise
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any,
    ) -> Any:
        """Lightning's ``optimizer.step(closure)``; an OSS that delays its update runs the closure
        first and steps without it (Note [delayed update in the integrations])."""
        if _delays(optimizer):
            return _closure_then_step(self, optimizer, model, closure, **kwargs)
        return super().optimizer_step(optimizer, model, closure, **kwargs)


class ShardedMixedPrecision(MixedPrecision):
    """Lightning's ``"bf16-mixed"`` / ``"16-mixed"`` with global-norm clipping and, for
    fp16, a :class:`~shardopt.optim.grad_scaler.ShardedGradScaler` (every rank skips a step
    when any rank saw an inf/nan in its shard).

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``.
        device: the autocast device type (``"cpu"``, ``"cuda"``).
        clip_norm: as for :class:`ShardedPrecision`.
        scaler: for ``"16-mixed"``; default ``ShardedGradScaler(device=device)``.
    """

    def __init__(self, precision: str, device: str, clip_norm: ClipNorm,
                 scaler: ShardedGradScaler | None = None) -> None:
        if precision == "16-mixed" and scaler is None:
            scaler = ShardedGradScaler(device=device)
        super().__init__(precision, device, scaler)  # type: ignore[arg-type]
        self.clip_norm = clip_norm

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Clip by the norm of the full gradient (a collective: every rank clips)."""
        self.clip_norm(unwrap_optimizer(optimizer), float(clip_val))

    def optimizer_step(  # type: ignore[override]  # Lightning narrows fabric's signature likewise
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any,
    ) -> Any:
        """Lightning's step (``"16-mixed"``: the closure first, then the scaler's step); for
        ``"bf16-mixed"`` and an OSS that delays its update, the closure first and ``step()``
        without it (Note [delayed update in the integrations])."""
        if self.scaler is None and _delays(optimizer):
            return _closure_then_step(self, optimizer, model, closure, **kwargs)
        return super().optimizer_step(optimizer, model, closure, **kwargs)


class ShardedHalfPrecision(HalfPrecision):
    """Lightning's ``"bf16-true"`` / ``"16-true"`` as DeepSpeed means them: low-precision
    parameters with fp32 masters (Note [true precision means fp32 masters]), global-norm
    clipping and, for ``"16-true"``, loss scaling with a ShardedGradScaler.

    Args:
        precision: ``"bf16-true"`` or ``"16-true"``.
        clip_norm: as for :class:`ShardedPrecision`.
        scaler: for ``"16-true"``; default a ``ShardedGradScaler`` on the model's device,
            made when the plugin is connected to the model.
        keep_fp32_module: round the module's floating weights and buffers to the low dtype
            but keep them fp32 (ZeRO-3, whose fp32 shards are the masters) instead of
            casting the module.

    Raises:
        ValueError: ``precision`` is not one of the two, or a scaler was given for bf16.
    """

    def __init__(self, precision: str, clip_norm: ClipNorm, scaler: ShardedGradScaler | None = None,
                 keep_fp32_module: bool = False) -> None:
        if precision not in ("bf16-true", "16-true"):
            raise ValueError(f"ShardedHalfPrecision(precision={precision!r}): precision must be 'bf16-true' or "
                             "'16-true'; use ShardedMixedPrecision for autocast")
        if precision == "bf16-true" and scaler is not None:
            raise ValueError("ShardedHalfPrecision('bf16-true') takes no scaler: bf16 has fp32's range, gradients do "
                             "not overflow; remove scaler=")
        super().__init__(precision)  # type: ignore[arg-type]
        self.clip_norm = clip_norm
        self.scaler = scaler
        self.keep_fp32_module = keep_fp32_module

    @property
    def low_dtype(self) -> torch.dtype:
        """The parameters' dtype (``torch.bfloat16`` or ``torch.float16``)."""
        return self._desired_input_dtype

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cast the module to the low dtype, or (``keep_fp32_module``) round it in place."""
        if not self.keep_fp32_module:
            return module.to(dtype=self.low_dtype)
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.is_floating_point() and not tensor.is_meta:
                    tensor.copy_(tensor.to(self.low_dtype))
        return module

    def connect(self, model: Any, optimizers: Any, lr_schedulers: Any) -> Any:
        """Make the default ShardedGradScaler for ``"16-true"`` on the model's device."""
        if self.precision == "16-true" and self.scaler is None:
            device = next((p.device.type for p in model.parameters()), "cpu")
            self.scaler = ShardedGradScaler(device=device)
        return super().connect(model, optimizers, lr_schedulers)

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        """Scale the loss (``"16-true"``)."""
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(  # type: ignore[override]  # Lightning narrows fabric's signature likewise
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any,
    ) -> Any:
        """Run the closure (the last micro-batch's forward and backward), unscale
        (``"16-true"``, on the masters' fp32 gradients), clip, then step (with a scaler,
        unless any rank saw inf/nan; then update the scale).

        The closure runs here, not inside ``optimizer.step(closure)``: OSS folds the
        gradients into its masters before calling a closure, which under DDP's ``no_sync``
        accumulation would take the earlier micro-batches' local, unreduced gradients out of
        ``param.grad`` before DDP's all-reduce adds them up (Note [true precision means fp32
        masters])."""
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization  # backward skipped
        if self.scaler is not None and not skip:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skip:
            return closure_result
        if self.scaler is None:
            optimizer.step(**kwargs)
            return closure_result
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """Clip by the norm of the full gradient (a collective: every rank clips)."""
        self.clip_norm(unwrap_optimizer(optimizer), float(clip_val))

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (``{}`` for bf16)."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state."""
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def sharded_scaler(scaler: torch.amp.GradScaler, device: str) -> ShardedGradScaler:
    """A ShardedGradScaler with the settings of a torch ``GradScaler`` the user configured."""
    if isinstance(scaler, ShardedGradScaler):
        return scaler
    return ShardedGradScaler(
        init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(), device=device,
    )


