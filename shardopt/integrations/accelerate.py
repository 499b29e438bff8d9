"""Accelerate custom loops with shardopt: :class:`ShardedAccelerator`.

Use it where ``accelerate.Accelerator`` would be, with an :class:`~shardopt.optim.OSS`
(ZeRO-1 under Accelerate's DDP, or ZeRO-2 with a
:class:`~shardopt.nn.ShardedDataParallel` model) or a
:class:`~shardopt.nn.FullyShardedDataParallel` model and a plain optimizer (ZeRO-3)::

    accelerator = ShardedAccelerator(gradient_accumulation_steps=2)
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
    model = ShardedDataParallel(model, optimizer)            # ZeRO-2; leave out for ZeRO-1
    scheduler = get_scheduler(..., optimizer)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    ...  # accelerator.accumulate / backward / clip_grad_norm_ / save_state / load_state

Note [Accelerate and sharded optimizers]
These things go wrong with a plain ``Accelerator`` (measured at 2 ranks); with an OSS it
stops at the first state dict read (``prepare``, or ``save_state``) with an error naming
this class (Note [naming the integration in the state_dict error] in
:mod:`shardopt.optim.state_transport`):

* ``prepare(optimizer)`` round-trips the optimizer's state dict to place it on the device
  (``AcceleratedOptimizer.__init__``: ``load_state_dict(state_dict())``). ``OSS.state_dict()``
  needs a consolidation (a collective) first, so ``prepare`` fails; consolidating early
  makes it load a stale snapshot: param groups from before the LR scheduler was built, so
  the first step ran at the pre-warm-up lr (2e-3 instead of 0). Here an OSS is prepared
  without device placement (its state is created where its parameters are, on the
  device), so nothing is round-tripped and the order of the user's calls does not matter.
* A ShardedDataParallel or FullyShardedDataParallel model would be wrapped in DDP on top;
  here it is prepared for autocast only (no DDP, no device move: the wrapper placed it).
* ``clip_grad_norm_`` would clip each rank's shard by the rank's own norm. Here the norm is
  the global one: ``OSS.clip_grad_norm`` (torch's norm of the full gradients, in torch's
  order) or ``FullyShardedDataParallel.clip_grad_norm_``, after unscaling (fp16).
* ``save_state`` reads every optimizer's ``state_dict()`` on every rank: an OSS is
  consolidated onto every rank first (each rank holds the full optimizer state for the
  length of the save); ``load_state`` loads the plain state dict, resharded by OSS at any
  world size.
* ZeRO-3: the plain optimizer over a FullyShardedDataParallel model's flat shards holds a
  different slice on every rank, and ``save_state`` writes rank 0's only, so ``load_state``
  would give rank 0's slice to every rank. Here such an optimizer is prepared as a
  :class:`_ShardedStateOptimizer`: its ``state_dict()`` is the full, name-keyed state
  (``FullyShardedDataParallel.full_optim_state_dict``, a collective that ``save_state`` runs
  on every rank; rank 0's is written) and ``load_state_dict`` cuts it to this rank's slices
  (``shard_full_optim_state_dict``, at any world size). The model's weights go through the
  wrapper's own full ``state_dict()`` / ``load_state_dict`` (collectives as well).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardopt.integrations.extras import raise_missing_extra

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
except ModuleNotFoundError as e:
    raise_missing_extra(e, __name__, "hf")

from shardopt.nn import FullyShardedDataParallel, ShardedDataParallel
from shardopt.optim import OSS

__all__ = ["ShardedAccelerator"]


def _inner_optimizer(optimizer: Any) -> Any:
    """The optimizer under Accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class _ShardedStateOptimizer(AcceleratedOptimizer):
    """An ``AcceleratedOptimizer`` over a FullyShardedDataParallel model's shards whose
    state dict is the full, name-keyed one (Note [Accelerate and sharded optimizers])."""

    def __init__(self, optimizer: torch.optim.Optimizer, root: FullyShardedDataParallel, scaler: Any) -> None:
        super().__init__(optimizer, device_placement=False, scaler=scaler)
        self.root = root

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state on every rank (a collective over the model's ranks)."""
        return FullyShardedDataParallel.full_optim_state_dict(self.root, self.optimizer, rank0_only=False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (from :meth:`state_dict`, any world size) as this rank's slices."""
        self.optimizer.load_state_dict(
            FullyShardedDataParallel.shard_full_optim_state_dict(state_dict, self.root, self.optimizer))


class ShardedAccelerator(Accelerator):
    """``accelerate.Accelerator`` that prepares, clips and checkpoints shardopt's ZeRO-1/2/3
    correctly whatever the order of the user's calls (Note [Accelerate and sharded
    optimizers]). Takes the ``Accelerator``'s arguments."""

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """Accelerate's ``prepare_optimizer``; an OSS without the state round trip."""
        inner = _inner_optimizer(optimizer)
        if isinstance(inner, OSS):
            device_placement = False
        root = self._fsdp_root_of(inner)
        if root is not None:
            prepared = _ShardedStateOptimizer(inner, root, self.scaler)
            self._optimizers.append(prepared)
            return prepared
        return super().prepare_optimizer(optimizer, device_placement=device_placement)

    def _fsdp_root_of(self, optimizer: torch.optim.Optimizer) -> FullyShardedDataParallel | None:
        """The prepared FullyShardedDataParallel model whose parameters ``optimizer`` steps."""
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for model in self._models:
            if isinstance(model, FullyShardedDataParallel) and params & {id(p) for p in model.parameters()}:
                return model
        return None

    def _refuse_unsharded_zero3_state(self, call: str) -> None:
        """Raises ValueError: an optimizer over a FullyShardedDataParallel model's shards was
        prepared before that model (its state dict would be one rank's slice)."""
        for opt in self._optimizers:
            if not isinstance(opt, _ShardedStateOptimizer) and self._fsdp_root_of(_inner_optimizer(opt)) is not None:
                raise ValueError(
                    f"{call}: an optimizer over a FullyShardedDataParallel model's shards was prepared before the "
                    "model, so its state dict would be one rank's slice; prepare the model first "
                    "(accelerator.prepare(model, optimizer, ...), model before optimizer)"
                )

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:
        """Accelerate's ``prepare_model``; a shardopt wrapper gets autocast only (no DDP)."""
        if isinstance(model, (ShardedDataParallel, FullyShardedDataParallel)):
            return super().prepare_model(model, device_placement=False, evaluation_mode=True)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def _sharded_optimizers(self) -> list[OSS]:
        return [o for o in (_inner_optimizer(opt) for opt in self._optimizers) if isinstance(o, OSS)]

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float,
                        norm_type: float = 2) -> torch.Tensor:
        """Clip by the global norm of the full gradients (a collective) and return it.

        Parameters held by a prepared OSS are clipped with ``OSS.clip_grad_norm``; those of
        a prepared FullyShardedDataParallel with its ``clip_grad_norm_``; anything else is
        Accelerate's.

        Raises:
            ValueError: ``parameters`` mixes an OSS's parameters with others, or covers
                only part of them (the norm of a part is not the model's).
        """
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        wanted = set(params)
        for oss in self._sharded_optimizers():
            held = set(oss.params)
            if wanted & held:
                if wanted != held:
                    raise ValueError(
                        "clip_grad_norm_ got parameters that are not exactly those of the OSS optimizer "
                        f"({len(wanted)} given, {len(held)} in the optimizer); pass model.parameters() of the "
                        "model the OSS was built on, so the global norm is the model's"
                    )
                self.unscale_gradients()
                return oss.clip_grad_norm(max_norm, norm_type)
        for model in self._models:
            if isinstance(model, FullyShardedDataParallel) and wanted and wanted <= set(model.parameters()):
                self.unscale_gradients()
                return model.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        """Accelerate's ``save_state`` with every OSS consolidated onto every rank first
        (a collective: call on every rank, as Accelerate requires anyway)."""
        self._refuse_unsharded_zero3_state("save_state")
        for oss in self._sharded_optimizers():
            oss.consolidate_state_dict(recipient_rank=-1)
        return str(super().save_state(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs))

    def load_state(self, input_dir: str | None = None, **load_model_func_kwargs: Any) -> None:
        """Accelerate's ``load_state``; a ZeRO-3 optimizer's full state is cut to this rank's
        slices (Note [Accelerate and sharded optimizers]). A collective at ZeRO-3.

        Raises:
            ValueError: as ``save_state``.
        """
        self._refuse_unsharded_zero3_state("load_state")
        super().load_state(input_dir, **load_model_func_kwargs)
