"""The arithmetic of ``OSS.clip_grad_norm``: a global gradient norm from sharded gradients.

Note [sharded norm in torch's order]
Each rank takes the norm of each gradient it holds, the ranks exchange those per-parameter
norms in one small all-reduce (one slot per parameter plus one "counted" flag), and every
rank combines them in the order ``torch.nn.utils.clip_grad_norm_`` would on the full
gradients: grouped by (device, dtype), then parameter order. Summing in torch's order is
what makes the sharded total equal torch's bit for bit, mixed dtypes included. Only the
gradients a rank holds are scaled; the other ranks scale theirs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from shardopt import comm

__all__ = ["clip_sharded_grads"]


def _torch_norm_order(indices: list[int], kinds: Sequence[tuple[torch.device, torch.dtype]]) -> list[int]:
    """``indices`` in the order ``torch.nn.utils.clip_grad_norm_`` stacks their norms.

    torch groups the gradients by (device, dtype) with a private helper before taking the
    norms. Without the helper (a future torch), first-seen order is used.
    """
    try:
        from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
    except ImportError:  # pragma: no cover - depends on the torch version
        keys: dict[tuple[str, torch.dtype], int] = {}
        for i in indices:
            keys.setdefault((str(kinds[i][0]), kinds[i][1]), len(keys))
        return sorted(indices, key=lambda i: (keys[(str(kinds[i][0]), kinds[i][1])], i))
    probes: list[torch.Tensor | None] = [torch.empty(0, dtype=kinds[i][1], device=kinds[i][0]) for i in indices]
    grouped = _group_tensors_by_device_and_dtype([probes], with_indices=True)
    return [indices[j] for _, (_, positions) in grouped.items() for j in positions]


def clip_sharded_grads(
    grads: Mapping[int, torch.Tensor],
    kinds: Sequence[tuple[torch.device, torch.dtype]],
    dtype: torch.dtype,
    max_norm: float,
    norm_type: float,
    group: comm.ProcessGroup | None,
) -> torch.Tensor:
    """Clip sharded gradients by their global norm (Note [sharded norm in torch's order]).

    A collective: call on every rank of ``group``.

    Args:
        grads: the gradients this rank counts and scales, by global parameter index.
        kinds: the (device, dtype) of every parameter's gradient, by index; the same on
            every rank.
        dtype: the dtype to exchange and combine the norms in (torch's: the promoted dtype
            of the trainable parameters' gradients).
        max_norm: the largest allowed total norm.
        norm_type: the p of the p-norm; ``float('inf')`` for the max norm.
        group: the ranks that hold the gradients together.

    Returns:
        The total norm, in ``dtype``, on the device of the first parameter.
    """
    device = kinds[0][0] if kinds else torch.device("cpu")
    count = len(kinds)
    exchange = torch.zeros(2 * count, dtype=dtype, device=device)
    by_kind: dict[tuple[str, torch.dtype], list[int]] = {}
    for i, grad in grads.items():
        by_kind.setdefault((str(grad.device), grad.dtype), []).append(i)
    for indices in by_kind.values():
        # The same per-tensor kernel torch's clip uses (a per-tensor loop on the CPU).
        norms = torch._foreach_norm([grads[i] for i in indices], norm_type)
        for i, n in zip(indices, norms):
            exchange[i] = n.to(device)
            exchange[count + i] = 1
    comm.all_reduce(exchange, group, op="sum", label="shardopt::oss::clip_grad_norm").wait()
    counted = (exchange[count:] > 0).nonzero().flatten().tolist()  # one device sync, not one per param
    counted = _torch_norm_order(counted, kinds)
    if counted:
        total = torch.linalg.vector_norm(exchange[counted], norm_type)
    else:
        total = torch.zeros((), dtype=dtype, device=device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads.values():
        g.mul_(coef.to(g.device))
    return total
