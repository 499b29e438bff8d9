"""Shared pieces of the distributed tests: seeded models, per-rank data, comparisons."""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


def average_in_rank_order(per_rank: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """DDP's arithmetic in one process: each rank's gradient times 1/N, summed in rank order
    (``None`` where no rank had a gradient)."""
    world_size = len(per_rank)
    total: list[torch.Tensor | None] = [None] * len(per_rank[0])
    for grads in per_rank:
        for i, g in enumerate(grads):
            if g is not None:
                scaled = g * (1.0 / world_size)
                total[i] = scaled if total[i] is None else total[i] + scaled  # type: ignore[operator]
    return total


def add_to_grads(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """Accumulate into ``.grad`` as autograd would; ``None`` leaves a parameter untouched."""
    for p, g in zip(params, grads, strict=True):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


def reference_backward(model: nn.Module, world_size: int, loss_of: Callable[[nn.Module, int], torch.Tensor]) -> None:
    """One data-parallel backward in one process: each rank's gradient times 1/N, summed in
    rank order, added to ``.grad`` (a parameter no rank used keeps its ``.grad``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_rank = [list(torch.autograd.grad(loss_of(model, r), params, allow_unused=True)) for r in range(world_size)]
    add_to_grads(params, average_in_rank_order(per_rank))
