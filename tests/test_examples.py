"""The README's example runs as printed: the README shows ``examples/train.py`` as it is, the
script under torchrun on 2 CPU ranks trains (its loss falls), and a run stopped at a
checkpoint and resumed ends with the same parameters, optimizer state and losses as one that
never stopped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.processes import REPO

TRAIN = os.path.join(REPO, "examples", "train.py")


def test_readme_shows_examples_train_py_as_it_is() -> None:
    with open(TRAIN) as f:
        script = f.read()
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    assert f"```python\n{script}```\n" in readme, "README.md's copy of examples/train.py differs: paste the file"


def _train(cwd: Path, steps: int, checkpoint: str) -> list[tuple[int, str]]:
    """Run examples/train.py on 2 CPU ranks; return rank 0's ``(step, loss text)`` lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", TRAIN,
           "--steps", str(steps), "--checkpoint", checkpoint]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",  # CPU ranks (gloo) even on a GPU host
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [(int(m[1]), m[2]) for m in re.finditer(r"^step (\d+) loss (\S+)", done.stdout, re.MULTILINE)]


@pytest.mark.distributed  # starts torchrun and its ranks
def test_train_example_loss_falls_and_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    straight = _train(tmp_path, 6, "straight.pt")
    assert [s for s, _ in straight] == [1, 2, 3, 4, 5, 6]
    losses = [float(loss) for _, loss in straight]
    # From a random init the first steps cut the regression loss by more than half (30 -> 14 here).
    assert losses[-1] < 0.6 * losses[0], losses

    first = _train(tmp_path, 3, "resumed.pt")
    second = _train(tmp_path, 6, "resumed.pt")  # finds resumed.pt, continues from step 3
    assert [s for s, _ in second] == [4, 5, 6]
    assert first + second == straight  # the same losses, printed to 4 decimals

    a = torch.load(tmp_path / "straight.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert a["extra"] == b["extra"] == {"step": 6}
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        # Same data, same reduction order, Adam state restored exactly: identical arithmetic.
        torch.testing.assert_close(b["model"][name], a["model"][name], atol=0, rtol=0)
    for index, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(b["optimizer"]["state"][index][key], value, atol=0, rtol=0)


MUON_ADAMW = os.path.join(REPO, "examples", "muon_adamw.py")


def test_partition_docs_show_examples_muon_adamw_py_as_it_is() -> None:
    with open(MUON_ADAMW) as f:
        script = f.read()
    with open(os.path.join(REPO, "docs", "partition.md")) as f:
        page = f.read()
    assert f"```python\n{script}```\n" in page, "docs/partition.md's copy of examples/muon_adamw.py differs: paste the file"


@pytest.mark.distributed  # starts torchrun and its ranks
def test_muon_adamw_example_loss_falls_and_saves_plain_torch_optimizer_states(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", MUON_ADAMW,
           "--steps", "12", "--checkpoint", "ckpt.pt"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    losses = [float(m[1]) for m in re.finditer(r"^step \d+ loss (\S+)", done.stdout, re.MULTILINE)]
    assert len(losses) == 12 and losses[-1] < 0.75 * losses[0], losses  # 4.30 -> 2.49 when written
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    hidden = [name for name in saved["model"] if name.startswith("blocks.") and name.endswith("weight")
              and (".up." in name or ".down." in name)]
    assert len(hidden) == 4 and len(saved["muon"]["state"]) == 4 and len(saved["adamw"]["state"]) == 12
    # Each optimizer's consolidated state loads into the plain torch optimizer over the same split.
    muon = torch.optim.Muon([torch.nn.Parameter(saved["model"][n].clone()) for n in hidden])
    muon.load_state_dict(saved["muon"])
    assert [tuple(s["momentum_buffer"].shape) for s in muon.state.values()] == [
        tuple(saved["model"][n].shape) for n in hidden]
    others = [torch.nn.Parameter(v.clone()) for n, v in saved["model"].items() if n not in hidden]
    torch.optim.AdamW(others).load_state_dict(saved["adamw"])
