"""Several torchrun agents on this machine, one per simulated node: a real multi-node launch.

:func:`launch_nodes` starts ``nnodes`` agents (``python -m torch.distributed.run``), each
with ``nproc_per_node`` workers, meeting through the c10d rendezvous on 127.0.0.1 at a free
port. Agent 0 hosts the rendezvous store (``is_host=1``), the others join it; torchrun then
hands out global ranks node by node, so each agent's workers get consecutive ranks and
``GROUP_RANK`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` as on a real cluster. Each agent runs
in its own session with its output in a file; on a timeout every agent's session is
terminated (then killed), and the error carries each agent's output tail.

Used by ``tests/test_hybrid_multinode.py``; a later test adds a mode to
``tests/helpers/multinode_train.py`` and calls :func:`launch_nodes` the same way.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
_TAIL_CHARS = 4000
_KILL_GRACE_S = 5.0


class AgentsFailed(RuntimeError):
    """An agent exited with an error or the agents did not finish in time; the message holds
    each agent's exit status and output tail.

    Attributes:
        sessions: each agent's session id (its pid), to check that nothing of it is left.
    """

    def __init__(self, message: str, sessions: tuple[int, ...]) -> None:
        super().__init__(message)
        self.sessions = sessions


@dataclass(frozen=True)
class NodesRun:
    """What the agents left: per agent its exit status and output, and the wall time.

    Attributes:
        returncodes: exit status of each agent, by agent index.
        outputs: each agent's stdout and stderr together (its workers' included).
        wall_s: seconds from starting the first agent to the last one's exit.
    """

    returncodes: tuple[int, ...]
    outputs: tuple[str, ...]
    wall_s: float


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tails(outputs: list[str], returncodes: list[int | None]) -> str:
    return "\n".join(f"--- agent {i} (exit {rc}), last {_TAIL_CHARS} chars ---\n{out[-_TAIL_CHARS:]}"
                     for i, (out, rc) in enumerate(zip(outputs, returncodes, strict=True)))


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate each agent's session (the agent and its workers), then kill what is left."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def launch_nodes(script: Path, script_args: list[str], *, nnodes: int = 2, nproc_per_node: int = 2,
                 timeout_s: float = 120.0) -> NodesRun:
    """Run ``script`` under ``nnodes`` torchrun agents of ``nproc_per_node`` workers each.

    Args:
        script: the training script every worker runs.
        script_args: its arguments.
        nnodes: number of agents (simulated nodes).
        nproc_per_node: workers per agent.
        timeout_s: wall-clock limit for the whole run.

    Returns:
        The agents' exit statuses and outputs.

    Raises:
        AgentsFailed: an agent exited non-zero, or the run passed ``timeout_s`` (every agent
            and worker is then stopped); the message has every agent's output tail.
    """
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="shardopt-nodes-") as folder:
        logs = [Path(folder) / f"agent{i}.log" for i in range(nnodes)]
        procs: list[subprocess.Popen[bytes]] = []
        start = time.monotonic()
        try:
            for i, log in enumerate(logs):
                command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                           "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                           "--rdzv-conf", f"is_host={int(i == 0)},join_timeout={int(timeout_s)}",
                           "--max-restarts", "0", str(script), *script_args]
                with open(log, "wb") as out:
                    procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                  cwd=REPO, start_new_session=True))
            for proc in procs:
                proc.wait(timeout=max(0.1, timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            _stop(procs)
            outputs = [log.read_text(errors="replace") for log in logs]
            raise AgentsFailed(f"the {nnodes} agents did not finish within {timeout_s:.0f} s and were stopped\n"
                               + _tails(outputs, [p.returncode for p in procs]),
                               tuple(p.pid for p in procs)) from None
        finally:
            _stop(procs)  # a no-op when all have exited; stops the rest if starting one raised
        wall_s = time.monotonic() - start
        outputs = [log.read_text(errors="replace") for log in logs]
    codes = [int(p.returncode) for p in procs]
    if any(codes):
        raise AgentsFailed(f"agent exit statuses {codes}\n" + _tails(outputs, list(codes)), tuple(p.pid for p in procs))
    return NodesRun(returncodes=tuple(codes), outputs=tuple(outputs), wall_s=wall_s)
