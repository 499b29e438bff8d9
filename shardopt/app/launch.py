"""Local ranks for the ``shardopt`` command, through torch's elastic launcher.

:func:`launch` runs a function on N local ranks (or, under ``torchrun``, as this process's
rank); :func:`run_launched` turns Ctrl-C and rank failures into one message and an exit
code. Ranks come from a fork server (Note [forkserver, not fork]) and die with the launcher
(Note [no orphans] in :mod:`shardopt.app.lifeline`).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from shardopt.app.lifeline import LAUNCHER_PID_ENV, die_with_agent, run_guarded

__all__ = ["INTERRUPTED_EXIT", "describe_failure", "launch", "run_launched", "under_torchrun"]

INTERRUPTED_EXIT = 130
"""Exit code after Ctrl-C (128 + SIGINT), as a shell reports it."""


def under_torchrun() -> bool:
    """Whether this process is a rank that ``torchrun`` started."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


# Note [forkserver, not fork]
# The elastic agent runs rendezvous threads in this process, and one of them may be inside
# glibc's getaddrinfo (which holds the resolver's lock) at the moment a rank is forked: the
# child then waits for that lock forever. A 4-rank bench hung that way (two ranks blocked in
# get_locked_global, resolv_conf.c). So ranks come from a fork server: a process started once,
# single-threaded, with torch and shardopt already imported, which forks each rank as fast as
# fork did without inheriting anyone's threads. spawn is the fallback off Linux or once CUDA
# is initialised here.
# shardopt.app.lifeline comes first: importing it in the fork server ties the server's life to
# this process's (Note [no orphans] in shardopt.app.lifeline) before the slow imports.
_PRELOAD = ["shardopt.app.lifeline", "torch", "torch._dynamo", "shardopt.app.runner", "shardopt.app.bench"]


def _start_method() -> str:
    if not sys.platform.startswith("linux") or (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return "spawn"
    import multiprocessing.forkserver

    multiprocessing.forkserver.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    return "forkserver"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(entry: Callable[..., Any], world_size: int, *args: Any) -> dict[int, Any]:
    """Run ``entry(*args)`` on ``world_size`` local ranks with torch's elastic launcher.

    Under ``torchrun`` this process already is one rank: ``entry`` runs here, dying with
    torchrun's agent, and the result is keyed by the global rank. Otherwise ``elastic_launch`` starts the ranks (from a fork
    server on Linux, Note [forkserver, not fork]; spawned otherwise) with a c10d rendezvous on the loopback
    interface, and no restarts: a failing rank stops them all. The ranks and the fork server
    die with this process, even when it is SIGKILLed (Note [no orphans] in
    :mod:`shardopt.app.lifeline`).

    Args:
        entry: a module-level function (it must be picklable for spawn).
        world_size: local ranks to start.
        *args: passed to ``entry`` on every rank.

    Returns:
        ``{rank: return value}``.
    """
    if under_torchrun():
        die_with_agent()  # torch leaves a rank running when its agent is killed (Note [no orphans])
        return {int(os.environ["RANK"]): entry(*args)}
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # The launcher logs every rank failure with its own prefixes; _run_launched reports it once.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world_size, rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}", run_id=f"shardopt-{os.getpid()}-{time.monotonic_ns()}",
        max_restarts=0, monitor_interval=0.1, start_method=_start_method(),
    )
    previous = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # read by a fork server started now
    try:
        return dict(elastic_launch(config, run_guarded)(os.getpid(), entry, *args))
    finally:
        if previous is None:
            del os.environ[LAUNCHER_PID_ENV]
        else:
            os.environ[LAUNCHER_PID_ENV] = previous


def run_launched(command: str, entry: Callable[..., Any], world_size: int, *args: Any) -> dict[int, Any]:
    """:func:`launch`, turning Ctrl-C and rank failures into a message and an exit code.

    See Note [no launcher leftovers] for why the exit happens outside the ``except`` blocks.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    lines: list[str] = []
    code = 0
    try:
        return launch(entry, world_size, *args)
    except (KeyboardInterrupt, SignalException):
        lines, code = [f"shardopt {command}: interrupted; all ranks were stopped"], INTERRUPTED_EXIT
    except ChildFailedError as exc:
        lines, code = describe_failure(command, exc)
    gc.collect()
    sys.stderr.write("".join(line + "\n" for line in lines))
    raise SystemExit(code)


# Note [no launcher leftovers]
# The elastic agent runs a c10d rendezvous store with its own threads in this process. When a
# launch fails, the exception's traceback keeps the agent, and so those threads, alive; a
# later launch in the same process (bench runs one per mode) would then fork a process that
# has live C++ threads, and a forked rank can abort ("std::system_error: Invalid argument").
# So failures are turned into plain text, the exception is dropped, and the garbage is
# collected before anything else can fork.


def describe_failure(command: str, exc: Any) -> tuple[list[str], int]:
    """The lines to print and the exit code for a ``ChildFailedError``."""
    rank, failure = exc.get_first_failure()
    message: dict[str, Any] = (failure.message if isinstance(failure.message, dict)
                               else {"message": str(failure.message)})
    detail = str(message.get("message", "")).strip()
    if failure.exitcode in (-2, -15) or "KeyboardInterrupt" in detail:
        return [f"shardopt {command}: interrupted; all ranks were stopped"], INTERRUPTED_EXIT
    info = message.get("extraInfo")
    stack = info.get("py_callstack") if isinstance(info, dict) else None
    lines = [f"--- rank {rank} traceback ---\n{stack.rstrip()}"] if stack else []
    first = detail.splitlines()[0] if detail else f"exit code {failure.exitcode}"
    lines.append(f"shardopt {command}: error: rank {rank} failed: {first}")
    return lines, 1
