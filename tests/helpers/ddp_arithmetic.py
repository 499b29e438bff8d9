"""DDP's arithmetic done by hand in one process: the references the parity tests compare
ShardedDataParallel, OSS and FSDP against.

DDP multiplies each rank's gradient by ``1 / world_size`` while copying it into its bucket
(a float scalar, so ``g * (1/N)``, not ``g / N``) and then all-reduces by sum. Every helper
here does exactly that, summing in rank order: bit-exact against DDP at 2 ranks (``g0*0.5 +
g1*0.5`` is exact in either order); at 3+ ranks gloo's ring sums in its own order.
:func:`mixed_reference_step` is the one helper that runs on every rank: the same arithmetic
in a mixed-precision policy's dtypes, reduced with a collective.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from shardopt import comm
from shardopt.nn.fsdp import MixedPrecision
from tests.helpers.data import rank_batch
from tests.helpers.gpt import lm_loss
from tests.helpers.oss import loss_fn


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


def rank_order_sum(rows: list[torch.Tensor]) -> torch.Tensor:
    """``rows[0] + rows[1] + ...`` in rank order, as the owner sums a bucket."""
    total = rows[0] + rows[1] if len(rows) > 1 else rows[0].clone()
    for row in rows[2:]:
        total += row
    return total


def ddp_reduce(per_rank: list[torch.Tensor]) -> torch.Tensor:
    """DDP's arithmetic in the gradient's own dtype (bit-exact at 2 ranks only)."""
    return rank_order_sum([g * (1.0 / len(per_rank)) for g in per_rank])


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


def mixed_reference_step(master: nn.Module, opt: torch.optim.Optimizer, toks: torch.Tensor, policy: MixedPrecision) -> None:
    """The same arithmetic without FSDP: compute in param_dtype, g*(1/N) and sum in reduce_dtype."""
    assert policy.param_dtype is not None
    low = copy.deepcopy(master).to(policy.param_dtype)
    lm_loss(low(toks), toks).backward()
    reduce_dtype = policy.reduce_dtype or policy.param_dtype
    for p, q in zip(master.parameters(), low.parameters()):
        assert q.grad is not None
        g = q.grad.to(reduce_dtype).mul_(1.0 / comm.group_size(None))
        comm.all_reduce(g, None).wait()
        if policy.keep_low_precision_grads:
            p.grad_dtype = None
            p.grad = g
        else:
            p.grad = g.to(p.dtype)
    opt.step()
    opt.zero_grad()
