"""Moving OSS's optimizer state between ranks: entries keyed by parameter index and rows.

OSS keeps the state of the rows a rank owns as ``{index in OSS.params: {name: value}}``
(masters included, under ``MASTER_KEY``); with the rows each entry covers that is a set of
:data:`Fragments` (a whole parameter is one fragment of all its rows). These functions move
fragments to their new owners after a re-partition (cut or joined to the new blocks), and
collect every rank's onto one rank (or all), joined into whole parameters, for a
consolidated state dict. Bookkeeping only: every transfer goes through :mod:`shardopt.comm`,
one rank's entries at a time, so no rank holds more than its own and one other rank's.

Note [state rows]
An elementwise optimizer's state for a block of rows is that block of the state it would
keep for the whole parameter: every tensor of at least one dimension whose dim 0 is the
block's row count is per row (``exp_avg``, ``momentum_buffer``, a master), and anything else
(the 0-dim ``step``, ASGD's ``eta`` and ``mu``, plain numbers) is the same for every block of
the parameter, as every block takes the same steps. So a fragment is cut by slicing its
per-row tensors, and fragments are joined by concatenating them in row order and taking the
rest from the first. A whole parameter's single fragment passes unchanged (no copy).
"""

from __future__ import annotations

import enum
import itertools
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardopt import comm
from shardopt.partition import SplitPlan
from shardopt.state_checks import MASTER_KEY

__all__ = ["Fragments", "Gap", "Missing", "Rows", "Snapshot", "StateByIndex", "assemble", "collect", "compact",
           "cut_rows", "dropped", "join_rows", "migrate", "no_snapshot_error", "refuse_stale_masters",
           "state_to_param", "to_cpu"]

StateByIndex = dict[int, dict[str, Any]]
Rows = tuple[int, int]
"""Rows ``[start, stop)`` of dim 0 of a parameter."""
Fragments = dict[tuple[int, int, int], dict[str, Any]]
"""State entries keyed ``(index in OSS.params, row start, row stop)`` (Note [state rows])."""


def _per_row(value: Any, num_rows: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == num_rows


def cut_rows(state: Mapping[str, Any], rows: Rows, wanted: Rows) -> dict[str, Any]:
    """The part of ``state`` (covering ``rows``) for the rows ``wanted`` inside them (Note [state rows]).

    Per-row tensors are sliced (views, no copy); the rest is shared. ``wanted == rows``
    returns the entries as they are.
    """
    if wanted == rows:
        return dict(state)
    if not rows[0] <= wanted[0] <= wanted[1] <= rows[1]:
        raise ValueError(f"rows {wanted} are not inside the fragment's rows {rows}")
    lo, hi = wanted[0] - rows[0], wanted[1] - rows[0]
    return {k: v[lo:hi] if _per_row(v, rows[1] - rows[0]) else v for k, v in state.items()}


def join_rows(parts: Iterable[tuple[Rows, Mapping[str, Any]]], index: int) -> tuple[Rows, dict[str, Any]]:
    """Join contiguous fragments of parameter ``index`` into one (Note [state rows]).

    Raises:
        ValueError: the fragments leave a gap, overlap, or hold different state names.
    """
    ordered = sorted(parts, key=lambda part: part[0])
    if not ordered:
        raise ValueError(f"no state fragments to join for parameter {index}")
    (start, stop), first = ordered[0]
    if len(ordered) == 1:
        return (start, stop), dict(first)
    for (rows, entry), (next_rows, next_entry) in itertools.pairwise(ordered):
        if rows[1] != next_rows[0] or set(entry) != set(next_entry):
            raise ValueError(f"state fragments of parameter {index} do not join: rows {rows} then {next_rows}, names "
                             f"{sorted(entry)} then {sorted(next_entry)}; the state was saved from another plan and is "
                             "incomplete")
    joined = {}
    for name, value in first.items():
        if all(_per_row(entry[name], r1 - r0) for (r0, r1), entry in ordered):
            joined[name] = torch.cat([entry[name].to(value.device) for _, entry in ordered])
        else:
            joined[name] = value
    return (start, ordered[-1][0][1]), joined


def _overlap(rows: Rows, other: Rows) -> Rows | None:
    """The rows both cover (an empty parameter's ``(0, 0)`` overlaps itself), or None."""
    if rows == other == (rows[0], rows[0]):
        return rows
    lo, hi = max(rows[0], other[0]), min(rows[1], other[1])
    return (lo, hi) if lo < hi else None


def assemble(parts: Iterable[tuple[int, Rows, Mapping[str, Any]]], wanted: Mapping[int, Rows]) -> StateByIndex:
    """For each index in ``wanted``, the state of exactly those rows from the fragments that
    overlap them (cut and joined); indices no fragment covers are left out.

    Raises:
        ValueError: fragments cover only part of a wanted block.
    """
    pieces: dict[int, list[tuple[Rows, dict[str, Any]]]] = {}
    for index, rows, entry in parts:
        target = wanted.get(index)
        common = None if target is None else _overlap(rows, target)
        if common is not None:
            pieces.setdefault(index, []).append((common, cut_rows(entry, rows, common)))
    out: StateByIndex = {}
    for index, found in pieces.items():
        rows, joined = join_rows(found, index)
        if rows != wanted[index]:
            raise ValueError(f"the state of parameter {index} covers rows {rows}, not the rows {wanted[index]} this "
                             "rank owns; the fragments are incomplete (saved from another plan?)")
        out[index] = joined
    return out


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it when it is a view of a larger storage (a flat buffer: Note
    [flat masters] in :mod:`shardopt.optim.flat_masters`): pickled, saved or kept, a view
    carries or keeps alive its whole storage."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached, on the CPU and compact (CPU tensors that own their
    storage are not copied; views of a flat buffer are)."""
    if isinstance(obj, torch.Tensor):
        return compact(obj.detach().cpu())
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def state_to_param(state: dict[str, Any], param: torch.Tensor, group: dict[str, Any],
                   device: torch.device | None = None) -> dict[str, Any]:
    """Put one parameter's state tensors where its optimizer expects them.

    Per-element tensors go to ``device``, by default the parameter's (keeping their dtype;
    an offloading OSS passes its host device: Note [offloaded masters] in
    :mod:`shardopt.optim.masters`). Scalars (``step``) stay on the CPU unless the group is
    ``capturable`` or ``fused``, as ``torch.optim`` keeps them.
    """
    on_device = bool(group.get("capturable") or group.get("fused"))
    where = param.device if device is None else device
    return {
        k: v.to(where) if isinstance(v, torch.Tensor) and (v.dim() > 0 or on_device) else v
        for k, v in state.items()
    }


def migrate(local: Fragments, plan: SplitPlan, rank: int, world_size: int,
            group: comm.ProcessGroup | None) -> StateByIndex:
    """Send each fragment, or the part of it, that another rank owns under ``plan`` there;
    return the state of this rank's blocks of ``plan`` (its own kept, others' received, cut
    and joined to the blocks: Note [state rows]). A collective: one broadcast per rank."""
    mine = {b.param: (b.row_start, b.row_stop) for b in plan.blocks_of_rank(rank)}
    parts: list[tuple[int, Rows, Mapping[str, Any]]] = [(i, (a, b), s) for (i, a, b), s in local.items()]
    for src in range(world_size):
        outgoing = None
        if src == rank:
            outgoing = {key: to_cpu(s) for key, s in local.items()
                        if not (key[0] in mine and mine[key[0]][0] <= key[1] and key[2] <= mine[key[0]][1])}
        incoming = comm.broadcast_object(outgoing, src, group)
        if src != rank:
            parts.extend((i, (a, b), s) for (i, a, b), s in incoming.items())
    return assemble(parts, mine)


def collect(local: Fragments, recipient_rank: int, rank: int, world_size: int,
            group: comm.ProcessGroup | None) -> StateByIndex | None:
    """Every rank's fragments joined into whole parameters on ``recipient_rank`` (``-1``: on
    every rank), sorted by index; ``None`` on the other ranks. A collective: point to point
    to one recipient, or one broadcast per source rank for ``-1``."""
    merged: dict[int, list[tuple[Rows, dict[str, Any]]]] = {}
    for src in range(world_size):
        shard: Fragments | None = None
        if recipient_rank == -1:
            shard = comm.broadcast_object(local if src == rank else None, src, group)
        elif src == recipient_rank == rank:
            shard = local
        elif src == recipient_rank:
            continue
        elif rank == src:
            comm.send_object(local, recipient_rank, group)
        elif rank == recipient_rank:
            shard = comm.recv_object(src, group)
        if shard is not None:
            for (i, a, b), entry in shard.items():
                merged.setdefault(i, []).append(((a, b), entry))
    if recipient_rank not in (-1, rank):
        return None
    return {i: join_rows(parts, i)[1] for i, parts in sorted(merged.items())}


@dataclass(frozen=True)
class Snapshot:
    """A consolidated optimizer state and the parameters' version counters when it was taken.

    Note [snapshot freshness]
    Consolidating is a collective, so ``OSS.state_dict()`` (called by Accelerate, Lightning,
    the Trainer at their own time) cannot retake it. What changes without a collective is
    read at ``state_dict()`` time: the groups' hyperparameters (a scheduler built after the
    consolidation sets the warm-up lr; a first step was measured at 2e-3 instead of 0
    through Accelerate's ``prepare``). What a collective changes (``step``,
    ``load_state_dict``, ``add_param_group``, ``refresh_trainable``) drops the snapshot, and
    ``state_dict()`` refuses, as fairscale's ``OSS.state_dict`` does without a
    consolidation. With masters, a parameter written after the consolidation with another
    value (a weight load; not DDP's broadcast of the same value) makes its master follow at
    the next step, so a snapshot whose master no longer rounds to its parameter is refused.
    """

    state: StateByIndex
    versions: tuple[int, ...]


def refuse_stale_masters(snapshot: Snapshot, params: Sequence[torch.Tensor], rank: int) -> None:
    """Raise if a parameter was written after ``snapshot`` with a value its master does not
    round to (Note [snapshot freshness]); a host read, only for parameters written since.

    Raises:
        RuntimeError: naming the first such parameter and ``consolidate_state_dict``.
    """
    for i, (p, version) in enumerate(zip(params, snapshot.versions, strict=True)):
        master = snapshot.state.get(i, {}).get(MASTER_KEY)
        if p._version == version or master is None:
            continue
        if not torch.equal(master.to(p.dtype), p.detach().cpu()):  # host-read: in state_dict(), after a write only
            raise RuntimeError(
                f"[rank {rank}] OSS.state_dict(): parameter {i} was written after consolidate_state_dict(), so "
                "the consolidated fp32 masters are stale; call optimizer.consolidate_state_dict(recipient_rank) "
                "on every rank again (after loading weights), or state_dict(all_ranks=True) on every rank "
                "(Note [snapshot freshness] in shardopt.optim.state_transport)"
            )


class Gap(enum.Enum):
    """Why an OSS holds no consolidated state on this rank: what ``OSS.state_dict()`` reports."""

    NEVER = "consolidate_state_dict() was never called on this optimizer"
    STEPPED = "step() ran after the last consolidate_state_dict()"
    LOADED = "a state was loaded (load_state_dict or a sharded checkpoint) after the last consolidate_state_dict()"
    REPARTITIONED = ("parameters were added or frozen/unfrozen (add_param_group, refresh_trainable) after the last "
                     "consolidate_state_dict()")
    ELSEWHERE = "the last consolidate_state_dict() collected the state on another rank"


@dataclass(frozen=True)
class Missing:
    """No consolidated state on this rank, and why (Note [snapshot freshness]).

    Attributes:
        gap: what happened instead of (or since) a consolidation onto this rank.
        recipient_rank: with ``Gap.ELSEWHERE``, the rank that holds the state.
    """

    gap: Gap
    recipient_rank: int | None = None


def dropped(current: Snapshot | Missing, gap: Gap) -> Snapshot | Missing:
    """What replaces ``current`` after a step, load or re-partition (``gap``): a consolidation
    that never happened stays the reason given."""
    return current if current == Missing(Gap.NEVER) else Missing(gap)


# Note [naming the integration in the state_dict error]
# Accelerate, the Hugging Face Trainer and Lightning call ``optimizer.state_dict()`` at their
# own time without a consolidation first: Accelerate's ``prepare`` round-trips the state
# dict to place it on the device (``AcceleratedOptimizer.__init__``) and ``save_state``
# reads it on every rank (``accelerate.checkpointing``); the Trainer goes through the same
# ``prepare``; Lightning's plain strategies read it in ``optimizer_state``. Consolidating is
# a collective, so ``state_dict()`` cannot take one there (a rank calling it alone would
# hang), and "call consolidate_state_dict" is no fix for a user who never makes that call:
# the fix is shardopt's integration for that framework, which consolidates where the
# framework needs it. The caller's stack tells which framework called: a frame of the
# framework's module names it, and a frame of ``shardopt.integrations`` means shardopt's
# own integration is in charge (no hint). Read only on the error path.
_ROUTES = (
    (("transformers.trainer",), "a plain transformers.Trainer",
     "use shardopt.integrations.transformers.ShardedTrainer (sharding=Sharding(stage=1 or 2)), which consolidates "
     "where the Trainer reads the state"),
    (("lightning.", "pytorch_lightning."), "a Lightning strategy that is not shardopt's",
     "use Trainer(strategy='shardopt_zero1' or 'shardopt_zero2') after import shardopt.integrations.lightning, which "
     "consolidates where Lightning reads the state"),
    (("accelerate.accelerator",), "a plain accelerate.Accelerator (in prepare or save_state)",
     "use shardopt.integrations.accelerate.ShardedAccelerator (the same arguments), which prepares an OSS "
     "without the state round trip and consolidates in save_state"),
)
_MAX_FRAMES = 40


def _route(frame: types.FrameType | None) -> tuple[str, str] | None:
    """``(who called, the fix)`` when a framework without shardopt's integration called
    ``state_dict()`` from ``frame`` up (Note [naming the integration in the state_dict error])."""
    modules: list[str] = []
    while frame is not None and len(modules) < _MAX_FRAMES:
        modules.append(str(frame.f_globals.get("__name__", "")))
        frame = frame.f_back
    if any(m.startswith("shardopt.integrations") for m in modules):
        return None
    for prefixes, who, fix in _ROUTES:
        if any(m.startswith(prefixes) for m in modules):
            return who, fix
    return None


def no_snapshot_error(missing: Missing, rank: int, caller: types.FrameType | None) -> RuntimeError:
    """The error of ``OSS.state_dict()`` without a consolidated state on this rank: why, and
    the fix (shardopt's integration when a framework called it, Note [naming the integration
    in the state_dict error]).

    Args:
        missing: why there is no state.
        rank: this rank, for the message.
        caller: the frame that called ``state_dict()``.

    Returns:
        The RuntimeError to raise.
    """
    why = missing.gap.value
    if missing.gap is Gap.ELSEWHERE:
        why = f"the last consolidate_state_dict() collected the state on rank {missing.recipient_rank}, not this rank"
    head = f"[rank {rank}] OSS.state_dict() has no consolidated state ({why})"
    route = _route(caller)
    if route is not None:
        who, fix = route
        return RuntimeError(f"{head}; it was called by {who}, which reads the state dict on every rank without "
                            f"consolidating it first (a collective): {fix}")
    if missing.gap is Gap.ELSEWHERE:
        return RuntimeError(f"{head}: call state_dict() on rank {missing.recipient_rank}, or "
                            "consolidate_state_dict(recipient_rank=-1) on every rank to have it on every rank")
    return RuntimeError(f"{head}: call optimizer.consolidate_state_dict(recipient_rank) on every rank first (after "
                        "the last step), then state_dict() on the recipient, or state_dict(all_ranks=True) on every "
                        "rank")
