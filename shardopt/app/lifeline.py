"""The fork server and the ranks of ``shardopt demo``/``bench`` die with the launcher that started them.

Note [no orphans]
Ranks come from a fork server (Note [forkserver, not fork] in :mod:`shardopt.app.launch`), a child
of the launcher, and the ranks are its children. Ctrl-C reaches all of them (one process
group), but when only the launcher dies (the OOM killer's SIGKILL, ``kill -9``) the fork
server does not notice, and the ranks train on as orphans, holding memory and cores. So:

- The fork server imports this module as a preload. The import sees it is running inside
  ``multiprocessing.forkserver.main`` and asks Linux for SIGKILL when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``). The signal fires when the *thread* that started the child
  exits: the launcher starts the fork server from the thread that runs the elastic agent,
  its main thread, which lives as long as the launcher does. No watchdog thread here: the
  fork server must stay single-threaded (that is why it exists); without prctl it is left
  to CPython's own check of the launcher's pipe.
- Every rank runs :func:`run_guarded`, which does the same before the rank's entry point,
  with a daemon thread polling as the fallback where prctl is unavailable. The fork server
  forks from its only thread, so the rank's signal is tied to a thread that lives as long
  as the server.

Either process could lose its parent before asking (between fork and prctl); then the
signal never comes. So each checks afterwards that the launcher is still its parent or
grandparent (a fork server's child), and kills itself if not. Measured on the 2-core test
machine: launcher SIGKILLed, fork server and both ranks gone in about 0.1 s.

Under ``torchrun`` the ranks are the elastic agent's children, each in a session of its own,
and torch ties nothing to the agent's life: with the agent SIGKILLed, both ranks of a demo
trained on (seen on the test machine), holding cores and still saving checkpoints, which a
job restarted by its scheduler would then share with them. So a torchrun rank runs
:func:`die_with_agent`: a daemon thread that polls its parent and SIGKILLs the rank once the
parent is gone. Polling, not prctl: the signal is tied to the thread that started the rank,
and torch does not promise that it is one that lives as long as the agent. A rank is gone
within :data:`_POLL_S` of its agent (tests/test_restart.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LAUNCHER_PID_ENV", "die_with_agent", "die_with_launcher", "run_guarded"]

LAUNCHER_PID_ENV = "SHARDOPT_LAUNCHER_PID"
"""Set by the launcher while it starts ranks, so the fork server knows its launcher's pid."""

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.2


def _set_parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when its parent thread exits; ``False`` when not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _parent_of(pid: int) -> int | None:
    """The parent pid of ``pid`` from /proc (``None`` without /proc or once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _launcher_alive(launcher_pid: int) -> bool:
    """Whether ``launcher_pid`` is still this process's parent or grandparent.

    When the launcher dies, its children are reparented at once (before it is reaped), so
    neither test passes any more, and a reused pid cannot be an ancestor.
    """
    parent = os.getppid()
    return parent == launcher_pid or _parent_of(parent) == launcher_pid


def _kill_self() -> None:
    os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))


def _watch(launcher_pid: int) -> None:
    while _launcher_alive(launcher_pid):
        time.sleep(_POLL_S)
    _kill_self()


def die_with_launcher(launcher_pid: int, watchdog: bool = True) -> None:
    """Make this process die when the launcher ``launcher_pid`` (its parent or grandparent) dies.

    How it works: Note [no orphans].

    Args:
        launcher_pid: the ``shardopt`` process that started this one, directly or through
            its fork server.
        watchdog: without prctl, start a daemon thread that polls the launcher (``False`` in
            the fork server, which must stay single-threaded).
    """
    armed = _set_parent_death_signal()
    if not _launcher_alive(launcher_pid):
        _kill_self()  # it died before the signal was armed
    if not armed and watchdog:
        threading.Thread(target=_watch, args=(launcher_pid,), name="shardopt-lifeline", daemon=True).start()


def die_with_agent() -> None:
    """Make this torchrun rank die when its elastic agent (its parent) dies (Note [no orphans])."""
    agent = os.getppid()
    threading.Thread(target=_watch, args=(agent,), name="shardopt-lifeline", daemon=True).start()


def run_guarded(launcher_pid: int, entry: Callable[..., Any], *args: Any) -> Any:
    """A rank's entry point: :func:`die_with_launcher`, then ``entry(*args)``.

    Args:
        launcher_pid: the launcher's pid.
        entry: the rank's real entry point.
        *args: its arguments.

    Returns:
        What ``entry`` returns.
    """
    die_with_launcher(launcher_pid)
    return entry(*args)


def _imported_by_fork_server() -> bool:
    import multiprocessing.forkserver

    target = multiprocessing.forkserver.main.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is target:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


if _imported_by_fork_server() and os.environ.get(LAUNCHER_PID_ENV, "").isdigit():
    die_with_launcher(int(os.environ[LAUNCHER_PID_ENV]), watchdog=False)
