"""Local gradient sums in the master dtype, for ShardedDataParallel's ``no_sync``.

Note [no_sync sums in master precision]
Under ``no_sync`` each rank accumulates its micro-batch gradients locally and reduces the
sum once. Left in a bf16 ``param.grad``, every micro-batch's addition would round to bf16's
8 bits of mantissa. With master weights, ShardedDataParallel instead moves each
low-precision gradient, as autograd finishes accumulating it, into a sum in the master dtype
(fp32) and frees ``param.grad``; the reduction then sends that sum. The cost: while
accumulating under ``no_sync``, every rank holds an fp32 sum for every trainable
low-precision parameter, 4 bytes per parameter where a bf16 ``.grad`` would hold 2 (the
whole model, not a shard: every rank has a local gradient for every parameter). The sums
are freed as they are copied into the reduction buckets. Accumulation without ``no_sync``
costs nothing extra: each backward is reduced at once and the owner adds into the fp32
master gradient.
"""

from __future__ import annotations

import torch

from shardopt.placeholders import leave_placeholder, take_placeholder

__all__ = ["LocalSums"]


class LocalSums:
    """Per-parameter local gradient sums in a wider dtype (Note [no_sync sums in master precision]).

    Args:
        sum_dtype_of: maps a parameter dtype to the dtype its local sum is kept in;
            parameters of other dtypes accumulate in ``.grad`` as usual.
    """

    def __init__(self, sum_dtype_of: dict[torch.dtype, torch.dtype]) -> None:
        self._sum_dtype_of = dict(sum_dtype_of)
        self._sums: dict[torch.Tensor, torch.Tensor] = {}
        self._own_dtype: set[torch.Tensor] = set()

    def keep_in_own_dtype(self, params: set[torch.Tensor]) -> None:
        """Also keep the local sums of ``params`` (split parameters, Note [split gradients
        behind placeholders] in :mod:`shardopt.nn.data_parallel.owner_grads`) out of
        ``.grad``, in their own dtype (no copy, no rounding)."""
        self._own_dtype = set(params)

    def __len__(self) -> int:
        return len(self._sums)

    @torch.no_grad()
    def keep(self, param: torch.Tensor) -> None:
        """Move ``param.grad`` into the parameter's sum (a no-op for other dtypes)."""
        grad = param.grad
        dtype = self._sum_dtype_of.get(param.dtype, param.dtype if param in self._own_dtype else None)
        if grad is None or dtype is None:
            return
        total = self._sums.get(param)
        if total is None:
            self._sums[param] = grad.detach().to(dtype)
        else:
            total.add_(grad.detach())
        param.grad = None

    @torch.no_grad()
    def take(self, param: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The parameter's local sum plus ``grad`` (either may be absent), removing the sum."""
        total = self._sums.pop(param, None)
        if total is None:
            return grad
        return total if grad is None else total.add_(grad.detach())

    def settle(self, param: torch.Tensor, master: torch.Tensor | None) -> None:
        """Before what is held for ``param`` is used: drop its local sum and its master's
        gradient if the placeholder left in ``param.grad`` is gone or was zeroed (Note
        [placeholders for moved gradients] in :mod:`shardopt.placeholders`)."""
        if not take_placeholder(param):
            self._sums.pop(param, None)
            if master is not None:
                master.grad = None

    def leave(self, param: torch.Tensor, master: torch.Tensor | None) -> None:
        """Leave a placeholder in ``param.grad`` when a local sum or a master gradient is held for it."""
        if param in self._sums or (master is not None and master.grad is not None):
            leave_placeholder(param)

    def items(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, sum)`` pairs still held."""
        return list(self._sums.items())

    def clear(self) -> None:
        """Drop every sum."""
        self._sums.clear()
