"""Processes of the command's tests: the repository root, a session's live processes, and a
function called in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def session_processes(sid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry))
    return sorted(found)


def call_in_fresh_interpreter(target: str, *args: str, timeout_s: float = 700) -> Any:
    """``module:function(*args)`` called in a new Python interpreter started in the repository
    root, its result (JSON) returned.

    For tests that measure the resident memory of ranks: a rank forked from the test process
    inherits that process's heap, and the allocations that reuse its free, already resident
    parts do not raise the rank's peak. After earlier tests had grown and freed pytest's heap,
    a rank that builds a 67 MB model in full gained 1.06x the model where it gains 1.28x from
    a fresh parent, and 0.22x after a test that freed 400 MB of small tensors."""
    module, function = target.split(":")
    code = f"import json, sys; from {module} import {function}; print('RESULT ' + json.dumps({function}(*sys.argv[1:])))"
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{target} failed:\n{done.stderr[-4000:]}"
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
