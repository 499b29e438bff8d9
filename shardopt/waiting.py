"""Waiting for gloo work beside it, on a thread, so that the caller can watch the other ranks.

Note [waiting beside the work]
A gloo wait cannot be sliced with a timeout: for a point-to-point transfer a timed wait that
runs out closes the TCP pair ("Application timeout caused pair closure" on the next wait),
so any peer more than one slice late broke the step (seen on an H100 machine, where spawned
ranks start seconds apart, and reproduced on a CPU with a peer 1.6 s late). So one daemon
thread per process blocks in torch's ``wait()`` (which releases the GIL), in issue order,
and the caller waits on its event in slices of ``WATCH_SLICE_S``, reading the failure
board between them. A peer that is merely late costs nothing; one that reported a failure
ends the wait within a slice. After such an error the thread may stay blocked in a wait
that can never complete; it holds only that work and dies with the process. Cost: one
thread handoff per wait, tens of microseconds. The thread drops its reference to the work
before it wakes the caller, and holds none while idle: keeping the last one bound until the
next job kept the last collective's buffers alive (one-unit ZeRO-3 on the 27M GPT at 2
ranks held 440 MiB per rank after a step instead of 181 MiB; tests/test_buffer_release.py).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from shardopt import failures, flight
from shardopt.failures import CollectiveError

__all__ = ["Call", "wait_beside"]


class _Waiter:
    """A daemon thread that blocks in torch's ``wait()`` for this process, so the caller can
    wait in slices and watch the failure board (Note [waiting beside the work])."""

    def __init__(self) -> None:
        self._pid = -1
        self._queue: queue.SimpleQueue[tuple[Any, _Ticket]] = queue.SimpleQueue()

    def submit(self, work: Any) -> _Ticket:
        """Queue ``work`` (anything with ``wait()``) behind the earlier ones; its ticket is set when done."""
        if self._pid != os.getpid():  # first use, or a forked child: the thread is not here
            self._pid, self._queue = os.getpid(), queue.SimpleQueue()
            threading.Thread(target=self._run, args=(self._queue,), name="shardopt-wait", daemon=True).start()
        ticket = _Ticket()
        self._queue.put((work, ticket))
        return ticket

    @staticmethod
    def _run(jobs: queue.SimpleQueue[tuple[Any, _Ticket]]) -> None:
        while True:
            work, ticket = jobs.get()
            error: BaseException | None = None
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                error = exc
            # Drop the work (and the buffers it holds) before the caller wakes, and do not
            # keep it bound while blocked in the next get() (Note [waiting beside the work]).
            del work
            ticket.error = error
            ticket.done.set()
            del ticket, error


@dataclass
class _Ticket:
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


_WAITER = _Waiter()


class Call:
    """A blocking call run on the wait thread, so that its wait is watched like any other."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._call: Callable[[], Any] | None = call

    def wait(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call()


def wait_beside(work: Any, label: str, position: Callable[[], flight.Position] | None) -> None:
    """Wait for ``work`` on the wait thread, reading the failure board every slice (Note
    [failure board] in ``failures``) and, once the wait outlasts the grace, the other ranks'
    positions (Note [flight recorder] in ``flight``; ``position`` says where this rank is,
    ``None`` for a wait the recorder cannot place).

    Raises:
        CollectiveError: the work failed (naming the ranks that left without a report with
            their last known collective, as stopped where their heartbeat stood still), a
            rank reported a failure, or the flight recorder found a rank elsewhere or stopped.
    """
    ticket = _WAITER.submit(work)
    watch: flight.Watch | None = None
    started = time.monotonic()
    try:
        while not ticket.done.wait(failures.WATCH_SLICE_S):
            if failures.any_reported():
                raise failures.collective_error(label, "another rank reported a failure")
            if position is None:
                continue
            if watch is None and time.monotonic() - started >= flight.GRACE_S:
                watch = flight.Watch(position())
            why = watch.problem() if watch is not None else None
            if why:
                error = CollectiveError(dist.get_rank(), label, {}, [], "", why=why)
                failures.report_failure(str(error))
                raise error
    finally:
        if watch is not None:
            watch.close()
    if ticket.error is not None:
        if not isinstance(ticket.error, RuntimeError):
            raise ticket.error
        # The backend ended the wait (its timeout, a closed connection): name the ranks that
        # left without a report by what the recorder knows (Note [flight recorder] in flight).
        error = failures.collective_error(label, ticket.error)
        raise (flight.explain_left(error, watch) if position is not None else error) from ticket.error
