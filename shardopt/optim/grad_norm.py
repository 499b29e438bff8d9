"""The arithmetic of sharded clipping: a global gradient norm from gradients spread over ranks.

Note [sharded norm in torch's order]
Each rank takes the norm of each gradient it holds, the ranks exchange those per-parameter
norms in one small all-reduce (one slot per parameter plus one "counted" flag), and every
rank combines them in the order ``torch.nn.utils.clip_grad_norm_`` would on the full
gradients: grouped by (device, dtype), then the order of the slots. The slots follow the
parameters the caller passed (``torch.nn.utils.clip_grad_norm_(model.parameters())``), or,
for ``OSS.clip_grad_norm``, the module's order when a ShardedDataParallel wraps the OSS
(its param groups may list the parameters in another order: summing in group order was
2.4e-7 off DDP's norm). Summing in torch's order over the same gradients is what makes the
sharded total equal torch's bit for bit, mixed dtypes included. Only the gradients a rank
holds are scaled; the other ranks scale theirs. A parameter split across ranks (Note [split
plan] in :mod:`shardopt.partition`) has one extra slot per block, filled by the block's
owner; after the exchange its norm is the norm of its blocks' norms (the same value up to
rounding: every element counted once, but not by torch's single kernel, so a clip over split
parameters is within the summation error of torch's rather than bit for bit; nothing split,
nothing changes). A passed parameter that no optimizer shards
(a plain one) counts with this rank's own gradient, as torch counts it, outside the
exchange.

Note [clip on some ranks only]
A clip that one rank calls and another does not would leave the caller in its all-reduce
and the other in whatever collective it reaches next (the step's parameter gather): a hang,
or two different collectives matched. So before the exchange every rank checks in on the
default store (:func:`shardopt.agreement.arrive`) and waits at most :data:`ARRIVAL_TIMEOUT_S`
for the others; a rank that waits longer raises, naming the rule, and ranks stuck in
another collective end with a named error once it reports the failure (Note [failure
board] in :mod:`shardopt.failures`). Cost: two store round trips per clip and rank, once
per step. Measured on a loaded 2-core machine, 2 gloo ranks, a small MLP: a clip took 3.4
ms before and 6.2 ms after with torch's TCPStore (torchrun's), 0.9 and 13 ms with the
FileStore of ``shardopt.testing.run_ranks`` (whose wait polls).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from shardopt import comm
from shardopt.agreement import arrive
from shardopt.clipping import ClipArgs
from shardopt.optim.masters import is_placeholder, needs_master
from shardopt.partition import SplitPlan

__all__ = ["ARRIVAL_TIMEOUT_S", "ShardingOptimizer", "clip_for_wrapper", "clip_params", "clip_sharded_grads"]

ARRIVAL_TIMEOUT_S = 30.0
"""How long a sharded clip waits for every rank to call it (Note [clip on some ranks only])."""

_LABEL = "shardopt::clip::grad_norm"


class ShardingOptimizer(Protocol):
    """What a clip reads of a sharded optimizer (:class:`~shardopt.optim.OSS`)."""

    @property
    def params(self) -> tuple[torch.Tensor, ...]: ...
    @property
    def master_dtype(self) -> torch.dtype | None: ...
    @property
    def group(self) -> comm.ProcessGroup | None: ...
    @property
    def plan(self) -> SplitPlan: ...
    @property
    def rank(self) -> int: ...
    def owns(self, index: int) -> bool: ...
    def master_of(self, param: torch.Tensor) -> torch.Tensor | None: ...
    def grad_holder(self, param: torch.Tensor) -> torch.Tensor | None: ...
    def collect_master_grads(self) -> None: ...


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


def _norms_into(exchange: torch.Tensor, grads: Mapping[int, torch.Tensor], count: int, args: ClipArgs) -> None:
    """Write each gradient's norm into its slot of ``exchange`` and mark the slot counted."""
    by_kind: dict[tuple[str, torch.dtype], list[int]] = {}
    for i, grad in grads.items():
        by_kind.setdefault((str(grad.device), grad.dtype), []).append(i)
    for indices in by_kind.values():
        tensors = [grads[i] for i in indices]
        if args.foreach is False:
            norms = [torch.linalg.vector_norm(t, args.norm_type) for t in tensors]
        else:  # the same per-tensor kernel torch's clip uses (a per-tensor loop on the CPU)
            norms = list(torch._foreach_norm(tensors, args.norm_type))
        for i, n in zip(indices, norms, strict=True):
            exchange[i] = n.to(exchange.device)  # a device value into a device tensor: no host read
            exchange[count + i : count + i + 1].fill_(1)  # a slice: no host read (Note [host reads per step])


def clip_sharded_grads(
    grads: Mapping[int, torch.Tensor],
    kinds: Sequence[tuple[torch.device, torch.dtype]],
    dtype: torch.dtype,
    args: ClipArgs,
    group: comm.ProcessGroup | None,
    local: Mapping[int, torch.Tensor] | None = None,
    blocks: Mapping[int, tuple[int, int, torch.Tensor | None]] | None = None,
) -> torch.Tensor:
    """Clip sharded gradients by their global norm (Note [sharded norm in torch's order]).

    A collective: call on every rank of ``group`` (Note [clip on some ranks only]).

    Args:
        grads: the sharded gradients this rank holds, counts and scales, by slot.
        kinds: the (device, dtype) of every slot's gradient; the same on every rank.
        dtype: the dtype to exchange and combine the norms in (torch's: the promoted dtype
            of the gradients).
        args: the clip's max norm, norm type and options.
        group: the ranks that hold the gradients together.
        local: gradients counted and scaled by this rank only (plain parameters), by slot.
        blocks: the slots of parameters split across ranks, as ``{slot: (number of blocks,
            position of this rank's block among them, its gradient or None)}``; each such
            slot's norm is combined from its blocks' norms after the exchange. Split slots have
            no entry in ``grads``; their blocks' gradients are scaled with the rest.

    Returns:
        The total norm, in ``dtype``, on the device of the first slot.

    Raises:
        RuntimeError: another rank did not call it within :data:`ARRIVAL_TIMEOUT_S`, or
            ``args.error_if_nonfinite`` and the total norm is nan or inf (on every rank).
    """
    device = kinds[0][0] if kinds else torch.device("cpu")
    count = len(kinds)
    norm_type = float(args.norm_type)
    split = dict(sorted((blocks or {}).items()))
    first_block, cursor = {}, 2 * count
    for slot, (num_blocks, _, _) in split.items():
        first_block[slot] = cursor
        cursor += num_blocks
    exchange = torch.zeros(cursor, dtype=dtype, device=device)
    _norms_into(exchange, grads, count, args)
    for slot, (_, position, grad) in split.items():
        if grad is not None:  # this rank's block: its norm in its own slot, and the parameter counted
            norm = torch.linalg.vector_norm(grad, norm_type)
            exchange[first_block[slot] + position] = norm.to(exchange.device)
            exchange[count + slot : count + slot + 1].fill_(1)
    if comm.group_size(group) > 1:
        _check_everyone_clips(group)
        comm.all_reduce(exchange, group, op="sum", label=_LABEL).wait()
    _norms_into(exchange, local or {}, count, args)
    for slot, (num_blocks, _, _) in split.items():
        start = first_block[slot]
        exchange[slot] = torch.linalg.vector_norm(exchange[start : start + num_blocks], norm_type)
    # Which slots any rank counted decides which norms torch would stack, and in what order.
    counted = (exchange[count : 2 * count] > 0).nonzero().flatten().tolist()  # host-read: the clip's one
    if counted:  # no gradient anywhere: torch's total is 0 too
        # Stacked from integer views: a Python list as an index would be copied to the device.
        ordered = torch.stack([exchange[i] for i in _torch_norm_order(counted, kinds)])
        total = torch.linalg.vector_norm(ordered, norm_type)
    else:
        total = torch.zeros((), dtype=dtype, device=device)
    if args.error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):  # host-read: as torch's
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped (on every rank: the norm is global). To disable this error and scale the gradients by "
            "the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(args.max_norm / (total + 1e-6), max=1.0)
    held_blocks = [g for _, _, g in split.values() if g is not None]
    for g in [*grads.values(), *(local or {}).values(), *held_blocks]:
        g.mul_(coef.to(g.device))
    return total


def _check_everyone_clips(group: comm.ProcessGroup | None) -> None:
    """Raise unless every rank of ``group`` reaches this clip (Note [clip on some ranks only])."""
    missing = arrive(_LABEL, group, ARRIVAL_TIMEOUT_S)
    if missing:
        raise RuntimeError(
            f"[rank {comm.group_rank(group)}] gradient clipping over sharded gradients was called on this rank, "
            f"but group rank(s) {missing} did not call it within {ARRIVAL_TIMEOUT_S:g} s: each rank holds only part "
            "of the gradients, so the global norm needs every rank. Call torch.nn.utils.clip_grad_norm_ (or "
            "OSS.clip_grad_norm) on every rank, as with DDP, not under `if rank == 0`"
        )


def clip_params(
    optimizers: Sequence[ShardingOptimizer],
    params: Sequence[torch.Tensor],
    args: ClipArgs,
    keep: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``params`` by their global norm, summed in the order passed.

    A collective over the optimizers' group: call on every rank with the same ``params``.
    How it works: each passed parameter is a slot (Note [sharded norm in torch's order]);
    a parameter of one of ``optimizers`` counts on its owner, with its master's gradient
    when it has one (owned ``.grad`` folded in first); any other parameter counts with this
    rank's own ``.grad``, as torch would.

    Args:
        optimizers: the sharded optimizers over (some of) ``params``, with one group.
        params: the parameters to clip, in the order to sum their norms.
        args: the clip's max norm, norm type and options.
        keep: optional filter of the owned parameters that count (``OSS.clip_grad_norm``'s
            ``filter_params_fn``); it receives and returns a list of parameters.

    Returns:
        The total norm (see :func:`clip_sharded_grads`).
    """
    where: dict[torch.Tensor, tuple[ShardingOptimizer, int]] = {}
    for opt in optimizers:
        opt.collect_master_grads()
        where.update({p: (opt, i) for i, p in enumerate(opt.params)})
    kinds: list[tuple[torch.device, torch.dtype]] = []
    held: dict[int, torch.Tensor] = {}
    split: dict[int, tuple[int, int, torch.Tensor | None]] = {}
    local: dict[int, torch.Tensor] = {}
    promoted: list[torch.dtype] = []
    for slot, p in enumerate(params):
        found = where.get(p)
        if found is None:  # the same kinds and dtype on every rank, whoever has a gradient
            kinds.append((p.device, p.dtype))
            if p.requires_grad:
                promoted.append(p.dtype)
            if p.grad is not None and not is_placeholder(p):
                local[slot] = p.grad.detach()
            continue
        opt, i = found
        master = opt.master_dtype
        grad_dtype = master if master is not None and needs_master(p.dtype, master) else p.dtype
        kinds.append((p.device, grad_dtype))
        if p.requires_grad:
            promoted.append(grad_dtype)
        pieces = opt.plan.blocks_of(i)
        holder = (opt.grad_holder(p) if p.requires_grad else p) if opt.owns(i) else None
        grad = None if holder is None or holder.grad is None else holder.grad.detach()
        if len(pieces) > 1:
            position = next((k for k, b in enumerate(pieces) if opt.owns(i) and b.owner == opt.rank), -1)
            split[slot] = (len(pieces), position, grad)
        elif grad is not None:
            held[slot] = grad
    if keep is not None:
        kept = set(keep([params[s] for s in [*held, *(s for s, b in split.items() if b[2] is not None)]]))
        held = {s: g for s, g in held.items() if params[s] in kept}
        split = {s: (n, k, g if params[s] in kept else None) for s, (n, k, g) in split.items()}
    dtype = functools.reduce(torch.promote_types, promoted or [torch.float32])
    group = optimizers[0].group if optimizers else None
    return clip_sharded_grads(held, kinds, dtype, args, group, local, split)


def clip_for_wrapper(wrapper: Any, params: list[torch.Tensor], args: ClipArgs) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over the parameters of a wrapper with ``sharded_optimizers``
    (ShardedDataParallel), or of an OSS itself (Note [clipping that bypasses the wrapper] in
    :mod:`shardopt.clipping`): :func:`clip_params` over its optimizers."""
    return clip_params(getattr(wrapper, "sharded_optimizers", None) or [wrapper], params, args)
