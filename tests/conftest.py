"""Test setup: one intra-op thread (so forking ranks is safe and fast, see Note [fork safety]
in shardopt.testing), torch's lazily imported modules loaded once in the parent, so
forked ranks do not each pay for them, and one inductor cache per CPU capability.

Note [one inductor cache per CPU capability]
torch 2.13's inductor FX graph cache hands a graph compiled under ATEN_CPU_CAPABILITY=avx2
to a run without it (AVX-512 kernels expected) on the same machine: the ranks then corrupt
their heap ("malloc(): unaligned tcache chunk detected") at the first compiled forward, and
with TORCHINDUCTOR_FX_GRAPH_CACHE=0 they do not. The numerics tests run under both, so each
capability gets its own cache directory unless TORCHINDUCTOR_CACHE_DIR is set.
"""

from __future__ import annotations

import getpass
import multiprocessing.process
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(  # Note [one inductor cache per CPU capability]
    tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ.get('ATEN_CPU_CAPABILITY') or 'native'}"))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  - DDP imports it lazily (1.5 s per forked rank otherwise)

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _in_process_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked ``distributed`` fails if it starts a process, so the marker stays
    true and ``pytest -m "not distributed"`` stays fast."""
    if request.node.get_closest_marker("distributed") is not None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.distributed")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture(autouse=True, scope="session")
def _child_processes_write_temporary_files_in_a_folder_removed_at_the_end() -> Iterator[None]:
    """Processes the tests start (torchrun's agents above all: each leaves a ``torchelastic_*``
    log folder in the temporary directory, 700 in one day of runs here) write their temporary
    files under one folder that is removed when the session ends. This process's own
    temporary directory (pytest's ``tmp_path``, the inductor cache) was fixed at import."""
    folder = tempfile.mkdtemp(prefix="shardopt-tests-")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    yield
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous
    shutil.rmtree(folder, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (inductor sweeps that take minutes)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs CUDA")
    skip_slow = None if config.getoption("--run-slow") else pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if skip_gpu is not None and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if skip_slow is not None and "slow" in item.keywords:
            item.add_marker(skip_slow)
