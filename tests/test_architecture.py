"""The package's layering holds: no import cycle, no upward or sideways arrow between the
declared levels, no import inside a function dodging a cycle, no module over ~600 lines, the
library imports neither the application (``shardopt.app``) nor rich, and imports without rich."""

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


def test_module_graph_check_fails_on_an_upward_arrow_a_sideways_arrow_a_dodged_cycle_and_an_undeclared_module(
    tmp_path: Path,
) -> None:
    files = {
        "__init__.py": "",
        "clipping.py": "def clip() -> None:\n    from shardopt.optim.masters import held\n",  # dodges a cycle
        "optim/__init__.py": "from shardopt.optim.oss import OSS\n",
        "optim/oss.py": "from shardopt import clipping\nOSS = 1\n",
        "optim/masters.py": "held = 1\n",
        "nn/__init__.py": "",
        "nn/data_parallel/__init__.py": "",
        "nn/data_parallel/checks.py": "check = 1\n",
        "nn/fsdp/__init__.py": "",
        "nn/fsdp/unit.py": "from shardopt.nn.data_parallel.checks import check\n",  # sideways
        "partition.py": "from shardopt.comm import x\n",  # upward: level 0 imports level 3
        "comm.py": "x = 1\n",
        "helpers.py": "",  # no declared level
    }
    for name, text in files.items():
        path = tmp_path / "shardopt" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "module_graph.py"), "--check",
                           "--root", str(tmp_path / "shardopt")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    for expected in [
        "upward arrow: shardopt.partition (level 0) imports shardopt.comm (level 3)",
        "sideways arrow: shardopt.nn.fsdp.unit (shardopt.nn.fsdp) imports shardopt.nn.data_parallel.checks",
        "shardopt.clipping imports shardopt.optim.masters inside a function, dodging an import cycle",
        "shardopt.helpers has no level",
    ]:
        assert expected in done.stdout, done.stdout
    assert "import cycles: 0" in done.stdout  # the dodged cycle is not a cycle at import time
