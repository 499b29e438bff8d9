"""A DDP reference that clips with another run's total norms (Note [fed clip norms]).

Note [fed clip norms]
~~~~~~~~~~~~~~~~~~~~~
ZeRO-3's clip norm is sqrt(sum over ranks of the squared norms of their gradient pieces),
torch's is the norm of per-tensor norms: the two sums run in different orders, so the total
norm may differ in its last bit, and so may the clip coefficient ``max_norm / (norm + 1e-6)``.
Everything after that is elementwise and identical, but a one-ulp change in the coefficient
can flip the rounding of a later bf16 activation under autocast, and one AdamW step turns a
flipped element into a difference of order ``lr`` (measured: 4.43e-5 at lr 1e-2 on an
AVX-512 machine, 6e-8 on the same machine under ``ATEN_CPU_CAPABILITY=avx2``). Whether an
element flips depends on the CPU kernels torch dispatches, so no tolerance below ``lr`` is
safe on every machine, and one of ``lr`` would hide real bugs (a per-rank norm is off by
about 7e-3).

So a ZeRO-3 run with clipping is compared bit for bit with a DDP run that clips by the
ZeRO-3 run's own total norms: the remaining arithmetic (forward, backward, the averaged
reduction, ``grad * coef``, the optimizer) is the same, so the parameters must be equal.
The norms themselves are compared separately with a tolerance derived from their sums.

The same holds for ZeRO-1/2 (``OSS.clip_grad_norm``) when the plan splits a parameter across
ranks (``OSS(split_large_params=None)``, the default, splits one larger than a rank's share):
that parameter's norm is the norm of its blocks' norms, not torch's one reduction (Note
[sharded norm in torch's order] in shardopt.optim.grad_norm). Measured on the Lightning
test's 32 x 16 weight: one ulp of the total norm (6.8e-8 relative) on an AVX-512 Xeon, with
and without ``ATEN_CPU_CAPABILITY=avx2``, and the parameters 3e-8 off DDP's after 3 steps;
equal on the AMD EPYC before it (CI passed). With nothing split the norm is torch's bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardopt.nn import FullyShardedDataParallel
from shardopt.optim import OSS

# Both norms are fp32 sums of squares over at most ~1e5 elements. torch's CPU reductions
# accumulate in vector lanes and combine them pairwise, so each sum is within about
# log2(n) * 2**-24 (< 1.1e-6 relative, n <= 2**18) of the exact one, and the square root halves
# a relative error. One ulp of the norm is 6e-8 relative; a norm that misses a rank's piece
# is off by tens of percent.
NORM_RTOL = 1e-6


def total_norm_rtol(numel: int) -> float:
    """The relative distance allowed between a clip's total norm summed from pieces (a split
    parameter's blocks, ZeRO-3's flat shards) and torch's one reduction per gradient, for a
    model of ``numel`` gradient elements.

    Both are fp32 tree sums of at most ``numel`` squares, each within log2(numel) * 2**-24
    relative of the exact sum, so they differ by at most twice that; the square root halves it,
    and each piece's norm is rounded once more: (log2(numel) + 1) * 2**-24 (6.4e-7 for the
    820 elements of ``seeded_mlp()`` and the Lightning test's model; one ulp is 6e-8).
    """
    return (math.log2(numel) + 1) * 2.0**-24


def norms_within(pairs: Iterable[tuple[float, float]], numel: int) -> bool:
    """Whether every ``(torch's norm, sharded norm)`` pair is within :func:`total_norm_rtol`."""
    rtol = total_norm_rtol(numel)
    return all(abs(norm - torch_norm) <= rtol * torch_norm for torch_norm, norm in pairs)


@contextmanager
def recorded_clip_norms() -> Iterator[list[torch.Tensor]]:
    """Record every total norm ``OSS.clip_grad_norm`` and ``FullyShardedDataParallel.clip_grad_norm_``
    return, in order (a clip called from inside another is recorded once, by the outer one)."""
    norms: list[torch.Tensor] = []
    depth = [0]
    originals = {OSS: OSS.clip_grad_norm, FullyShardedDataParallel: FullyShardedDataParallel.clip_grad_norm_}

    def recording(original: Any) -> Any:
        def clip(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            depth[0] += 1
            try:
                norm = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                norms.append(norm.detach().clone())
            return norm
        return clip

    OSS.clip_grad_norm = recording(originals[OSS])  # type: ignore[method-assign]
    FullyShardedDataParallel.clip_grad_norm_ = recording(originals[FullyShardedDataParallel])  # type: ignore[method-assign]
    try:
        yield norms
    finally:
        OSS.clip_grad_norm = originals[OSS]  # type: ignore[method-assign]
        FullyShardedDataParallel.clip_grad_norm_ = originals[FullyShardedDataParallel]  # type: ignore[method-assign]


def clip_with_fed_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm: torch.Tensor | float) -> torch.Tensor:
    """torch's clipping of ``parameters`` by ``max_norm`` with ``norm`` as the total norm."""
    total = norm if isinstance(norm, torch.Tensor) else torch.tensor(norm, dtype=torch.float32)
    torch.nn.utils.clip_grads_with_norm_(list(parameters), max_norm, total)
    return total
