"""shardopt.app.lifeline: a process armed with die_with_launcher dies with its launcher, through
prctl or, where prctl is unavailable, the watchdog thread, and at once when the launcher is
already gone. (The whole launcher, fork server and ranks: test_cli.py.)"""

from __future__ import annotations

import pytest
import os
import signal
import subprocess
import sys
import time

from tests.helpers.processes import REPO, session_processes as _session_processes

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

# a "rank" that arms itself against its parent without prctl, so only the watchdog can act
_RANK = ("import os, time; from shardopt.app import lifeline; lifeline._set_parent_death_signal = lambda: False; "
         "lifeline.die_with_launcher(os.getppid()); print('armed', flush=True); time.sleep(60)")
_LAUNCHER = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', %r], stdout=subprocess.PIPE, "
             "text=True); print(p.pid, p.stdout.readline().strip(), flush=True); time.sleep(60)" % _RANK)


def test_watchdog_kills_a_rank_whose_launcher_died_when_prctl_is_unavailable() -> None:
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], cwd=REPO, stdout=subprocess.PIPE, text=True,
                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert launcher.stdout is not None
        pid, state = launcher.stdout.readline().split()
        assert state == "armed" and _session_processes(launcher.pid) == sorted([launcher.pid, int(pid)])
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 5
        while _session_processes(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _session_processes(launcher.pid) == []
    finally:
        for left in _session_processes(launcher.pid):
            os.kill(left, signal.SIGKILL)


def test_a_process_whose_launcher_is_already_gone_kills_itself() -> None:
    # pid 1 is not this child's parent or grandparent: as if the launcher died before prctl
    done = subprocess.run([sys.executable, "-c", "from shardopt.app import lifeline; lifeline.die_with_launcher(1); "
                           "print('survived')"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL and "survived" not in done.stdout, done
