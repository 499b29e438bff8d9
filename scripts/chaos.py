"""Chaos for ``shardopt demo`` under torchrun: kill ranks many times, check the run ends bit-exact.

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python scripts/chaos.py                                  # 2 and 4 ranks, bf16 + fp32 masters
    OMP_NUM_THREADS=1 python scripts/chaos.py --world-sizes 2 --precision fp32 --kills 8 --seed 3

For each world size it runs the demo three times with the same arguments:

1. uninterrupted (the reference), with the demo's own launcher;
2. under torchrun with ``--kills`` kills at points drawn from ``--seed`` through the demo's
   fault hooks (``SHARDOPT_DEMO_FAULTS``, :mod:`shardopt.app.faults`): a random rank inside
   forward, backward, the optimizer step or a checkpoint save (rank 0 then dies with half
   the file written), at increasing steps, and finally one after the last checkpoint, so
   the last restart finds a finished job;
3. under torchrun with ``--random-kills`` SIGKILLs from outside, of a random rank at a
   random time (0.2 s to ``--max-delay-s``, by default 0.8 times the uninterrupted run's wall
   time, after its attempt's ranks appear): in imports,
   the group's check-in, the checkpoint load, training or a save (each kill says whether
   its attempt's group had formed).

Each torchrun run must exit 0 and end with the reference's checkpoint (model, optimizer state
with the fp32 masters, step) bit for bit, with no temporary file beside it and no process left
in its session. Recovery time per restart is from the kill to the restarted attempt's
"resumed from step" line (its group formed, model built, checkpoint loaded); "group" is
from the kill to rank 0's "training ..." line (the group formed). Exit code 0 when every run
passed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardopt.app.faults import FAULTS_ENV, Fault
from tests.helpers.processes import REPO, session_processes
from tests.helpers.torchrun import (
    FAULT_LINE,
    MARK_ENV,
    RESUMED_LINE,
    checkpoint_differences,
    marked_processes,
    torchrun_command,
)

GROUP_LINE = "shardopt demo: training "
DONE_LINE = "nothing left to do"


@dataclass
class Outcome:
    """One torchrun run: what happened and what it left."""

    name: str
    returncode: int | None = None
    seconds: float = 0.0
    kills: list[tuple[float, str]] = field(default_factory=list)
    lines: list[tuple[float, str]] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    stray_files: list[str] = field(default_factory=list)
    leftovers: list[int] = field(default_factory=list)

    def recoveries(self) -> list[tuple[float, float]]:
        """Per kill: seconds to the next attempt's "training" line (its group formed) and to its
        "resumed"/"nothing left" line (``nan`` where it has none: it started from step 0, or
        was killed first).

        The next attempt's lines are those after the agent reported the failure ("failed
        (exitcode"), so a line the dying attempt's other ranks print late is not taken.
        """
        out = []
        nan = float("nan")
        kill_times = [t for t, _ in self.kills] + [float("inf")]
        for i, (t_kill, _) in enumerate(self.kills):
            failed = next((t for t, line in self.lines if t >= t_kill and "failed (exitcode" in line), nan)
            after = [(t, line) for t, line in self.lines if failed < t < kill_times[i + 1]]
            group = next((t for t, line in after if GROUP_LINE in line), nan)
            back = next((t for t, line in after if (RESUMED_LINE in line or DONE_LINE in line)), nan)
            out.append((group - t_kill, back - t_kill))
        return out

    @property
    def passed(self) -> bool:
        return (self.returncode == 0 and not self.differences and not self.stray_files and not self.leftovers
                and bool(self.kills))


def schedule(rng: random.Random, kills: int, world: int, steps: int, save_every: int) -> list[Fault]:
    """``kills`` faults at non-decreasing steps (attempt a resumes at or before kill a-1's step,
    so it reaches kill a), then one after the final checkpoint."""
    faults, low = [], 1
    saves = list(range(save_every, steps, save_every))
    for attempt in range(kills):
        phase = rng.choice(["forward", "backward", "step", "save"])
        if phase == "save" and [s for s in saves if s >= low]:
            step = rng.choice([s for s in saves if s >= low][:3])
            rank = rng.randrange(world)
        else:
            phase = phase if phase != "save" else "step"
            step = rng.randint(low, min(steps, low + 2 * save_every))
            rank = rng.randrange(world)
        faults.append(Fault(attempt, rank, step, phase))
        low = step
    faults.append(Fault(kills, rng.randrange(world), steps, "exit"))
    return faults


def _rank_pids(agent: int) -> dict[int, int]:
    """``{rank: pid}`` of the agent's live worker processes."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != agent or fields[0] == "Z":
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in env and b"TORCHELASTIC_RESTART_COUNT" in env:
            ranks[int(env[b"RANK"])] = int(entry)
    return ranks


def _killer(proc: subprocess.Popen[str], outcome: Outcome, start: float, count: int, rng: random.Random,
            max_delay_s: float, stop: threading.Event) -> None:
    """SIGKILL a random rank at a random time after each new attempt's ranks appear, ``count`` times."""
    seen: set[int] = set()
    while len(outcome.kills) < count and not stop.is_set():
        ranks = _rank_pids(proc.pid)
        if not ranks or set(ranks.values()) <= seen:
            time.sleep(0.05)
            continue
        seen |= set(ranks.values())
        began = time.monotonic() - start
        if stop.wait(rng.uniform(0.2, max_delay_s)):
            return
        live = _rank_pids(proc.pid)
        if not live:
            continue
        rank = rng.choice(sorted(live))
        try:
            os.kill(live[rank], signal.SIGKILL)
            now = time.monotonic() - start
            formed = any(GROUP_LINE in line or DONE_LINE in line for t, line in list(outcome.lines) if t > began)
            where = "after its group formed" if formed else "in start-up, before its group formed"
            outcome.kills.append((now, f"SIGKILL rank {rank} {now - began:.1f} s into its attempt, {where}"))
        except ProcessLookupError:
            pass


def run_torchrun(name: str, command: list[str], cwd: Path, env: dict[str, str], timeout_s: float,
                 random_kills: int = 0, rng: random.Random | None = None, max_delay_s: float = 6.0) -> Outcome:
    outcome = Outcome(name)
    mark = f"chaos-{name}-{os.getpid()}-{time.monotonic_ns()}"
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
                    OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env, **{MARK_ENV: mark})
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    stop = threading.Event()
    killer = None
    if random_kills:
        assert rng is not None
        killer = threading.Thread(target=_killer, args=(proc, outcome, start, random_kills, rng, max_delay_s, stop),
                                  daemon=True)
        killer.start()
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() - start < timeout_s:
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
                if not line:
                    break
                now = time.monotonic() - start
                outcome.lines.append((now, line.rstrip("\n")))
                if FAULT_LINE in line:
                    outcome.kills.append((now, line.strip()[len(FAULT_LINE):]))
    stop.set()
    try:
        outcome.returncode = proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's ranks have sessions of their own: found below
        proc.wait()
    outcome.seconds = time.monotonic() - start
    if killer is not None:
        killer.join(timeout=5)
    for _ in range(20):
        outcome.leftovers = sorted(set(session_processes(proc.pid)) | set(marked_processes(mark)))
        if not outcome.leftovers:
            break
        time.sleep(0.1)
    for pid in outcome.leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return outcome


def one_world_size(args: argparse.Namespace, world: int, root: Path, rng: random.Random) -> list[Outcome]:
    demo = ["demo", "--model", args.model, "--mode", args.mode, "--precision", args.precision, "--steps",
            str(args.steps), "--save-every", str(args.save_every), "--global-batch-size", str(args.global_batch_size),
            "--threads-per-rank", "1", "--warmup-steps", "0", "--checkpoint", "ck.pt", "--resume-if-exists"]
    reference = root / f"reference-{world}"
    reference.mkdir()
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "shardopt", *demo, "--world-size", str(world)], cwd=reference,
                          capture_output=True, text=True, timeout=args.timeout_s,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO))
    if done.returncode != 0:
        raise SystemExit(f"chaos: the uninterrupted run at {world} ranks failed:\n{done.stderr[-3000:]}")
    straight_s = time.monotonic() - t0
    print(f"[{world} ranks] uninterrupted run: {straight_s:.1f} s", flush=True)
    max_delay_s = args.max_delay_s if args.max_delay_s is not None else 0.8 * straight_s
    outcomes = []
    faults = schedule(rng, args.kills, world, args.steps, args.save_every)
    spec = ",".join(f"{f.attempt}:{f.rank}:{f.step}:{f.phase}" for f in faults)
    runs = [("hooks", {FAULTS_ENV: spec}, len(faults), 0), ("random", {}, args.random_kills, args.random_kills)]
    for name, env, restarts, random_kills in runs:
        if restarts == 0:
            continue
        where = root / f"{name}-{world}"
        where.mkdir()
        print(f"[{world} ranks] {name}: " + (spec if name == "hooks" else f"{random_kills} kills from outside"),
              flush=True)
        command = torchrun_command(world, restarts, "shardopt", demo)
        outcome = run_torchrun(f"{name}-{world}", command, where, env, args.timeout_s, random_kills, rng,
                               max_delay_s)
        if (where / "ck.pt").exists():
            outcome.differences = checkpoint_differences(str(reference / "ck.pt"), str(where / "ck.pt"))
        else:
            outcome.differences = ["no checkpoint"]
        outcome.stray_files = sorted(set(os.listdir(where)) - {"ck.pt"})
        outcomes.append(outcome)
        report(outcome)
        if not outcome.passed:
            print("\n".join(line for _, line in outcome.lines[-60:]))
    return outcomes


def report(o: Outcome) -> None:
    rec = o.recoveries()
    back = [b for _, b in rec if b == b]
    group = [g for g, _ in rec if g == g]
    print(f"  {o.name}: exit {o.returncode}, {len(o.kills)} kills, {o.seconds:.1f} s; "
          f"checkpoint {'bit-exact' if not o.differences else f'DIFFERS in {len(o.differences)} entries'}; "
          f"stray files {o.stray_files or 'none'}; leftover processes {o.leftovers or 'none'}", flush=True)
    for (t, what), (g, b) in zip(o.kills, rec, strict=True):
        print(f"    at {t:6.1f} s {what}: group formed again after {g:.1f} s, resumed after {b:.1f} s", flush=True)
    if back:
        print(f"  recovery (kill -> resumed): median {statistics.median(back):.1f} s, max {max(back):.1f} s; "
              f"kill -> group formed: median {statistics.median(group):.1f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated (default 2,4)")
    parser.add_argument("--precision", default="bf16-master", choices=["fp32", "bf16", "bf16-master"])
    parser.add_argument("--mode", default="zero2")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--kills", type=int, default=6, help="fault-hook kills per world size (default 6)")
    parser.add_argument("--random-kills", type=int, default=3, help="kills from outside at random times (default 3)")
    parser.add_argument("--max-delay-s", type=float, default=None,
                        help="random kills land 0.2 s to this long after their attempt's ranks appear (default: "
                             "0.8 x the uninterrupted run's wall time, so most land before the run ends)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="per run")
    parser.add_argument("--json", default=None, help="write the outcomes here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="shardopt-chaos-") as tmp:
        for world in (int(w) for w in args.world_sizes.split(",")):
            outcomes += one_world_size(args, world, Path(tmp), rng)
    back = [b for o in outcomes for _, b in o.recoveries() if b == b]
    print(f"chaos: {sum(o.passed for o in outcomes)} of {len(outcomes)} runs passed, "
          f"{sum(len(o.kills) for o in outcomes)} kills; recovery per restart median "
          f"{statistics.median(back) if back else float('nan'):.1f} s, max {max(back) if back else float('nan'):.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([{
            "name": o.name, "returncode": o.returncode, "seconds": o.seconds, "kills": o.kills,
            "recoveries_s": o.recoveries(), "differences": o.differences, "stray_files": o.stray_files,
            "leftovers": o.leftovers, "passed": o.passed} for o in outcomes], indent=2))
    return 0 if outcomes and all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
