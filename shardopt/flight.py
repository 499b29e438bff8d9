"""The flight recorder: ranks that wait too long say where they are, and name the rank elsewhere.

Note [flight recorder]
Ranks that run different programs (``step()`` on one rank only, a save on rank 0 only, a
parameter frozen on one rank only, LBFGS evaluating its closure a different number of times
per rank) block in different collectives. Without help each rank waits for the group
timeout (30 minutes by default) and then reads a transport error that names neither the
cause nor the fix. The recorder names them in seconds and costs nothing while collectives
complete on time:

* every shardopt collective on a group of several ranks gets the next number of that
  group's sequence (one dict update per launch), and :func:`note_launch` remembers the
  last one launched (one tuple assignment);
* a daemon thread per process (:class:`_Heartbeat`) bumps ``shardopt/beat/<rank>`` in the
  default group's store every :data:`BEAT_S` seconds, with the last collective launched;
* a gloo wait (which already runs in slices beside the work, Note [waiting beside the work]
  in ``waiting``) that lasts longer than :data:`GRACE_S` publishes this rank's position
  (``shardopt/flight/<rank>``: label, sequence number, group, sizes, since when) and from
  then on reads the other ranks' positions every slice (:class:`Watch`);
* a peer of the same group that waits at the same sequence number in another collective,
  or in the same one with other sizes, runs a different program: the wait raises a
  :class:`~shardopt.failures.CollectiveError` naming that rank, where it is and the likely
  cause, and reports it on the failure board so every other waiting rank ends too;
* a peer whose heartbeat has not moved for :data:`STALE_S` stopped progressing (SIGSTOP,
  a frozen machine): it is named with its last known collective (where it waits, if it
  published that, else the last one its last beat carried: up to :data:`BEAT_S` old, as
  writing on every launch would cost a store write per collective);
* a wait that the backend ends first (the group's timeout, e.g. 6 s, shorter than
  :data:`GRACE_S` + :data:`STALE_S`) names the ranks that left without a report in the
  same way (:func:`explain_left`): each with its last known collective, and as stopped
  when this wait saw its heartbeat stand still for :data:`STOPPED_AFTER_S` or more (a
  live rank beats every :data:`BEAT_S`). Before, such a wait said only "rank 1 left
  without a report", whether the rank had died or merely stopped, and not where it was.

A peer that is alive and not (yet) in a collective is slow, not wrong: the wait goes on.
Sequence numbers of peers in different collectives agree, because a point-to-point
collective's messages carry a tag derived from its label, number and byte count (``comm``):
two ranks in different collectives never exchange a byte, so gloo is never handed a message
of the wrong size (which aborts the process) and both stay at the same number.

What remains: gloo's own collectives (``all_reduce``, ``broadcast``, the object exchanges)
take gloo's tags, not ours, so two ranks in two different ones of the same algorithm and
size still exchange their data (both complete, with a wrong result), and of different
sizes gloo may abort the process before any check runs. shardopt uses them for small
tensors only (gradient norms, the inf check, startup broadcasts, checkpoint metadata). NCCL
waits are not sliced (a timed wait can abort its communicator), so they are not watched.
Measured cost: none on the hot path beyond the sequence count (``shardopt bench``, see
docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from shardopt import failures

__all__ = ["BEAT_S", "GRACE_S", "STALE_S", "STOPPED_AFTER_S", "Position", "Watch", "explain_left", "note_launch"]

GRACE_S = 2.0
"""How long a gloo wait runs before this rank publishes where it is and reads the others."""
BEAT_S = 1.0
"""Heartbeat period."""
STALE_S = 8.0
"""A peer whose heartbeat has not moved for this long stopped progressing."""
STOPPED_AFTER_S = 3 * BEAT_S
"""Once the backend has ended a wait (its timeout), a rank that left without a report and
whose heartbeat this wait saw stand still this long is named as stopped (three missed beats)."""

_FLIGHT = "shardopt/flight/"
_BEAT = "shardopt/beat/"


@dataclass(frozen=True)
class Position:
    """Where a rank waits: one collective of one group.

    Attributes:
        label: the collective's profiler label.
        seq: its number in the group's sequence.
        group: the global ranks of the group.
        sends: bytes sent to each peer (point-to-point collectives), by global rank.
        recvs: bytes expected from each peer, by global rank.
        size: bytes of the tensor (gloo's own collectives), or -1.
        since: wall-clock time the wait began (seconds since the epoch).
        partner: for a point-to-point object transfer (``seq`` -1), the other rank.
    """

    label: str
    seq: int
    group: tuple[int, ...]
    sends: dict[int, int] = field(default_factory=dict)
    recvs: dict[int, int] = field(default_factory=dict)
    size: int = -1
    since: float = 0.0
    partner: int = -1

    def encode(self) -> str:
        return json.dumps({"label": self.label, "seq": self.seq, "group": list(self.group), "size": self.size,
                           "sends": self.sends, "recvs": self.recvs, "since": self.since, "partner": self.partner})

    @staticmethod
    def decode(text: str) -> Position | None:
        if not text:
            return None
        raw = json.loads(text)
        return Position(raw["label"], int(raw["seq"]), tuple(raw["group"]),
                        {int(k): int(v) for k, v in raw["sends"].items()},
                        {int(k): int(v) for k, v in raw["recvs"].items()}, int(raw["size"]), float(raw["since"]),
                        int(raw["partner"]))

    def words(self) -> str:
        if self.partner >= 0:
            return f"{failures.describe(self.label)} with rank {self.partner}"
        return f"{failures.describe(self.label)} #{self.seq}"


_last: tuple[str, int] = ("", -1)


def note_launch(label: str, seq: int) -> None:
    """Remember the last collective launched (for the heartbeat); start the heartbeat once per
    process, except under a fake process group, whose store holds nothing."""
    global _last
    _last = (label, seq)
    if _HEARTBEAT.pid != os.getpid() and not failures.is_fake_group():  # Note [fake process group] in failures
        _HEARTBEAT.start()


class _Heartbeat:
    """A daemon thread that bumps this rank's beat in the store (Note [flight recorder])."""

    def __init__(self) -> None:
        self.pid = -1

    def start(self) -> None:
        self.pid = os.getpid()
        threading.Thread(target=self._run, name="shardopt-heartbeat", daemon=True).start()

    @staticmethod
    def _run() -> None:
        count = 0
        while True:
            store = failures.default_store()
            if store is not None:
                count += 1
                label, seq = _last
                try:
                    store.set(f"{_BEAT}{dist.get_rank()}", f"{count}|{seq}|{label}")
                except Exception:  # the store went with a peer, or the group was destroyed
                    pass
            time.sleep(BEAT_S)


_HEARTBEAT = _Heartbeat()


def _likely_cause(mine: str, theirs: str) -> str:
    """The usual reason two ranks are in these two collectives, with the fix."""
    pair = {"::".join(label.split("::")[1:3]) for label in (mine, theirs)}
    if len(pair) == 1 and mine.startswith("shardopt::fsdp::"):  # one phase, two units
        return ("the ranks ran different FSDP units: every rank must run the same units in the same order (a forward, "
                "e.g. evaluation, run on some ranks only, or a unit skipped by data-dependent control flow? Run it on "
                "every rank, or read the full parameters with summon_full_params() called on every rank)")
    if pair & {"oss::param_gather"} and pair & {"sdp::reduce"}:
        return ("step() ran on one rank only or twice on one rank, backward was skipped on one rank, no_sync was "
                "used on one rank only, or an optimizer closure (e.g. LBFGS) ran backward a different number of times "
                "per rank? Every rank must run the same forward, backward and step calls")
    if pair & {"fsdp::summon", "fsdp::optim_state", "checkpoint::save", "object::send", "object::recv"}:
        return ("a save, state_dict() or summon_full_params() ran on some ranks only, or a rank ran out of data "
                "first? They are collectives: call them on every rank (save_consolidated and "
                "state_dict(rank0_only=True) still write on rank 0 only), and give every rank the same number of "
                "batches (e.g. DistributedSampler(drop_last=True))")
    if pair & {"object::all_gather", "object::broadcast"}:
        return ("a save, state_dict(), or a change of the trainable parameters (requires_grad set on some ranks "
                "only) ran on some ranks only? Every rank must make these calls, and freeze the same parameters")
    if any(p.startswith("fsdp::") for p in pair):
        return ("a forward (e.g. evaluation) or backward ran on one rank only? Run it on every rank, or read the "
                "full parameters with summon_full_params() called on every rank")
    return ("a collective call on some ranks only, or uneven data (give every rank the same number of batches, "
            "e.g. DistributedSampler(drop_last=True))? Every rank must make the same shardopt calls in the same order")


class Watch:
    """One long wait: publishes this rank's position, then reads the others' every slice.

    Args:
        position: where this rank waits.
    """

    def __init__(self, position: Position) -> None:
        self._position = position
        self._rank = dist.get_rank()
        self._store = failures.default_store()
        self._beats: dict[int, tuple[str, float]] = {}
        self._started = time.monotonic()
        if self._store is not None:
            try:
                self._store.set(f"{_FLIGHT}{self._rank}", position.encode())
            except Exception:
                self._store = None

    def close(self) -> None:
        """The wait completed: take this rank's position off the store."""
        if self._store is not None:
            try:
                self._store.set(f"{_FLIGHT}{self._rank}", "")
            except Exception:
                pass

    def _read(self, key: str) -> str:
        assert self._store is not None
        return _read(self._store, key)

    def still_for(self, peer: int) -> float:
        """How long this wait has seen ``peer``'s heartbeat stand still, up to now (0 when it
        moved since it was last read, or was never read)."""
        if self._store is None or peer not in self._beats:
            return 0.0
        try:
            beat = self._read(f"{_BEAT}{peer}")
        except Exception:  # the store went with a peer
            return 0.0
        seen, since = self._beats[peer]
        return time.monotonic() - since if beat == seen else 0.0

    def problem(self) -> str | None:
        """Why the wait cannot complete, in words, or ``None`` while it still may."""
        if self._store is None:
            return None
        me = self._position
        try:
            for peer in ((me.partner,) if me.partner >= 0 else me.group):
                if peer == self._rank:
                    continue
                other = Position.decode(self._read(f"{_FLIGHT}{peer}"))
                why = self._compare(peer, other) if other is not None else None
                if why:
                    return why
                stopped = self._stopped(peer, other)
                if stopped:
                    return stopped
        except Exception:  # the store is gone with a peer: the failure board's path names it
            return None
        return None

    def _compare(self, peer: int, other: Position) -> str | None:
        """Why ``peer`` waiting at ``other`` and this rank cannot both complete, or ``None``."""
        me = self._position
        where = (f"rank {peer} is in {other.words()} while this rank is in {me.words()}: the ranks run different "
                 "programs")
        # One waits for the other in a point-to-point transfer while that one waits in a
        # collective of them both: neither can complete.
        if (me.partner < 0 and other.partner == self._rank) or (me.partner == peer and other.partner < 0
                                                                  and self._rank in other.group):
            return f"{where} ({_likely_cause(me.label, other.label)})"
        if me.partner >= 0 or other.partner >= 0 or other.group != me.group or other.seq != me.seq:
            return None
        if other.label != me.label:
            return f"{where} ({_likely_cause(me.label, other.label)})"
        theirs, mine = other.sends.get(self._rank, 0), me.recvs.get(peer, 0)
        if theirs != mine or (other.size != me.size and me.size >= 0):
            sizes = f"{theirs} vs {mine} bytes" if theirs != mine else f"{other.size} vs {me.size} bytes"
            return (f"rank {peer} is in the same collective ({me.words()}) with other sizes ({sizes}): the ranks' "
                    "models or settings differ (a parameter frozen or added on some ranks only, or a different "
                    "configuration)? Every rank must hold the same model with the same trainable parameters")
        return None

    def _stopped(self, peer: int, other: Position | None) -> str | None:
        beat = self._read(f"{_BEAT}{peer}")
        now = time.monotonic()
        last = self._beats.get(peer)
        if last is None or last[0] != beat:
            self._beats[peer] = (beat, now)
            return None
        if now - last[1] < STALE_S:
            return None
        return failures.stopped_words(peer, now - last[1], _where(other, beat))


def _read(store: Any, key: str) -> str:
    if not store.check([key]):
        return ""
    return bytes(store.get(key)).decode()


def _where(position: Position | None, beat: str) -> str:
    """A rank's last known collective in words: where it waits, else what its last beat carried."""
    if position is not None:
        return position.words()
    _, seq, label = ([*beat.split("|", 2), "", ""])[:3] if beat else ("", "-1", "")
    return f"{failures.describe(label)} #{seq}" if label else "no collective yet"


def explain_left(error: failures.CollectiveError, watch: Watch | None) -> failures.CollectiveError:
    """``error`` with what the flight recorder knows of the ranks that left without a report.

    Called when the backend ended a wait (a timeout, a closed connection) and no rank
    reported a failure: each rank of ``error.left`` gets its last known collective, and
    one whose heartbeat ``watch`` (this wait's, if it lasted past :data:`GRACE_S`) saw
    stand still for :data:`STOPPED_AFTER_S` or more is named as stopped (Note [flight
    recorder]).

    Args:
        error: the error :func:`shardopt.failures.collective_error` built.
        watch: this wait's watch, or ``None`` when it ended before the grace.

    Returns:
        The error to raise (``error`` itself when there is nothing to add).
    """
    store = failures.default_store()
    if not error.left or error.failed or error.why or store is None or failures.is_fake_group():
        return error
    last: dict[int, str] = {}
    stalled: dict[int, float] = {}
    for peer in error.left:
        try:
            last[peer] = _where(Position.decode(_read(store, f"{_FLIGHT}{peer}")), _read(store, f"{_BEAT}{peer}"))
        except Exception:  # the store went with a peer: nothing more is known
            continue
        still = watch.still_for(peer) if watch is not None else 0.0
        if still >= STOPPED_AFTER_S:
            stalled[peer] = still
    return failures.CollectiveError(error.rank, error.label, {}, error.left, error.cause, last=last, stalled=stalled)
