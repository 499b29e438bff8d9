"""Shared pieces of the distributed tests: seeded models, per-rank data, comparisons."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def seeded_mlp(seed: int = 0, width: int = 16, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A small MLP with uneven parameter sizes, identical for a given seed."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, 4)
    ).to(dtype)


def rank_batch(rank: int, step: int, batch: int = 6, features: int = 8) -> torch.Tensor:
    """Different data for every (rank, step), the same on every run."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, features, generator=gen)


def max_abs_diff(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """Largest elementwise |a - b| over matching tensors (0.0 when identical)."""
    return max(((x.detach().float() - y.detach().float()).abs().max().item() for x, y in zip(a, b, strict=True)),
               default=0.0)


def decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    """nanoGPT's AdamW grouping: matrices decay, vectors (biases, norms) do not. Its order is
    not the module's."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
