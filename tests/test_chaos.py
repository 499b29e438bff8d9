"""Chaos at 2 ranks under torchrun: ranks SIGKILLed inside forward, backward, the optimizer
step, a checkpoint save and after the final checkpoint; torchrun restarts them each time and
the run ends with the uninterrupted run's parameters, optimizer state and step, bit for bit
(fp32), with no temporary file and no process left behind; a finished job restarted with
``--resume-if-exists`` exits 0.

Kills come from the demo's fault hooks (:mod:`shardopt.app.faults`) at points drawn from a
fixed seed, so each run is the same run; ``scripts/chaos.py`` is the longer variant (more
kills, 4 ranks, bf16 with fp32 masters).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from shardopt.app.cli import main
from shardopt.app.faults import FAULTS_ENV, Fault
from tests.helpers.torchrun import (
    FAULT_LINE,
    RESUMED_LINE,
    checkpoint_differences,
    run_in_session,
    torchrun_command,
)

pytestmark = pytest.mark.distributed  # starts processes (torchrun, its ranks)

TINY = ["--model", "tiny", "--batch-size", "2", "--threads-per-rank", "1", "--warmup-steps", "0"]
RUN_TIMEOUT_S = 240.0  # a hang ends the test; a passing run takes 40 to 70 s on a loaded 2-core machine


def _schedule(seed: int, steps: int, save_every: int) -> list[Fault]:
    """Three kills in increasing steps, one in a save (rank 0: it dies with half the file
    written), two in other phases drawn from forward, backward and step; then one after the
    final checkpoint. Attempt ``a`` resumes at or before the step of kill ``a - 1``, so it
    always reaches kill ``a``."""
    rng = random.Random(seed)
    phases = ["save", *rng.sample(["forward", "backward", "step"], 2)]
    rng.shuffle(phases)
    faults, low = [], 1
    for attempt, phase in enumerate(phases):
        if phase == "save":
            step = rng.choice([s for s in range(save_every, steps, save_every) if s >= low])
            faults.append(Fault(attempt, 0, step, phase))
        else:
            step = rng.randint(low, steps - save_every)
            faults.append(Fault(attempt, rng.randrange(2), step, phase))
        low = step
    faults.append(Fault(len(phases), rng.randrange(2), steps, "exit"))
    return faults


def test_ranks_killed_in_forward_backward_step_and_save_end_with_the_uninterrupted_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    steps, save_every = 8, 2
    faults = _schedule(seed=20240611, steps=steps, save_every=save_every)
    assert {f.phase for f in faults} >= {"save", "exit"} and len(faults) == 4, faults
    spec = ",".join(f"{f.attempt}:{f.rank}:{f.step}:{f.phase}" for f in faults)
    args = ["demo", *TINY, "--steps", str(steps), "--save-every", str(save_every), "--checkpoint", "ck.pt",
            "--resume-if-exists"]
    chaos, reference = tmp_path / "chaos", tmp_path / "reference"
    chaos.mkdir()
    reference.mkdir()
    run = run_in_session(torchrun_command(2, len(faults), "shardopt", args), str(chaos), RUN_TIMEOUT_S,
                         env={FAULTS_ENV: spec})
    assert run.returncode == 0, run.text[-4000:]
    fired = [line for _, line in run.matching(FAULT_LINE)]
    assert fired == [f"{FAULT_LINE}attempt {f.attempt} rank {f.rank} step {f.step} phase {f.phase}" for f in faults], \
        run.text[-4000:]
    assert len(run.matching(RESUMED_LINE)) == len(faults) - 1, run.text[-4000:]  # the last attempt had nothing to do
    assert "nothing left to do" in run.text
    straight = subprocess.run([sys.executable, "-m", "shardopt", *args], cwd=reference, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert straight.returncode == 0, straight.stderr[-4000:]
    assert checkpoint_differences(str(reference / "ck.pt"), str(chaos / "ck.pt")) == []
    # The killed save's temporary file was removed by the next save to the same path.
    assert sorted(os.listdir(chaos)) == ["ck.pt"]
    assert run.leftovers == ()
    # The same finished job, restarted once more: it exits 0 and says so; --resume still refuses.
    assert main([*args, "--checkpoint", str(chaos / "ck.pt")]) == 0
    assert "is already at step 8 of --steps: nothing left to do" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["demo", *TINY, "--steps", str(steps), "--checkpoint", str(chaos / "ck.pt"), "--resume"])
    assert exc.value.code == 2
    assert "is at step 8 but --steps is 8: there is nothing left to train" in capsys.readouterr().err


def test_a_fault_entry_that_is_not_attempt_rank_step_phase_is_refused() -> None:
    from shardopt.app.faults import parse_faults

    assert parse_faults(" 0:1:3:backward, 2:0:8:exit ") == (Fault(0, 1, 3, "backward"), Fault(2, 0, 8, "exit"))
    for entry in ("0:1:3", "0:1:0:save", "0:x:3:step", "0:1:3:sleep"):
        with pytest.raises(ValueError, match=f"SHARDOPT_DEMO_FAULTS: entry '{entry}' is not attempt:rank:step:phase"):
            parse_faults(f"1:0:2:step,{entry}")
