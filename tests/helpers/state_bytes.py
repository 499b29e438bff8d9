"""Model-state bytes a rank holds, counted from live storages (the precision tests)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardopt.optim import OSS


def _storage_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct live storages behind ``tensors`` (``None`` and freed skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def held_bytes(model: nn.Module, optimizer: Any) -> int:
    """What this rank holds of model state: parameters and their gradients, the optimizer's
    stepped tensors (masters or flat shards) with their gradients, and its state."""
    inner = optimizer.optim if isinstance(optimizer, OSS) else optimizer
    tensors: list[Any] = []
    for p in [*model.parameters(), *(q for g in inner.param_groups for q in g["params"])]:
        tensors += [p, p.grad]
    for state in inner.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return _storage_bytes(tensors)
