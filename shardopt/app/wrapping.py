"""What a mode's builder takes and returns: :class:`Setup` in, :class:`Wrapped` out, and the
pieces several builders share (DDP on the rank's device, Adam sharded by OSS).

Split from :mod:`shardopt.app.modes` so that builders in other modules (the offload modes of
:mod:`shardopt.app.offload_modes`) use them without importing the registry of modes, which
imports them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.app.precision import Precision
from shardopt.optim import OSS

__all__ = ["Builder", "Setup", "Wrapped", "ddp_of", "oss_of", "plain_backward", "plain_no_sync"]


def plain_backward(loss: torch.Tensor) -> None:
    """``loss.backward()``: the backward of every mode whose engine need not see the loss."""
    loss.backward()


@dataclass
class Wrapped:
    """A model wrapped for one mode, with its optimizer and the calls that differ per mode.

    Attributes:
        model: what to call for the forward pass.
        module: the unwrapped model (its parameters are full unless the mode shards them).
        optimizer: the optimizer to step.
        no_sync: a context manager factory that skips gradient reduction (accumulation).
        zero_grad: clears gradients the way this mode must.
        sharded_params: whether ``module``'s parameters are shards (ZeRO-3 / FSDP2), so
            full values need :func:`full_parameters`.
        checkpoint_target: the object whose state a checkpoint saves: the unwrapped module
            when its parameters are full, else the sharding wrapper.
        param_names: the unwrapped model's parameter names in ``named_parameters()`` order,
            read before wrapping (set by :meth:`Mode.wrap`); position ``i`` is parameter id
            ``i`` of a plain ``torch.optim`` state dict over the model.
        backward: runs the backward pass of a loss (``loss.backward()`` unless the mode's
            engine must see it, as DeepSpeed's does).
        step: steps the optimizer when the mode's engine does it instead of
            ``optimizer.step()`` (DeepSpeed's); ``None`` otherwise.
        offloaded: the optimizer's stepped tensors (masters, or FSDP2's parameter shards),
            their gradients and its state live in host memory by offload (Note [offload
            modes] in :mod:`shardopt.app.offload_modes`), whatever device the ranks train on.
    """

    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    no_sync: Callable[[], ContextManager[Any]]
    zero_grad: Callable[[], None]
    sharded_params: bool = False
    checkpoint_target: nn.Module | None = None
    param_names: tuple[str, ...] = ()
    backward: Callable[[torch.Tensor], None] = plain_backward
    step: Callable[[], Any] | None = None
    offloaded: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint_target is None:
            self.checkpoint_target = self.module


@dataclass(frozen=True)
class Setup:
    """What a mode's builder needs besides the model; the same on every rank.

    Attributes:
        lr: Adam's learning rate.
        device: the device the model trains on.
        precision: how parameters are held and reduced (the model is already cast to
            :attr:`Precision.param_dtype` when the builder sees it).
        batch_size: sequences per micro-batch per rank (DeepSpeed's config wants it).
        grad_accum_steps: micro-batches per optimizer step.
        shard_size: S, ranks per shard group, for the hybrid modes (:attr:`Mode.hybrid`);
            ``None`` for the others.
        compile: compile every transformer block in place before the mode wraps the model
            (Note [--compile in every mode]).
        delay_update_after: ``OSS(delay_update_after=...)`` of ``zero1-offload`` and ``zero2-offload``
            (Note [delayed update] in :mod:`shardopt.optim.delayed_update`); ``None`` (default) for
            every mode: only ``shardopt rehearse --delayed-update`` sets it, for those two.
    """

    lr: float
    device: torch.device
    precision: Precision = field(default_factory=Precision)
    batch_size: int = 1
    grad_accum_steps: int = 1
    shard_size: int | None = None
    compile: bool = False
    delay_update_after: int | None = None


Builder = Callable[[nn.Module, Setup], Wrapped]


def plain_no_sync() -> ContextManager[Any]:
    """A ``no_sync`` that does nothing, for modes that reduce nothing during backward (FSDP2)."""
    return contextlib.nullcontext()


def ddp_of(module: nn.Module, setup: Setup) -> DDP:
    """``module`` under torch DDP on ``setup.device`` (device ids on CUDA only)."""
    return DDP(module, device_ids=[setup.device] if setup.device.type == "cuda" else None)


def oss_of(module: nn.Module, setup: Setup, **kwargs: Any) -> OSS:
    """Adam sharded by OSS; with ``bf16-master`` the owner keeps fp32 masters of its shard."""
    return OSS(module.parameters(), optim=torch.optim.Adam, master_dtype=setup.precision.master_dtype, lr=setup.lr,
               **kwargs)
