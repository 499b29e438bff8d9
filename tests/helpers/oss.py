"""Helpers shared by the OSS tests: a mixed-precision model and its loss (the DDP-order average
is in :mod:`tests.helpers.ddp_arithmetic`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn


class CastTo(nn.Module):
    """Casts activations to a dtype, so layers of different dtypes can follow each other."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def mixed_mlp(seed: int = 0) -> nn.Module:
    """fp32 first layer, bf16 middle layer, fp32 head: one model, two parameter dtypes."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), CastTo(torch.bfloat16), nn.Linear(16, 24).to(torch.bfloat16),
        nn.ReLU(), CastTo(torch.float32), nn.Linear(24, 4),
    )


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The training loss used by every OSS test."""
    return model(x).float().pow(2).mean()


def relative_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(max |a - b|, that divided by max |b|) over matching tensors."""
    diff = max((x.detach().float() - y.detach().float()).abs().max().item() for x, y in zip(a, b, strict=True))
    scale = max(y.detach().float().abs().max().item() for y in b)
    return diff, diff / max(scale, 1e-30)


def state_entries_equal(got: Mapping[Any, Mapping[str, Any]], want: Mapping[Any, Mapping[str, Any]]) -> bool:
    """Two optimizer state dicts' ``state`` parts hold the same entries with equal values, bit
    for bit (tensors and plain numbers alike)."""
    return got.keys() == want.keys() and all(
        got[i].keys() == entry.keys()
        and all(torch.equal(torch.as_tensor(got[i][k]), torch.as_tensor(v)) for k, v in entry.items())
        for i, entry in want.items())
