"""``ShardedGradScaler``: AMP loss scaling that agrees on inf/nan across ranks.

Note [torch's GradScaler on sharded gradients]
Under ShardedDataParallel each rank holds only the gradients it owns, so torch's own
``GradScaler`` checks a different part of them for inf/nan on each rank: a rank that found
one skipped ``step()`` alone while the others waited in the post-step parameter gather, a
hang without a message. Making every rank skip is not enough to train on: torch's scaler
hands the optimizer a copy of this rank's flag, and its ``update()`` reads its own, so a
rank that saw no inf would not back off and the ranks' scales would differ from then on.
So an OSS whose gradients a live ShardedDataParallel shards takes part in torch's
``_step_supports_amp_scaling`` protocol: when torch's ``GradScaler.step`` reads the flag,
the read itself raises, on every rank and before any collective, naming
``ShardedGradScaler`` (which agrees on the flag across ranks and steps OSS the ordinary way,
never asking). It raises at the read rather than in ``OSS.step``, which torch would call
next, because in between torch checks this rank's gradients for inf in place, and a
placeholder left in ``param.grad`` (Note [placeholders for moved gradients] in
:mod:`shardopt.placeholders`) cannot be written; ``OSS.step`` still refuses a scaler that set
``found_inf`` another way. The flag is raised only toward torch's
``GradScaler.step`` itself (the property looks at its caller's code object): other readers
take it to mean "this optimizer unscales inside its step" (Lightning's AMP plugin then skips
its unscale before clipping and refuses to clip), which OSS does not. Under DDP (ZeRO-1: DDP and OSS, no ShardedDataParallel)
every rank holds the full reduced gradients and sees the same inf, so torch's scaler works
as with DDP and nothing changes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler, OptState

from shardopt import comm
from shardopt.optim.masters import needs_master
from shardopt.optim.oss import OSS

__all__ = ["ShardedGradScaler"]


def _check_scaler_args(init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any) -> None:
    """torch's GradScaler accepts values that silently ruin training (a scale of 0 turns every
    gradient into 0 * inf = NaN); refuse them here, naming the argument."""
    def real(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}; e.g. {name}=2.0")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
        return float(value)

    if real("init_scale", init_scale) <= 0:
        raise ValueError(f"init_scale must be > 0, got {init_scale!r} (a scale of 0 turns gradients into NaN); "
                         "use the default 2.0**16")
    if real("growth_factor", growth_factor) <= 1:
        raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}; use the default 2.0")
    if not 0 < real("backoff_factor", backoff_factor) < 1:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}; use the default 0.5")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"growth_interval must be an int >= 1 (steps), got {growth_interval!r}; use the default 2000")


class ShardedGradScaler(GradScaler):
    """A ``torch.amp.GradScaler`` for sharded gradients.

    With sharded gradients (ZeRO-2) or a sharded step (ZeRO-1) a rank inspects only part of
    the gradients, so an inf/nan can be visible to one rank only. This scaler adds exactly
    one thing to torch's: after unscaling, the ranks take the max of their found-inf flags,
    so every rank skips the step (and backs off the scale) when any rank saw an inf/nan,
    and no rank steps alone into a parameter gather the others never join.

    How it works: :meth:`unscale_` runs torch's unscale on this rank's gradients, folds the
    per-device flags into one, and all-reduces it (max) over ``process_group``. ``step`` and
    ``update`` are torch's, reading the agreed flag. Works with OSS + ShardedDataParallel and
    with OSS + DDP, on CPU (autocast bf16/fp16) and CUDA.

    With an OSS that keeps master weights (``master_dtype``), the unscale and the inf/nan
    check run on the masters' fp32 gradients (owned ``.grad`` folded in first, Note [master
    gradients] in :mod:`shardopt.optim.masters`), so fp16 parameters work (torch refuses to
    unscale fp16 gradients), and a skipped step also frees the masters' gradients: they hold
    the inf/nan, and a ``model.zero_grad()`` would not reach them.

    Args:
        init_scale: initial scale factor.
        growth_factor: factor the scale grows by after ``growth_interval`` clean steps.
        backoff_factor: factor the scale shrinks by after a step with inf/nan.
        growth_interval: clean steps between growths.
        enabled: ``False`` makes every method a pass-through, as in torch.
        process_group: the group to agree over (default: the group of the ``OSS`` being
            unscaled, so ranks training in a subgroup agree with their own group only; the
            world for an ``OSS`` with a hybrid layout and for any other optimizer).
        device: ``"cpu"`` or ``"cuda"``; default: CUDA when available, else CPU. Must be
            the device type of the gradients.

    Raises:
        ValueError: ``device`` is not a known device type, or a scaling argument is out of
            range (``init_scale <= 0``, ``growth_factor <= 1``, ``backoff_factor`` outside
            (0, 1), ``growth_interval < 1``).
        TypeError: a scaling argument is not a real number, or ``process_group`` is not a
            ``ProcessGroup`` (e.g. the string ``'world'``).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: comm.ProcessGroup | None = None,
        device: str | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia"):
            raise ValueError(f"device must be a device type such as 'cpu' or 'cuda', got {device!r}")
        _check_scaler_args(init_scale, growth_factor, backoff_factor, growth_interval)
        if process_group is not None and not isinstance(process_group, comm.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None (the optimizer's group), "
                            f"got {process_group!r} ({type(process_group).__name__}); pass None, "
                            "torch.distributed.group.WORLD or a group from torch.distributed.new_group")
        super().__init__(
            device=device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradients, then agree with every rank on inf/nan.

        A collective: call it (or ``step``, which calls it) on every rank.
        """
        if not self._enabled:
            return
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        assert self._scale is not None
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in state["found_inf_per_device"].values():
            found = torch.maximum(found, flag.to(found.device))
        group = self.process_group
        if group is None and isinstance(optimizer, OSS):
            # Under a hybrid layout the whole world: an inf on any rank of any replica skips
            # the step everywhere, even where a replica's gradients were not yet all-reduced
            # (Note [hybrid reduction] in shardopt.nn.data_parallel.replicas).
            group = None if optimizer.layout is not None else optimizer.group
        comm.all_reduce(found, group, op="max", label="shardopt::scaler::found_inf").wait()
        state["found_inf_per_device"] = {found.device: found}

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        # torch's per-optimizer hook for what to unscale; with masters or split parameters,
        # the gradients the step reads (masters' fp32 ones, row views') and those of the
        # parameters that have neither (a parameter with a master or rows elsewhere is its
        # owners' business).
        if not (isinstance(optimizer, OSS) and (optimizer.master_dtype is not None or optimizer.plan.split_params
                                                or optimizer.offload is not None)):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        optimizer.collect_master_grads()
        split = set(optimizer.plan.split_params)
        held = []
        for i, p in enumerate(optimizer.params):
            holder = optimizer.grad_holder(p)
            if holder is not None:
                held.append(holder)
            elif i not in split and not needs_master(p.dtype, optimizer.master_dtype):
                held.append(p)
        return super()._unscale_grads_(_Holders(held), inv_scale, found_inf, allow_fp16)  # type: ignore[arg-type]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """torch's ``step`` (skips when any rank found inf/nan); with master weights, a
        skipped step also frees the masters' gradients.

        Args:
            optimizer: the optimizer to step.
            *args: passed to ``optimizer.step``.
            **kwargs: passed to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returned, or ``None`` when the step was skipped.
        """
        if self._enabled and isinstance(optimizer, OSS):
            return self._step_oss(optimizer, *args, **kwargs)
        return super().step(optimizer, *args, **kwargs)

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any,
                        **kwargs: Any) -> float | None:
        # torch's step-or-skip decision, read once (torch reads it here too; it used to be read
        # a second time after the step, when the host then waited for the whole step on a GPU:
        # Note [host reads per step] in shardopt.nn.data_parallel.grad_buckets). A skipped step
        # also frees the masters' gradients.
        found = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())  # host-read: torch's one
        if not found:
            return optimizer.step(*args, **kwargs)
        if isinstance(optimizer, OSS):
            for p in optimizer.params:
                holder = optimizer.grad_holder(p)
                if holder is not None and holder is not p:  # a master or a row view
                    holder.grad = None
        return None


    def _step_oss(self, optimizer: OSS, *args: Any, **kwargs: Any) -> float | None:
        """torch's ordinary ``step`` path (unscale and agree, then step unless any rank found
        inf/nan), also for an OSS that takes part in torch's ``_step_supports_amp_scaling``
        protocol (Note [torch's GradScaler on sharded gradients] in :mod:`shardopt.optim.oss`)."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        result = self._maybe_opt_step(optimizer, state, *args, **kwargs)
        state["stage"] = OptState.STEPPED
        return result


class _Holders:
    """What torch's unscale reads of an optimizer: ``param_groups`` of tensors with a ``.grad``."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.param_groups = [{"params": tensors}]
