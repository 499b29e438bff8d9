"""Checks on FSDP models that tests share."""

from __future__ import annotations

from torch import nn

from shardopt.nn.fsdp import FullyShardedDataParallel

__all__ = ["all_sharded"]


def all_sharded(model: nn.Module) -> bool:
    """Every unit-owned parameter shows this rank's rows of its unit's shard (no unit left
    gathered, Note [flat parameter layout])."""
    for wrapper in FullyShardedDataParallel.fsdp_modules(model):
        handle = wrapper.unit.handle
        if handle is None:
            continue
        shard_ptr = handle.shard.untyped_storage().data_ptr()
        for p, slot in zip(handle.params, handle.layout.slots):
            if p.shape != slot.local_shape or p.untyped_storage().data_ptr() != shard_ptr:
                return False
    return True
