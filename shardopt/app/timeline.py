"""The collectives of one training step, with when each was issued and waited, for ``shardopt rehearse``.

:class:`TimelineRecorder` wraps shardopt's tensor collectives in :mod:`shardopt.comm` (every
collective shardopt's own modes launch goes through them; DDP's all-reduce does too under
the rehearsal's hook, :func:`shardopt.app.rehearse_build.deferred_all_reduce`) and
:meth:`shardopt.comm.PendingWork.wait`, on top of a
:class:`~shardopt.app.group_bytes.GroupBytes` that counts each call's bytes by group kind
(Note [bytes per group] there). Times are *compute* times: seconds since the step began,
less the time spent inside the collective calls and their waits (Note [compute time under
the fake group]). :mod:`shardopt.app.step_model` replays the timeline against a link.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from shardopt import comm
from shardopt.app.group_bytes import GROUP_KINDS, GroupBytes

__all__ = ["COLLECTIVES", "CollectiveCall", "StepTimeline", "TimelineRecorder"]

COLLECTIVES = ("all_gather_into", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "all_to_all_pieces",
               "exchange")
"""The :mod:`shardopt.comm` functions recorded (those :class:`GroupBytes` counts)."""

# Note [compute time under the fake group]
# Under torch's fake group a collective completes at once and moves nothing, but shardopt's
# calls still cost host time: on a fake (as on a gloo) group bulk data goes point to point,
# one send and one receive per peer (Note [gloo point to point] in shardopt.comm), so at
# N = 1024 one all-gather posts 2046 no-op messages. That is the faking, not the rank's
# work, so the recorder takes it out: compute time is wall time since the step began less
# the time spent inside the recorded calls and inside PendingWork.wait. On a GPU the
# recorder synchronises the device at each call's entry and exit (rehearsal only), so host
# time is device time there too.


@dataclass(frozen=True)
class CollectiveCall:
    """One collective call of a step.

    Attributes:
        op: the :mod:`shardopt.comm` function.
        label: the caller's label (``shardopt::<component>::<phase>``).
        group_size: ranks in its group.
        group_kind: ``world``, ``shard``, ``replicate`` or ``other`` (Note [bytes per group]).
        sent_bytes: what this rank sends (Note [bytes per group]).
        wire_bytes: what the link model charges: :attr:`sent_bytes`, except a broadcast,
            where every rank moves the whole tensor (the source sends it, the others receive it).
        issued_s: compute time at the call.
        waited_s: compute time when it was first waited, or ``None`` if not waited in the step.
        peers: for an all-to-all, the most other ranks this rank sends to or receives from
            in it (empty pieces are not messages: shardopt's point-to-point path skips them,
            as torch's NCCL all-to-all does); ``None`` for the other collectives.
    """

    op: str
    label: str
    group_size: int
    group_kind: str
    sent_bytes: float
    wire_bytes: float
    issued_s: float
    waited_s: float | None
    peers: int | None = None


@dataclass(frozen=True)
class StepTimeline:
    """One step's compute time and collectives.

    Attributes:
        wall_s: wall time of the step.
        compute_s: wall time less the time inside collective calls and waits.
        calls: the collectives, in issue order.
    """

    wall_s: float
    compute_s: float
    calls: tuple[CollectiveCall, ...]

    def bytes_by_kind(self) -> dict[str, float]:
        """Bytes this rank sent, by group kind (every kind of :data:`GROUP_KINDS`)."""
        out = dict.fromkeys(GROUP_KINDS, 0.0)
        for call in self.calls:
            out[call.group_kind] += call.sent_bytes
        return out


def _peers(name: str, bound: dict[str, Any], group: Any) -> int | None:
    """:attr:`CollectiveCall.peers` of an all-to-all call from its arguments; ``None`` otherwise."""
    if name == "all_to_all":
        sends, receives = list(bound["input_splits"]), list(bound["output_splits"])
    elif name == "all_to_all_pieces":
        sends, receives = [t.numel() for t in bound["inputs"]], [t.numel() for t in bound["outputs"]]
    else:
        return None
    me = comm.group_rank(group)
    return max(sum(1 for r, n in enumerate(counts) if n and r != me) for counts in (sends, receives))


class TimelineRecorder:
    """Record the collectives of the steps run inside :meth:`step`.

    Args:
        shard_size: S of a hybrid layout, or ``None`` (for the group kinds).
        device: the device the rank runs on (a GPU is synchronised at each event).
    """

    def __init__(self, shard_size: int | None, device: torch.device) -> None:
        self._bytes = GroupBytes(shard_size)
        self._sync = device.type == "cuda"
        self._start = 0.0
        self._excluded = 0.0
        self._depth = 0
        self._issued: list[dict[str, Any]] = []
        self._records: dict[int, int] = {}

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _compute(self, at: float) -> float:
        return at - self._start - self._excluded

    @contextmanager
    def _inside(self) -> Iterator[float]:
        """Time spent in the block is not compute; yields the compute time at entry."""
        outer = self._depth == 0
        enter = self._now() if outer else 0.0
        self._depth += 1
        try:
            yield self._compute(enter) if outer else -1.0
        finally:
            self._depth -= 1
            if outer:
                self._excluded += self._now() - enter

    def _wrap(self, name: str, call: Callable[..., comm.PendingWork],
              signature: inspect.Signature) -> Callable[..., comm.PendingWork]:

        def recorded(*args: Any, **kwargs: Any) -> comm.PendingWork:
            nested = self._depth > 0
            with self._inside() as at:
                before = self._bytes.snapshot()
                record = call(*args, **kwargs)
                after = self._bytes.snapshot()
            if nested:
                return record
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            sent = {k: after[k] - before[k] for k in GROUP_KINDS}
            kind = max(sent, key=lambda k: sent[k]) if any(sent.values()) else self._bytes.kind(group)
            tensor = bound.get("tensor")
            wire = float(tensor.numel() * tensor.element_size()) if name == "broadcast" and tensor is not None \
                else sum(sent.values())
            self._records[id(record)] = len(self._issued)
            self._issued.append({"op": name, "label": bound.get("label", name), "group_size": comm.group_size(group),
                                 "group_kind": kind, "sent_bytes": sum(sent.values()), "wire_bytes": wire,
                                 "issued_s": at, "waited_s": None, "peers": _peers(name, bound, group)})
            return record

        return recorded

    def _wait_wrapper(self, original: Callable[[comm.PendingWork], None]) -> Callable[[comm.PendingWork], None]:
        def wait(record: comm.PendingWork) -> None:
            index = self._records.pop(id(record), None)
            with self._inside() as at:
                original(record)
            if index is not None and at >= 0:
                self._issued[index]["waited_s"] = at

        return wait

    @contextmanager
    def installed(self) -> Iterator[TimelineRecorder]:
        """Wrap the collectives and ``PendingWork.wait`` inside the block, then put the originals back."""
        signatures = {name: inspect.signature(getattr(comm, name)) for name in COLLECTIVES}
        with self._bytes.installed():
            saved = {name: getattr(comm, name) for name in COLLECTIVES}
            saved_wait = comm.PendingWork.wait
            for name, call in saved.items():
                setattr(comm, name, self._wrap(name, call, signatures[name]))
            comm.PendingWork.wait = self._wait_wrapper(saved_wait)  # type: ignore[method-assign,assignment]
            try:
                yield self
            finally:
                comm.PendingWork.wait = saved_wait  # type: ignore[method-assign]
                for name, call in saved.items():
                    setattr(comm, name, call)

    @contextmanager
    def step(self, out: list[StepTimeline]) -> Iterator[None]:
        """Record the enclosed step (inside :meth:`installed`) and append its :class:`StepTimeline` to ``out``."""
        self._issued, self._records, self._excluded, self._depth = [], {}, 0.0, 0
        self._start = self._now()
        yield
        end = self._now()
        calls = tuple(CollectiveCall(**entry) for entry in self._issued)
        out.append(StepTimeline(end - self._start, self._compute(end), calls))
