"""The builders of the offload modes, of the ZeRO-3 and torch FSDP2 modes (with and without
offload) and of the autocast baseline.

Registered in :data:`shardopt.app.modes.MODES` (Note [offload modes]): ``ddp-amp``,
``zero1-offload``, ``zero2-offload``, ``zero3``, ``zero3-offload``, ``fsdp2``,
``fsdp2-reshard`` and ``fsdp2-offload``.

Note [offload modes]
- ``ddp-amp``: torch DDP over fp32 parameters, the forward and loss under ``torch.autocast``
  in bf16 (``Mode.autocast``; the runner wraps the forward only, never backward or the step)
  and torch's fused Adam (``fused=True``, on the CPU and on CUDA): what a GPU user runs
  before sharding anything, and the reference the offload modes are meant to beat on device
  memory. Its parameters, gradients and Adam state stay fp32.
- ``zero1-offload`` / ``zero2-offload``: ``zero1`` / ``zero2`` (parameters whole) with
  ``OSS(..., offload="cpu")``: each rank's masters (an fp32 parameter's exact fp32 mirror,
  or the fp32 master of a bf16 one with ``-bf16m``), their gradient buffer and Adam's state
  live in host memory and the step runs there (Note [offloaded masters] in
  :mod:`shardopt.optim.masters`). On CPU ranks the arithmetic is that of the mode without
  offload, bit for bit (the same kernels on the same values), so their losses and
  parameters equal ``zero1`` / ``zero2``'s. ``Setup.delay_update_after`` (set by ``shardopt
  rehearse --delayed-update`` only) builds the OSS with it.
- ``zero3-offload``: ``zero3`` with ``cpu_offload=CPUOffload(offload_params=True)``: every
  unit's shard and its reduced gradient live in host memory, so Adam and its state run there
  (Note [offloaded shards] in :mod:`shardopt.nn.fsdp.offload`); on CPU ranks bit for bit the
  arithmetic of ``zero3``.
- ``fsdp2-offload``: torch ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` with
  ``reshard_after_forward=True`` (torch's default), the peer: FSDP2 keeps the parameter
  shards, their gradients and the optimizer state on the host and steps there. torch's
  default policy pins that memory, which needs an accelerator: on a machine without one
  ``fully_shard`` raises "Cannot access accelerator device when none is available" (torch
  2.13, ``FSDPParam._init_sharded_param``). Pinning only speeds up copies to a GPU, so the
  builder pins when the ranks train on CUDA and not on CPU ranks, where the mode then runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardopt.app.wrapping import Builder, Setup, Wrapped, ddp_of, oss_of, plain_no_sync

__all__ = ["build_ddp_amp", "build_zero1_offload", "build_zero2_offload", "fsdp2_builder", "zero3_builder"]

OFFLOAD = "cpu"
"""Where the offload modes keep the optimizer's side: ``OSS(offload=...)``."""


def build_ddp_amp(module: nn.Module, setup: Setup) -> Wrapped:
    """``ddp-amp``: DDP over the fp32 model with torch's fused Adam (autocast by the runner,
    Note [offload modes])."""
    model = ddp_of(module, setup)
    opt = torch.optim.Adam(module.parameters(), lr=setup.lr, fused=True)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))


def build_zero1_offload(module: nn.Module, setup: Setup) -> Wrapped:
    """``zero1-offload``: DDP + ``OSS(..., offload="cpu")`` (Note [offload modes])."""
    model = ddp_of(module, setup)
    opt = oss_of(module, setup, offload=OFFLOAD, delay_update_after=setup.delay_update_after)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True), offloaded=True)


def build_zero2_offload(module: nn.Module, setup: Setup) -> Wrapped:
    """``zero2-offload``: ShardedDataParallel + ``OSS(..., offload="cpu")``, parameters whole as
    in ``zero2`` (Note [offload modes])."""
    from shardopt.nn import ShardedDataParallel

    opt = oss_of(module, setup, split_large_params=False, offload=OFFLOAD, delay_update_after=setup.delay_update_after)
    model = ShardedDataParallel(module, opt, reduce_dtype=setup.precision.wire_dtype)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True), offloaded=True)


def zero3_builder(offload: bool) -> Builder:
    """shardopt's FullyShardedDataParallel, one unit per block of the built-in GPT, forward
    prefetch on; with ``offload`` under ``CPUOffload(offload_params=True)`` (Note [offload modes])."""

    def build(module: nn.Module, setup: Setup) -> Wrapped:
        from shardopt.nn.fsdp import CPUOffload, FullyShardedDataParallel, ModuleClassPolicy

        blocks = getattr(module, "blocks", None)  # one unit per transformer block of the built-in GPT
        policy = ModuleClassPolicy((type(blocks[0]),)) if isinstance(blocks, nn.ModuleList) and len(blocks) else None
        # Forward prefetch, as FSDP2 does by default: the like-for-like comparison.
        model = FullyShardedDataParallel(module, auto_wrap_policy=policy, forward_prefetch=True,
                                         cpu_offload=CPUOffload(offload_params=offload))
        opt = torch.optim.Adam(model.parameters(), lr=setup.lr)
        return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True),
                       sharded_params=True, checkpoint_target=model, offloaded=offload)

    return build


def fsdp2_builder(reshard_after_forward: bool, offload: bool = False) -> Builder:
    """torch ``fully_shard`` on every block of the built-in GPT and on the root, with
    ``reshard_after_forward``; with ``offload`` under ``CPUOffloadPolicy`` (Note [offload modes]).
    """

    def build(module: nn.Module, setup: Setup) -> Wrapped:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        # fully_shard's default mesh is on CUDA whenever CUDA exists, which breaks gloo ranks
        # training on the CPU of a GPU machine: name the device the ranks train on.
        mesh = init_device_mesh(setup.device.type, (dist.get_world_size(),))
        policy = CPUOffloadPolicy(pin_memory=setup.device.type == "cuda") if offload else OffloadPolicy()
        for child in getattr(module, "blocks", []):
            fully_shard(child, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=policy)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=policy)
        opt = torch.optim.Adam(module.parameters(), lr=setup.lr)
        return Wrapped(module, module, opt, plain_no_sync, lambda: opt.zero_grad(set_to_none=True),
                       sharded_params=True, offloaded=offload)

    return build
