"""Runs of ``shardopt demo`` under torchrun for the restart tests and ``scripts/chaos.py``: the
command line, the run in its own session (so that leftovers can be found and nothing
outlives a timeout), and the comparison of two checkpoints, entry by entry."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from tests.helpers.processes import REPO, session_processes

MARK_ENV = "SHARDOPT_TEST_RUN"
"""Set to a fresh value for each run; every process of the run inherits it (torchrun's ranks
live in sessions of their own, so the run's session does not hold them)."""
FAULT_LINE = "shardopt demo: fault injected: "
RESUMED_LINE = "shardopt demo: resumed from step "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_command(nproc: int, max_restarts: int, module: str, args: list[str]) -> list[str]:
    """``python -m torch.distributed.run`` (torchrun) on this machine's loopback, on a free port.

    torchrun's default rendezvous (static) keeps one TCPStore for every attempt: the case
    Note [one store namespace per attempt] in shardopt.elastic is about.
    """
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts",
            str(max_restarts), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "--monitor-interval", "0.1", "-m", module, *args]


@dataclass(frozen=True)
class Run:
    """What a run left: its exit code, output lines with their arrival times, and leftovers.

    Attributes:
        returncode: the command's exit code (``None`` after a timeout).
        lines: ``(seconds since start, line)`` of stdout and stderr together.
        leftovers: pids still alive in the run's session after it ended.
        seconds: wall time.
    """

    returncode: int | None
    lines: tuple[tuple[float, str], ...]
    leftovers: tuple[int, ...]
    seconds: float

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def matching(self, prefix: str) -> list[tuple[float, str]]:
        return [(t, line[line.index(prefix):]) for t, line in self.lines if prefix in line]


def marked_processes(mark: str) -> list[int]:
    """Live (not zombie) processes whose environment has ``MARK_ENV=mark``."""
    needle = f"{MARK_ENV}={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        found.append(int(entry))
    return sorted(found)


def run_in_session(command: list[str], cwd: str, timeout_s: float, env: dict[str, str] | None = None) -> Run:
    """Run ``command`` in a new session; on timeout SIGKILL the whole session and every process of the run.

    Leftovers are the run's live processes (found by :data:`MARK_ENV`) 2 s after the
    command ended: a rank that outlives torchrun is an orphan.
    """
    mark = uuid.uuid4().hex
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}), **{MARK_ENV: mark})
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    returncode: int | None = None
    try:
        assert proc.stdout is not None
        deadline = start + timeout_s
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=0.5):
                    line = proc.stdout.readline()
                    if not line:
                        break
                    lines.append((time.monotonic() - start, line.rstrip("\n")))
        try:
            returncode = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            returncode = None
    finally:
        seconds = time.monotonic() - start
        if returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        leftovers: list[int] = []
        for _ in range(20):
            leftovers = sorted(set(session_processes(proc.pid)) | set(marked_processes(mark)))
            if not leftovers:
                break
            time.sleep(0.1)
        for pid in leftovers:  # leave nothing running, but report it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return Run(returncode, tuple(lines), tuple(leftovers), seconds)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}/{k}"))
        return out
    if isinstance(value, (list, tuple)):
        out = {}
        for i, v in enumerate(value):
            out.update(_flat(v, f"{prefix}/{i}"))
        return out
    return {prefix: value}


def checkpoint_differences(a: str, b: str) -> list[str]:
    """Entries of two consolidated checkpoint files that are not bit-for-bit equal (model,
    optimizer state, extra), or that one of them lacks."""
    left = _flat(torch.load(a, map_location="cpu", weights_only=True))
    right = _flat(torch.load(b, map_location="cpu", weights_only=True))
    differ = sorted(left.keys() ^ right.keys())
    for key in sorted(left.keys() & right.keys()):
        x, y = left[key], right[key]
        same = (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                if isinstance(x, torch.Tensor) else x == y)
        if not same:
            differ.append(key)
    return differ


def max_relative_difference(a: str, b: str, section: str = "/model") -> float:
    """The largest ``|x - y| / max(|x|)`` over the tensors under ``section`` of two checkpoints."""
    left = _flat(torch.load(a, map_location="cpu", weights_only=True))
    right = _flat(torch.load(b, map_location="cpu", weights_only=True))
    worst = 0.0
    for key, x in left.items():
        if key.startswith(section) and isinstance(x, torch.Tensor) and x.is_floating_point():
            y = right[key]
            scale = float(x.abs().max()) or 1.0
            worst = max(worst, float((x.double() - y.double()).abs().max()) / scale)
    return worst
