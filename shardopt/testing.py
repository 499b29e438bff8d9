"""Run a function on N real ranks, for tests and small local experiments.

:func:`run_ranks` starts one process per rank, gives them a process group, calls the
function on every rank and returns the per-rank results, or raises in the parent with the
failing rank's traceback. It is the harness behind shardopt's own tests and is public so
users can test their training code the same way.

How it works: rendezvous goes through a :class:`torch.distributed.FileStore` in a fresh
temporary folder, so no TCP port is ever fixed or raced for. Processes are forked when that
is safe (Linux, CUDA not initialised in the parent, torch using one intra-op thread, see
Note [fork safety]) and spawned otherwise. Every rank is given ``timeout_s`` both as the
process group timeout (a collective that never completes raises inside the rank) and as a
wall-clock limit in the parent (a rank that never returns is killed and named).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shardopt.failures import report_failure

__all__ = ["RankFailure", "RankTimeout", "run_ranks"]

_FAILURE_GRACE_S = 5.0
_STARTUP_LIMIT_S = 120.0  # to start every rank and join the group, before ``timeout_s`` counts

# Note [fork safety]
# Forking a process whose OpenMP/intra-op thread pool has started can deadlock the child
# (libgomp is not fork-safe), and CUDA cannot be used in a forked child once the parent has
# initialised it, nor run backward once it has run one in the parent (autograd's device
# threads). A parent on a machine without CUDA that has set torch to one thread forks
# safely, and a fork costs ~0.05 s against ~1 s for a spawn that re-imports torch.


class RankFailure(RuntimeError):
    """A rank raised; the message carries the rank and its formatted traceback.

    Attributes:
        rank: the rank whose error is reported (the likely cause, see :func:`run_ranks`).
        remote_traceback: that rank's formatted traceback.
        also_failed: other ranks that failed too (usually in a collective with the first).
    """

    def __init__(self, rank: int, remote_traceback: str, also_failed: tuple[int, ...] = ()) -> None:
        others = f" (ranks {list(also_failed)} also failed)" if also_failed else ""
        super().__init__(f"[rank {rank}] failed{others}:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.also_failed = also_failed


# A rank whose peer died fails inside its collective with one of these; such a failure is a
# consequence, and the peer's own error is the one to report.
_PEER_ERROR_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "DistBackendError",
    "NCCL communicator was aborted",
)


def _root_cause(failures: list[tuple[int, str]]) -> tuple[int, str]:
    """The first failure (in arrival order) that is not a peer's collective error."""
    for rank, tb in failures:
        if not any(marker in tb for marker in _PEER_ERROR_MARKERS):
            return rank, tb
    return failures[0]


class RankTimeout(RuntimeError):
    """Some ranks did not finish within the time limit (a hang, turned into a failure)."""

    def __init__(self, ranks: list[int], timeout_s: float) -> None:
        super().__init__(
            f"ranks {ranks} did not finish within {timeout_s:.0f} s; they were killed "
            "(a collective waiting on a rank that never calls it is the usual cause)"
        )
        self.ranks = ranks


# Note [ranks start from the caller's random state]
# Forked ranks inherit the caller's random state; spawned ones start from seeds of their own
# (two spawned processes drew 0.94 and 0.83 as their first torch.rand). run_ranks spawns
# wherever forking is unsafe, which is wherever CUDA is visible (Note [fork safety]), so a
# function that builds a model without seeding got the same weights on every rank on a CPU
# machine and different ones beside a GPU (a ZeRO-3 test then failed FullyShardedDataParallel's
# check of the same weights at construction). Every rank therefore starts from the caller's
# state of torch's CPU generator, Python's ``random`` and numpy's global generator (when numpy
# is imported), forked or spawned: the same on every rank, as a fork gives.


@dataclass(frozen=True)
class _RandomState:
    """The caller's random state, restored on every rank (Note [ranks start from the caller's random state])."""

    torch_cpu: bytes
    python: Any
    numpy: Any

    @staticmethod
    def capture() -> _RandomState:
        np = sys.modules.get("numpy")
        return _RandomState(torch.get_rng_state().numpy().tobytes(), random.getstate(),
                            np.random.get_state() if np is not None else None)

    def restore(self) -> None:
        torch.set_rng_state(torch.frombuffer(bytearray(self.torch_cpu), dtype=torch.uint8))
        random.setstate(self.python)
        if self.numpy is not None:
            import numpy

            numpy.random.set_state(self.numpy)


@dataclass(frozen=True)
class _RankJob:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    world_size: int
    backend: str
    store_path: str
    timeout_s: float
    threads: int
    random_state: _RandomState


def _rank_main(rank: int, job: _RankJob, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = str(job.threads)
    torch.set_num_threads(job.threads)
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if job.backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        store = dist.FileStore(job.store_path, job.world_size)
        dist.init_process_group(
            job.backend,
            store=store,
            rank=rank,
            world_size=job.world_size,
            timeout=timedelta(seconds=job.timeout_s),
        )
        results.put((rank, None, None))  # joined: the parent's wall clock starts for this run
        job.random_state.restore()  # Note [ranks start from the caller's random state]
        try:
            value = job.fn(rank, job.world_size, *job.args)
        except BaseException as exc:
            # Peers blocked in a shardopt collective end with this reason (Note [failure board] in shardopt.failures).
            report_failure(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
            raise
        finally:
            dist.destroy_process_group()
        # Pickle to bytes here, with the standard pickler: a value the queue's feeder thread
        # cannot pickle would otherwise be dropped silently, and torch's queue reductions
        # would share tensors through file descriptors that die with this process.
        payload = pickle.dumps(value)
        results.put((rank, True, payload))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))


def _fork_is_safe() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    if torch.cuda.is_available():
        # Once the parent has run a backward pass, autograd's per-device worker threads exist
        # and a forked child's backward raises "Unable to handle autograd's threading in
        # combination with fork-based multiprocessing" (seen on an H100 machine; CPU-only
        # builds start no such threads). Whether they exist cannot be asked, so spawn.
        return False
    return torch.get_num_threads() == 1


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 120.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` real processes.

    Every rank starts from the caller's random state (torch's CPU generator, ``random``,
    numpy's global generator), whether its process was forked or spawned (Note [ranks start
    from the caller's random state]).

    Args:
        fn: the function to run on every rank. With the spawn start method it must be
            importable (defined at module level).
        world_size: number of ranks (>= 1).
        *args: extra arguments passed to ``fn`` on every rank (picklable for spawn).
        backend: ``"gloo"`` (default) or ``"nccl"`` (rank ``r`` uses CUDA device ``r``).
            The tensors' device is the function's choice, so the backend is never guessed
            from the machine: CPU tensors on an NCCL group fail.
        timeout_s: the process group timeout, and the wall-clock limit of the run counted
            from when every rank has joined the group (starting the ranks and joining have
            a separate limit of 120 s).
        threads_per_rank: intra-op threads per rank.

    Returns:
        The values returned by ``fn``, indexed by rank. They travel through a pipe, so they
        must be picklable; return CPU tensors or plain numbers.

    Raises:
        ValueError: ``world_size`` < 1 or an unknown backend.
        RankFailure: a rank raised (or exited without a result). The first failure to
            reach the parent that is not a collective broken by a dead peer is reported,
            with that rank's traceback in the message and the other failed ranks named.
            Peers still blocked in a collective are given a few seconds, then killed.
        RankTimeout: ranks neither returned nor failed within ``timeout_s`` plus a short
            grace (for the process group's own timeout to fire first); they are named
            and killed.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    backend = backend or "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx: Any = mp.get_context("fork" if backend == "gloo" and _fork_is_safe() else "spawn")
    with tempfile.TemporaryDirectory(prefix="shardopt-") as tmp:
        job = _RankJob(fn, args, world_size, backend, os.path.join(tmp, "store"), timeout_s, threads_per_rank,
                       _RandomState.capture())
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank_main, args=(r, job, results), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[bool, Any]] = {}
        ready: set[int] = set()
        # The group timeout should fire first and name the cause; the grace lets it. The
        # clock starts once every rank has joined the group (a spawned rank takes seconds
        # to import torch on a loaded machine); until then startup has its own limit.
        grace_s = min(10.0, 1.0 + 0.25 * timeout_s)
        deadline = time.monotonic() + _STARTUP_LIMIT_S + timeout_s + grace_s
        try:
            while len(outcome) < world_size:
                try:
                    rank, ok, value = results.get(timeout=0.2)
                    if ok is None:  # joined the group
                        ready.add(rank)
                        if len(ready) == world_size:
                            deadline = min(deadline, time.monotonic() + timeout_s + grace_s)
                    else:
                        outcome[rank] = (ok, value)
                    continue
                except queue.Empty:
                    pass
                dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # let a late put arrive before we call it a crash
                    while True:
                        try:
                            rank, ok, value = results.get_nowait()
                            if ok is not None:
                                outcome[rank] = (ok, value)
                        except queue.Empty:
                            break
                    for r in dead:
                        if r not in outcome:
                            outcome[r] = (False, f"process exited with code {procs[r].exitcode} without a result")
                if any(not ok for ok, _ in outcome.values()):
                    # Peers of a failed rank usually block in their next collective; give
                    # them a short grace to report, then stop waiting and report the failure.
                    deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
                if time.monotonic() > deadline:
                    if any(not ok for ok, _ in outcome.values()):
                        break
                    raise RankTimeout(sorted(set(range(world_size)) - set(outcome)), timeout_s)
        finally:
            grace = 5.0 if len(outcome) == world_size else 0.5
            for p in procs:
                p.join(timeout=grace)
                if p.is_alive():
                    p.kill()
                    p.join()
        failures = [(r, v) for r, (ok, v) in outcome.items() if not ok]  # arrival order
        if failures:
            rank, tb = _root_cause(failures)
            raise RankFailure(rank, tb, tuple(sorted(r for r, _ in failures if r != rank)))
        return [pickle.loads(outcome[r][1]) for r in range(world_size)]
