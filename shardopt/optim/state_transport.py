"""Moving OSS's optimizer state between ranks: entries keyed by parameter index.

OSS keeps the state of the parameters a rank owns as ``{index in OSS.params: {name: value}}``
(masters included, under ``MASTER_KEY``). These functions move such entries to their new
owners after a re-partition and collect every rank's entries onto one rank (or all) for a
consolidated state dict. Bookkeeping only: every transfer goes through :mod:`shardopt.comm`,
one rank's entries at a time, so no rank holds more than its own and one other rank's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardopt import comm
from shardopt.state_checks import MASTER_KEY

__all__ = ["Snapshot", "StateByIndex", "collect", "migrate", "refuse_stale_masters", "state_to_param", "to_cpu"]

StateByIndex = dict[int, dict[str, Any]]


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor detached and on the CPU (CPU tensors are not copied)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def state_to_param(state: dict[str, Any], param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
    """Put one parameter's state tensors where its optimizer expects them.

    Per-element tensors go to the parameter's device (keeping their dtype). Scalars
    (``step``) stay on the CPU unless the group is ``capturable`` or ``fused``, as
    ``torch.optim`` keeps them.
    """
    on_device = bool(group.get("capturable") or group.get("fused"))
    return {
        k: v.to(param.device) if isinstance(v, torch.Tensor) and (v.dim() > 0 or on_device) else v
        for k, v in state.items()
    }


def migrate(state: StateByIndex, owners: Sequence[int], rank: int, world_size: int,
            group: comm.ProcessGroup | None) -> StateByIndex:
    """Send each entry whose owner (``owners[index]``) is another rank to it; return the
    entries this rank owns now (its own kept, others' received). A collective."""
    kept = {i: s for i, s in state.items() if owners[i] == rank}
    for src in range(world_size):
        outgoing = None
        if src == rank:
            outgoing = {i: to_cpu(s) for i, s in state.items() if owners[i] != rank}
        incoming = comm.broadcast_object(outgoing, src, group)
        if src != rank:
            kept.update({i: s for i, s in incoming.items() if owners[i] == rank})
    return kept


def collect(local: StateByIndex, recipient_rank: int, rank: int, world_size: int,
            group: comm.ProcessGroup | None) -> StateByIndex | None:
    """Every rank's entries merged on ``recipient_rank`` (``-1``: on every rank), sorted by
    index; ``None`` on the other ranks. A collective: point to point to one recipient, or
    one broadcast per source rank for ``-1``."""
    merged: StateByIndex = {}
    for src in range(world_size):
        shard: StateByIndex | None = None
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
            merged.update(shard)
    return dict(sorted(merged.items())) if recipient_rank in (-1, rank) else None


@dataclass(frozen=True)
class Snapshot:
    """A consolidated optimizer state and the parameters' version counters when it was taken.

    Note [snapshot freshness]
    Consolidating is a collective, so ``OSS.state_dict()`` (called by Accelerate, Lightning,
    the Trainer at their own time) cannot retake it. What changes without a collective is
    read at ``state_dict()`` time: the groups' hyperparameters (a scheduler built after the
    consolidation sets the warm-up lr; issue 26 measured a first step at 2e-3 instead of 0
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
