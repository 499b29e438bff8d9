"""The failure board: ranks tell each other why a collective cannot complete.

Note [failure board]
A rank blocked in a collective learns nothing from a peer that raised, died or diverged but
a raw backend error ("Connection reset by peer", a SIGABRT-free but nameless "Timed out
waiting 10000ms for recv") or, when the peer stays alive, nothing at all until the
group's timeout. The board is a few keys in the default process group's store (the one
every rank already shares):

* a rank that fails reports itself (:func:`report_failure`: ``origin``, with its message);
  ``shardopt.testing.run_ranks`` and the ``shardopt`` command's ranks do this for any
  exception, and user code may call it too;
* a rank whose collective fails reports what it saw (``saw``) and waits a short grace for
  the others' reports; a rank that reports nothing within it has left (exited, was killed
  or is stuck elsewhere);
* on gloo, :class:`~shardopt.comm.PendingWork` waits in slices of
  :data:`WATCH_SLICE_S` beside a thread blocked in the backend's wait (Note [waiting
  beside the work] in ``waiting``) and reads the board's counter between slices, so a rank
  waiting on a peer that reported a failure ends within a slice, not the group timeout.

The resulting :class:`CollectiveError` names this rank, the shardopt operation (from the
profiler label, e.g. "ShardedDataParallel's gradient reduction of bucket 3") and the rank
that failed or left. Cost: nothing on the hot path while collectives finish within a
slice; a store read per slice while one waits longer. NCCL waits are not sliced (a timed
wait can abort its communicator); its errors are still named.

Note [collective sequence check]
With ``SHARDOPT_DEBUG_COLLECTIVES=1`` every shardopt collective first all-gathers, over
its group, the call's number on that group, its kind and its label, and raises on every
rank, naming the first rank whose call differs, before anything can deadlock or mix
buffers (as ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does for DDP). Cost: one small object
all-gather per collective; a 4 KiB all-reduce at 2 ranks on gloo went from 1.4 ms to
3.6 ms (2-core machine, other work running), so it is for debugging only.

Note [fake process group]
torch's fake process group (``init_process_group("fake", store=FakeStore(), rank=r,
world_size=N)``, from ``torch.testing._internal.distributed.fake_pg``) lets one process
build rank ``r`` of ``N`` with real allocations: its collectives complete at once and move
no data (an all-gather copies this rank's input into every slot, so an object all-gather
returns this rank's object ``N`` times). Its store implements nothing: ``set``, ``add``,
``check``, ``get`` and ``wait`` all raise. There are no peers to fail, leave or disagree,
so with the default group on backend ``"fake"`` (:func:`is_fake_group`):

* the board is off: :func:`report_failure` writes nothing, :func:`any_reported` is
  ``False``, and a collective that fails (which can only be the fake backend refusing a
  call, e.g. its list all-to-all with pieces of unequal sizes) raises a
  :class:`CollectiveError` that quotes the backend and names no rank as failed or left,
  instead of reading an empty board as "every other rank left";
* the flight recorder's heartbeat does not start (Note [flight recorder] in ``flight``);
* the construction-time agreement checks and :func:`shardopt.agreement.arrive` treat
  every peer as present and agreeing: they return at once, without a collective or a
  store key (Note [agree before the first collective] in ``agreement``).

Before this mode, ShardedDataParallel's first gradient reduction under a fake group of 4
ended in "rank 0 left (and ranks [2, 3])": the fake list all-to-all (``copy_`` of input
``i`` into output ``i``) refused shardopt's uneven pieces, and the board, finding no report
in a store that cannot hold one, named every peer. comm now sends bulk data point to point
on a fake group as on gloo (Note [gloo point to point] in ``comm``), where the fake
backend's sends and receives accept any sizes. A real group (gloo, NCCL) never takes these
branches: the test is the default group's backend name, read once per call. One process may
play several fake ranks in turn (``shardopt.fake_ranks``), so comm numbers collectives per
group object: a default group made after another counts from 0 (it used to go on from the
last one, and ranks forked from such a process started their real group at call #189).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

__all__ = ["CollectiveError", "describe", "is_fake_group", "report_failure", "stopped_words"]

WATCH_SLICE_S = 0.5
"""How long a gloo wait blocks before it reads the board again."""
GRACE_S = 1.5
"""How long a rank whose collective failed waits for the other ranks' reports."""
DEBUG_ENV = "SHARDOPT_DEBUG_COLLECTIVES"

_COUNT_KEY = "shardopt/failures"
_ORIGIN, _SAW = "origin", "saw"
_reported: set[int] = set()


class CollectiveError(RuntimeError):
    """A shardopt collective could not complete because a rank failed, left or diverged.

    Attributes:
        rank: this process's global rank.
        label: the operation's profiler label (``shardopt::<component>::<phase>``).
        failed: ranks that reported a failure of their own, with their messages.
        left: ranks that reported nothing (exited, killed, or stuck elsewhere).
        cause: the backend's own first line.
        last: for ranks of ``left``, their last known collective in words (the flight
            recorder's, Note [flight recorder] in ``flight``).
        stalled: ranks of ``left`` whose heartbeat stood still while this rank waited, and
            for how many seconds it was seen still (stopped, not exited).
    """

    def __init__(self, rank: int, label: str, failed: dict[int, str], left: list[int], cause: str,
                 hint: str = "", why: str = "", last: Mapping[int, str] | None = None,
                 stalled: Mapping[int, float] | None = None) -> None:
        what = describe(label)
        self.why = why
        self.last, self.stalled = dict(last or {}), dict(stalled or {})
        if why:  # the flight recorder found where the ranks are (Note [flight recorder])
            super().__init__(f"[rank {rank}] {what} did not complete: {why}")
            self.rank, self.label, self.failed, self.left, self.cause = rank, label, failed, left, cause
            return
        if failed:
            first = min(failed)
            why = f"rank {first} failed: {failed[first]}"
            others = sorted(set(failed) - {first})
            if others:
                why += f" (ranks {others} failed too)"
        elif left:
            why = _left_words(left, self.last, self.stalled)
        else:
            why = "a rank reported an error in the same collective"
        # Once a rank has said why it failed, the transport's words for the broken connection
        # ("Connection closed by peer") add nothing.
        said = "" if failed or not cause else f". Backend said: {cause}"
        super().__init__(f"[rank {rank}] {what} did not complete: {why}{said}" + (f". {hint}" if hint else ""))
        self.rank, self.label, self.failed, self.left, self.cause = rank, label, failed, left, cause

    def with_hint(self, hint: str) -> CollectiveError:
        """The same error with a caller's hint on the likely cause appended (not to an error
        that already names where the ranks are)."""
        if self.why:
            return self
        return CollectiveError(self.rank, self.label, self.failed, self.left, self.cause, hint, last=self.last,
                               stalled=self.stalled)


def stopped_words(rank: int, seconds: float, where: str) -> str:
    """Why a rank whose heartbeat stood still for ``seconds`` holds the others up, and the fix
    (Note [flight recorder] in ``flight``); ``where``: its last known collective, in words."""
    return (f"rank {rank} stopped progressing: its heartbeat has not moved for {seconds:.1f} s (the process was "
            f"stopped, e.g. SIGSTOP, or its machine froze); its last known collective is {where}. Resume or restart "
            "that rank")


def _left_words(left: list[int], last: Mapping[int, str], stalled: Mapping[int, float]) -> str:
    """The ranks that left without a report, a stopped one first, each with what is known of it."""
    first = next((r for r in left if r in stalled), left[0])
    others = [r for r in left if r != first]
    if first in stalled:
        return stopped_words(first, stalled[first], last.get(first, "not known")) + (
            f" (ranks {others} left without a report too)" if others else "")
    why = (f"rank {first} left" + (f" (and ranks {others})" if others else "")
           + " without a report: it exited, was killed or is stuck outside this collective")
    return why + (f"; its last known collective is {last[first]}" if first in last else "")


def describe(label: str) -> str:
    """A profiler label (``shardopt::sdp::reduce::bucket3``) in words for error messages."""
    parts = label.split("::")
    if len(parts) < 3 or parts[0] != "shardopt":
        return f"the collective {label!r}"
    if parts[1] == "object":  # comm's object exchanges (metadata, checkpoint plans)
        return f"an object {parts[2].replace('_', '-')}"
    components = {"sdp": "ShardedDataParallel", "oss": "OSS", "fsdp": "FullyShardedDataParallel",
                  "scaler": "ShardedGradScaler", "checkpoint": "shardopt.checkpoint", "debug": "the debug check"}
    phases = {"reduce": "gradient reduction", "param_gather": "parameter gather after the step",
              "all_gather": "parameter all-gather", "reduce_scatter": "gradient reduce-scatter",
              "all_reduce": "gradient all-reduce", "found_inf": "inf/nan agreement",
              "clip_grad_norm": "gradient-norm all-reduce", "startup_sync": "parameter broadcast at construction",
              "buffers": "buffer broadcast", "summon": "full-parameter gather",
              "optim_state": "optimizer-state gather", "sync_module_states": "module-state broadcast",
              "save": "sharded save", "load": "sharded load"}
    text = f"{components.get(parts[1], parts[1])}'s {phases.get(parts[2], parts[2].replace('_', ' '))}"
    if len(parts) > 3:
        rest = parts[3]
        text += f" of bucket {rest[len('bucket'):]}" if rest.startswith("bucket") else f" of unit {rest!r}"
    return text


FAKE_BACKEND = "fake"
"""The backend name of torch's fake process group (Note [fake process group])."""


def is_fake_group() -> bool:
    """Whether the default process group is torch's fake one (Note [fake process group]).

    Returns:
        ``True`` when ``torch.distributed`` is initialised with backend ``"fake"``;
        ``False`` without a default group or on any real backend.
    """
    return dist.is_available() and dist.is_initialized() and str(dist.get_backend()) == FAKE_BACKEND


_attempt_store: list[Any] = []  # the default store shardopt.elastic formed the group on, if it did


def use_attempt_store(store: Any) -> None:
    """Record that the default group was formed on ``store``, a namespace of this attempt alone
    (Note [one store namespace per attempt] in ``shardopt.elastic``, which calls this)."""
    _attempt_store[:] = [store]


def _on_attempt_store(store: Any) -> bool:
    """Whether ``store`` is, or wraps (torch adds a ``PrefixStore``), the recorded attempt store."""
    while store is not None:
        if any(store is s for s in _attempt_store):
            return True
        store = getattr(store, "underlying_store", None)
    return False


def default_store() -> Any:
    """The store for shardopt's own keys (the board, the flight recorder, arrivals), or ``None``.

    The default process group's store; when that group was formed with plain
    ``init_process_group`` on the store torchrun keeps across restarts, the keys go under
    ``shardopt/restart-<TORCHELASTIC_RESTART_COUNT>/`` so a restarted attempt never reads the
    last one's (Note [one store namespace per attempt] in ``shardopt.elastic``).
    """
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no default group (or a torch without this helper): no board
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None or _on_attempt_store(store):
        return store
    return dist.PrefixStore(f"shardopt/restart-{restart}/", store)


def report_failure(message: str, saw: bool = False) -> None:
    """Tell the other ranks that this rank fails and why (Note [failure board]).

    Their pending shardopt collectives then end within a poll slice with a
    :class:`CollectiveError` naming this rank and ``message``. Best effort: does nothing
    without a process group, and never raises. Call it from an ``except`` block of a rank
    that is about to exit (``shardopt.testing.run_ranks`` and the ``shardopt`` command do).

    Under a fake process group there are no peers to tell and the store holds nothing: it
    does nothing (Note [fake process group]).

    Args:
        message: why this rank fails (one line is best).
        saw: this rank only saw a collective fail (internal use).
    """
    store = default_store()
    if store is None or not dist.is_initialized() or is_fake_group():
        return
    rank = dist.get_rank()
    if rank in _reported:
        return
    try:
        store.set(f"shardopt/failure/{rank}", f"{_SAW if saw else _ORIGIN}|{message}")
        store.add(_COUNT_KEY, 1)
        _reported.add(rank)
    except Exception:  # the store may be gone with the failing peer; the report is best effort
        pass


def any_reported() -> bool:
    """Whether some rank has put a report on the board (one store read); never under a fake
    process group (Note [fake process group])."""
    store = default_store()
    if store is None or is_fake_group():
        return False
    try:
        return int(store.add(_COUNT_KEY, 0)) > 0
    except Exception:
        return True  # the store itself is gone: so is a peer


def _reports(store: Any, world: int) -> dict[int, tuple[str, str]]:
    out: dict[int, tuple[str, str]] = {}
    for r in range(world):
        key = f"shardopt/failure/{r}"
        try:
            if store.check([key]):
                kind, _, text = store.get(key).decode().partition("|")
                out[r] = (kind, text)
        except Exception:
            break
    return out


def collective_error(label: str, cause: BaseException | str) -> CollectiveError:
    """Report that this rank saw ``label`` fail, wait for the others' reports, and name the culprit.

    Under a fake process group the backend itself refused the call (no peer exists to fail
    or leave): the error quotes it and names no rank (Note [fake process group])."""
    if is_fake_group():
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        rank, world = dist.get_rank(), dist.get_world_size()
        return CollectiveError(rank, label, {}, [], first,
                               why=f"torch's fake process group (one process playing rank {rank} of {world}; no "
                                   f"other rank exists) refused the call: {first}")
    report_failure(f"saw {describe(label)} fail", saw=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    store = default_store()
    reports: dict[int, tuple[str, str]] = {}
    if store is not None:
        deadline = time.monotonic() + GRACE_S
        while True:
            reports = _reports(store, world)
            if len(reports) == world or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    failed = {r: text for r, (kind, text) in reports.items() if kind == _ORIGIN and r != rank}
    left = [r for r in range(world) if r not in reports and r != rank] if store is not None else []
    return CollectiveError(rank, label, failed, left, str(cause).strip().splitlines()[0] if str(cause) else "")


def debug_enabled() -> bool:
    """Whether the collective sequence check is on (Note [collective sequence check])."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")
