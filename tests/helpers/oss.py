"""Helpers shared by the OSS tests: a mixed-precision model, the DDP-order gradient average."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from tests.helpers.data import rank_batch


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


def ddp_average_grads(
    model: nn.Module, world_size: int, step: int, batch_of: Callable[[int, int], torch.Tensor] = rank_batch
) -> None:
    """Set ``model``'s grads to the DDP average of every rank's grads, in one process.

    DDP multiplies each rank's gradient by ``1 / world_size`` while copying it into its
    bucket (a float scalar, so ``g * (1/N)``, not ``g / N``) and then all-reduces by sum;
    with two ranks the sum ``g0*0.5 + g1*0.5`` is exact in either order, so this matches DDP
    bit for bit at 2 ranks. With 3+ ranks gloo's ring sums in its own order.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    total: list[torch.Tensor | None] = [None] * len(params)
    for r in range(world_size):
        for p in params:
            p.grad = None
        loss_fn(model, batch_of(r, step)).backward()
        for k, p in enumerate(params):
            assert p.grad is not None
            scaled = p.grad * (1.0 / world_size)
            prev = total[k]
            total[k] = scaled if prev is None else prev + scaled
    for p, g in zip(params, total):
        p.grad = g


def relative_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(max |a - b|, that divided by max |b|) over matching tensors."""
    diff = max((x.detach().float() - y.detach().float()).abs().max().item() for x, y in zip(a, b, strict=True))
    scale = max(y.detach().float().abs().max().item() for y in b)
    return diff, diff / max(scale, 1e-30)
