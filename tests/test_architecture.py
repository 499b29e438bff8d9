"""The package's layering holds: no import cycle, no module over ~600 lines, the library
imports neither the application (``shardopt.app``) nor rich, and imports without rich."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

ROOT = Path(__file__).resolve().parent.parent


def test_module_graph_has_no_cycle_no_oversized_module_and_a_library_free_of_the_app() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "module_graph.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "import cycles: 0" in done.stdout


def test_the_library_imports_without_rich() -> None:
    code = ("import sys; sys.modules['rich'] = None\n"  # any import of rich now fails
            "import shardopt, shardopt.nn, shardopt.optim, shardopt.checkpoint, shardopt.memory, shardopt.testing\n"
            "assert not any(m == 'rich' or m.startswith('rich.') for m in sys.modules if sys.modules[m])\n"
            "assert not any(m.startswith('shardopt.app') for m in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
