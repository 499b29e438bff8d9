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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from shardopt.nn import FullyShardedDataParallel

# Both norms are fp32 sums of squares over at most ~1e5 elements. torch's CPU reductions
# accumulate in vector lanes and combine them pairwise, so each sum is within about
# log2(n) * 2**-24 (< 1.1e-6 relative, n <= 2**18) of the exact one, and the square root halves
# a relative error. One ulp of the norm is 6e-8 relative; a norm that misses a rank's piece
# is off by tens of percent.
NORM_RTOL = 1e-6


@contextmanager
def recorded_fsdp_clip_norms() -> Iterator[list[torch.Tensor]]:
    """Record every total norm ``FullyShardedDataParallel.clip_grad_norm_`` returns, in order."""
    norms: list[torch.Tensor] = []
    original = FullyShardedDataParallel.clip_grad_norm_

    def recording(self: FullyShardedDataParallel, *args: Any, **kwargs: Any) -> torch.Tensor:
        norm = original(self, *args, **kwargs)
        norms.append(norm.detach().clone())
        return norm

    FullyShardedDataParallel.clip_grad_norm_ = recording  # type: ignore[method-assign]
    try:
        yield norms
    finally:
        FullyShardedDataParallel.clip_grad_norm_ = original  # type: ignore[method-assign]


def clip_with_fed_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm: torch.Tensor | float) -> torch.Tensor:
    """torch's clipping of ``parameters`` by ``max_norm`` with ``norm`` as the total norm."""
    total = norm if isinstance(norm, torch.Tensor) else torch.tensor(norm, dtype=torch.float32)
    torch.nn.utils.clip_grads_with_norm_(list(parameters), max_norm, total)
    return total
