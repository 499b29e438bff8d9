"""Shared by the ShardedDataParallel tests: a model with optional and unused heads, and the
tolerance rule (exact where the arithmetic is)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.data import max_abs_diff


def tolerance(world_size: int) -> float:
    """Exact at 1 and 2 ranks (fp32 sums of two terms commute); 1e-6 relative beyond."""
    return 0.0 if world_size <= 2 else 1e-6


def rel_diff(a: nn.Module, b: nn.Module) -> float:
    scale = max(p.detach().abs().max().item() for p in b.parameters())
    return max_abs_diff(a.parameters(), b.parameters()) / max(scale, 1e-12)


class Branchy(nn.Module):
    """A trunk and three heads: ``a`` always used, ``b`` used when asked, ``never`` never."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)
        self.never = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = F.relu(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)
