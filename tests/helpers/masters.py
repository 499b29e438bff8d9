"""Shared by the master-weight tests: a bf16 model, per-rank bf16 data, and a single-process
reference that does the arithmetic of ZeRO-1/2 with fp32 masters cast for cast."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from tests.helpers.data import rank_batch, seeded_mlp
from tests.helpers.ddp_arithmetic import rank_order_sum

LOW = torch.bfloat16


def low_mlp(seed: int = 0, dtype: torch.dtype = LOW) -> nn.Module:
    """The seeded MLP of the other tests, cast to a low-precision dtype after its fp32 init."""
    return seeded_mlp(seed, dtype=dtype)


def low_batch(rank: int, step: int, dtype: torch.dtype = LOW) -> torch.Tensor:
    return rank_batch(rank, step).to(dtype)


def loss_of(model: nn.Module, rank: int, step: int, dtype: torch.dtype = LOW) -> torch.Tensor:
    return model(low_batch(rank, step, dtype)).float().pow(2).mean()


def backward_micro_steps(wrapped: Any, rank: int, step: int, micro: int, dtype: torch.dtype,
                         scaler: Any = None, no_sync: bool = False) -> None:
    """``micro`` backward passes of :func:`loss_of` on rank ``rank``'s batches ``10 * step + k``,
    scaled by ``scaler`` when given; with ``no_sync`` all but the last under ``wrapped.no_sync()``."""
    for k in range(micro):
        loss = loss_of(wrapped, rank, 10 * step + k, dtype)
        if scaler is not None:
            loss = scaler.scale(loss)
        with wrapped.no_sync() if no_sync and k < micro - 1 else nullcontext():
            loss.backward()


def max_ulps(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor], dtype: torch.dtype = LOW) -> float:
    """Largest elementwise |a - b| in units of ``dtype``'s spacing at max(|a|, |b|)."""
    worst = 0.0
    mantissa = torch.finfo(dtype).eps  # spacing at 1.0
    for x, y in zip(a, b, strict=True):
        x, y = x.detach().double(), y.detach().double()
        scale = torch.maximum(x.abs(), y.abs()).clamp_min(torch.finfo(dtype).tiny)
        _, exponent = torch.frexp(scale)  # scale = m * 2**exponent, 0.5 <= m < 1
        ulp = mantissa * torch.pow(2.0, exponent.double() - 1)
        worst = max(worst, ((x - y).abs() / ulp).max().item())
    return worst


def sdp_reduce(per_rank: list[torch.Tensor], wire: torch.dtype, master: torch.dtype = torch.float32) -> torch.Tensor:
    """ShardedDataParallel's arithmetic for one gradient with masters: each rank's gradient
    scaled by 1/N in the wire dtype (widened exactly first when narrower), every row widened
    to the master dtype and summed in rank order."""
    n = len(per_rank)
    rows = []
    for g in per_rank:
        if g.dtype.itemsize < wire.itemsize:
            row = g.to(wire) * (1.0 / n)
        else:
            row = torch.mul(g, 1.0 / n).to(wire)
        rows.append(row.to(master))
    return rank_order_sum(rows)


class MasterReference:
    """One process doing the same casts: low-precision forward/backward per rank's data, a
    reduction given by the caller, an fp32 master update with the same torch optimizer,
    rounding into the low-precision parameters.

    Args:
        model: the low-precision model (same seed as the distributed one).
        optim: the optimizer class; ``kwargs`` its arguments.
    """

    def __init__(self, model: nn.Module, optim: type[torch.optim.Optimizer], **kwargs: Any) -> None:
        self.model = model
        self.params = [p for p in model.parameters()]
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = optim(self.masters, **kwargs)

    def local_grads(self, loss: Callable[[nn.Module], torch.Tensor]) -> list[torch.Tensor]:
        """Each parameter's low-precision gradient of ``loss(model)``."""
        return [g.detach() for g in torch.autograd.grad(loss(self.model), self.params)]

    def add_master_grads(self, grads: list[torch.Tensor]) -> None:
        for m, g in zip(self.masters, grads, strict=True):
            m.grad = g.clone() if m.grad is None else m.grad.add_(g)

    def step(self) -> None:
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m)
                m.grad = None
