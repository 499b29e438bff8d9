"""What a killed save leaves behind is removed by the next save or load, and only when its
writer is provably gone (Note [leftovers of killed saves] in shardopt.files).

The chaos tests really kill a process mid-save: a subprocess saves a 64 MiB state and is
SIGKILLed once its temporary file (consolidated) or staging folder (sharded) holds more
than 1 MiB. The first kill is left unreaped (a zombie, as a launcher that has not yet
noticed leaves it; ``kill(pid, 0)`` still succeeds, which is how the temporary file of the
report this covers survived every later save and load), the second is reaped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from shardopt import checkpoint, files
from shardopt.integrations.checkpoints import convert_sharded
from tests.helpers.data import seeded_mlp
from tests.helpers.processes import REPO

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

_CHILD = """
import sys
import torch
from torch import nn
from shardopt import checkpoint
torch.manual_seed(int(sys.argv[3]))
model = nn.Sequential(nn.Linear(2048, 4096, bias=False), nn.Linear(4096, 2048, bias=False))
save = checkpoint.save_sharded if sys.argv[2] == "sharded" else checkpoint.save_consolidated
save(sys.argv[1], model, None, {"step": 2})
"""


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2048, 4096, bias=False), nn.Linear(4096, 2048, bias=False))  # 64 MiB


def _leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if files.parse_leftover(str(p)) is not None]


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _kill_mid_save(path: Path, kind: str, reap: bool) -> subprocess.Popen[bytes]:
    """Start a save of another model to ``path`` and SIGKILL it once its leftover holds > 1 MiB."""
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), kind, "5"], env=env)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and child.poll() is None:
            found = [p for p in _leftovers(path.parent) if files.parse_leftover(str(p)).pid == child.pid]  # type: ignore[union-attr]
            try:
                if found and _size(found[0]) > 1 << 20:
                    break
            except OSError:
                pass  # a file of dcp's renamed meanwhile
            time.sleep(0.001)
        assert child.poll() is None, "the save finished before it could be killed; save a larger state"
        child.send_signal(signal.SIGKILL)
    finally:
        if child.poll() is None and reap:
            child.kill()
    if reap:
        child.wait()
    else:  # a zombie until reaped: still "alive" for kill(pid, 0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _state(child.pid) != "Z":
            time.sleep(0.01)
        assert _state(child.pid) == "Z"
        os.kill(child.pid, 0)
    return child


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="zombies are read from /proc")
@pytest.mark.parametrize("kind", ["consolidated", "sharded"])
def test_a_save_killed_midway_leaves_a_leftover_that_the_next_load_and_save_remove(tmp_path: Path,
                                                                                  kind: str) -> None:
    path = tmp_path / ("ck.pt" if kind == "consolidated" else "ck")
    save = checkpoint.save_sharded if kind == "sharded" else checkpoint.save_consolidated
    load = checkpoint.load_sharded if kind == "sharded" else checkpoint.load_consolidated
    good = _model(0)
    save(str(path), good, None, {"step": 1})
    # Killed mid-save and not yet reaped: the next load removes the leftover and loads the last good save.
    zombie = _kill_mid_save(path, kind, reap=False)
    try:
        assert len(_leftovers(tmp_path)) == 1, os.listdir(tmp_path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            target = _model(1)
            assert load(str(path), target) == {"step": 1}
        assert not [w for w in caught if "left in place" in str(w.message)]  # removed, not merely named
        assert _equal(target, good)
        assert sorted(os.listdir(tmp_path)) == [path.name]
    finally:
        zombie.wait()
    # Killed again and reaped: the next save removes the leftover, then loads give what it saved.
    _kill_mid_save(path, kind, reap=True)
    assert len(_leftovers(tmp_path)) == 1, os.listdir(tmp_path)
    assert load(str(path), _model(1)) == {"step": 1}  # the interrupted save changed nothing
    newer = _model(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(str(path), newer, None, {"step": 3})
    assert not [w for w in caught if "left in place" in str(w.message)]
    assert sorted(os.listdir(tmp_path)) == [path.name]
    target = _model(1)
    assert load(str(path), target) == {"step": 3}
    assert _equal(target, newer)


def _named(folder: Path, name: str, pid: int, tag: str | None = None, staging: bool = False) -> Path:
    writer = f"{tag or files.writer_tag()}-{pid}"
    entry = folder / (f".{name}.shardopt-staging-{writer}" if staging else f".{name}.tmp-{writer}")
    if staging:
        entry.mkdir()
        (entry / "__0_0.distcp").write_bytes(b"half a checkpoint")
    else:
        entry.write_bytes(b"half a checkpoint")
    return entry


def test_leftovers_of_live_saves_stay_and_those_that_cannot_be_checked_are_named(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        running = [_named(tmp_path, "a.pt", live.pid), _named(tmp_path, "b", live.pid, staging=True)]
        elsewhere = [_named(tmp_path, "c.pt", live.pid, tag="node-7-0123abcd"),
                     _named(tmp_path, "d", 4242, tag="node-7-0123abcd", staging=True)]
        older = [tmp_path / f".e.pt.tmp-{live.pid}", tmp_path / ".f.shardopt-staging"]
        older[0].write_bytes(b"x")
        older[1].mkdir()
        reused = _named(tmp_path, "g.pt", live.pid)  # written before the live process started: a reused pid
        os.utime(reused, (time.time() - 3600, time.time() - 3600))
        user = [tmp_path / ".notes.tmp", tmp_path / "h.tmp-12", tmp_path / ".i.pt.tmp-node-12"]
        for path in user:
            path.write_bytes(b"the user's")
        with pytest.warns(UserWarning) as caught:
            checkpoint.save_consolidated(str(tmp_path / "ck.pt"), seeded_mlp(), None)
        messages = [str(w.message) for w in caught]
        for path in elsewhere + older:
            assert any(repr(str(path)) in m and "it was left in place" in m for m in messages), (path, messages)
        assert any("by process 4242 on host 'node-7', which cannot be checked from here" in m for m in messages)
        assert any("named by an older shardopt, without its writer's host" in m for m in messages)
        assert not any(str(path) in m for path in running + user for m in messages), messages
        assert len(messages) == len(elsewhere + older), messages
        assert all(p.exists() for p in running + elsewhere + older + user)
        assert not reused.exists()
        # The same leftovers are named once per process, not at every save.
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            with warnings.catch_warnings(record=True) as again:
                checkpoint.save_consolidated(str(tmp_path / "ck.pt"), seeded_mlp(), None)
        assert not again, [str(w.message) for w in again]
    finally:
        live.kill()
        live.wait()
    # Its writer gone, the live save's leftovers go with the next load.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpoint.load_consolidated(str(tmp_path / "ck.pt"), seeded_mlp())
    assert not any(p.exists() for p in running)
    assert files.tidy(str(tmp_path)) == files.Tidied((), tuple(sorted(str(p) for p in elsewhere + older)))


def test_a_temp_name_is_read_back_whatever_the_host_name() -> None:
    for host in ("node-7", "a.b-c", "x"):
        item = files.parse_leftover(f"/data/.ck.pt.tmp-{host}-0123abcd-77")
        assert item is not None and (item.target, item.staging, item.tag, item.pid) == (
            "/data/ck.pt", False, f"{host}-0123abcd", 77)
    item = files.parse_leftover(f"/data/.ck.shardopt-staging-{files.writer_tag()}-9")
    assert item is not None and (item.target, item.staging, item.pid) == ("/data/ck", True, 9)
    assert os.path.basename(files.temp_path("/data/ck.pt")) == f".ck.pt.tmp-{files.writer_tag()}-{os.getpid()}"
    for other in ("/data/ck.pt", "/data/.ck.pt", "/data/.ck.pt.tmp-", "/data/.ck.pt.tmp-host-12",
                  "/data/.ck.shardopt-staging2", "/data/ck.pt.tmp-12"):
        assert files.parse_leftover(other) is None, other


def test_a_convert_leaves_no_scratch_file_and_removes_a_killed_ones(tmp_path: Path) -> None:
    checkpoint.save_sharded(str(tmp_path / "ck"), seeded_mlp(), None, {"step": 1})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    scratch = _named(tmp_path, "full.pt.shardopt-convert", dead.pid)
    half = _named(tmp_path, "full.pt", dead.pid)
    names = convert_sharded(str(tmp_path / "ck"), str(tmp_path / "full.pt"))
    assert names == sorted(seeded_mlp().state_dict())
    assert not scratch.exists() and not half.exists()
    assert sorted(os.listdir(tmp_path)) == ["ck", "full.pt"]
    saved: Any = torch.load(tmp_path / "full.pt", weights_only=True)
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in seeded_mlp().state_dict().items())
