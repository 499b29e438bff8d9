"""Check ``shardopt rehearse`` against real gloo runs on this machine: memory and predicted step time.

For each model, mode and world size N it runs:

1. the link: N real gloo ranks over loopback time :func:`shardopt.comm.all_gather_into` of
   pieces from 4 KiB to 8 MiB; a least-squares line ``t = a (N - 1) + sent / B`` gives the
   latency per round ``a`` and the bandwidth ``B`` (Note [the step time model]);
2. the real run: N real gloo ranks build the model with the rehearsal's own builder and run
   :func:`shardopt.app.rehearse.rehearse_on_group` (three tracked steps, then timed steps,
   each started behind a barrier); the real step time is, per step, the slowest rank's wall
   time, and the median over the timed steps;
3. the rehearsal of every rank under torch's fake group, one process each, after the real
   run, N at once with their timed steps behind a barrier (:func:`apart`), so that a
   rehearsed rank computes on the same share of this machine's cores as a real one
   (``--together``: started at the same moment as the real run, :func:`side_by_side`);
4. the slowest rank's prediction on the measured link against the real step time (the CPU
   model without overlap, the replay with overlap beside it: Note [the step time model]),
   and each rank's rehearsed peak memory against the real rank's.

Usage: ``python scripts/rehearse_check.py [--models small,27m] [--modes zero1,zero2,zero3]
[--world-sizes 2,4] [--steps 8] [--together] [--json out.json]``. Slow on purpose (real
training); numbers for docs/rehearse.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import torch

from shardopt import comm
from shardopt.app.precision import Precision
from shardopt.app.rehearse import RankRehearsal, RehearsalConfig, rehearse_on_group, rehearse_rank
from shardopt.app.rehearse_build import model_spec
from shardopt.app.step_model import Link, predict_steps
from shardopt.testing import run_ranks

_PIECES = (2**12, 2**16, 2**20, 2**23)


def _time_gather(rank: int, world: int, reps: int) -> list[tuple[float, float]]:
    out = []
    for piece in _PIECES:
        src = torch.ones(piece // 4)
        dst = torch.empty(world * (piece // 4))
        times = []
        for _ in range(reps):
            comm.barrier(None)
            t0 = time.perf_counter()
            comm.all_gather_into(dst, src, None).wait()
            times.append(time.perf_counter() - t0)
        out.append(((world - 1) * piece, statistics.median(times)))
    return out


def measure_link(world: int, reps: int = 15) -> Link:
    """Latency and bandwidth of gloo over loopback between ``world`` ranks here (least squares)."""
    results = run_ranks(_time_gather, world, reps, timeout_s=300)
    points = [(sent, max(r[i][1] for r in results)) for i, (sent, _) in enumerate(results[0])]
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    intercept = max(mean_y - slope * mean_x, 0.0)
    return Link(gbps=8 / slope / 1e9, latency_us=intercept / (world - 1) * 1e6)


def _aligned(start: Any, every: bool = False) -> Any:
    """A progress callback that waits for every rank at ``start`` before the first timed step
    (``every``: before each timed step, as the real ranks' barrier does)."""

    def progress(line: str) -> None:
        if line.startswith("timing step 1 ") or (every and line.startswith("timing step ")):
            start.wait(timeout=3600)

    return progress


def _real_rank(rank: int, world: int, config: RehearsalConfig, start: Any) -> dict[str, Any]:
    r = rehearse_on_group(config, _aligned(start))
    return {"peak": r.peak_bytes, "needed": r.needed_bytes, "walls": [t.wall_s for t in r.timelines],
            "computes": [t.compute_s for t in r.timelines]}


def _real_run(config: RehearsalConfig, queue: Any, start: Any) -> None:
    queue.put(("real", run_ranks(_real_rank, config.world_size, config, start, timeout_s=3600)))


def _fake_rank(config: RehearsalConfig, rank: int, queue: Any, start: Any, every: bool = False) -> None:
    torch.set_num_threads(1)
    queue.put((rank, rehearse_rank(config, rank, _aligned(start, every))))


def _results(procs: list[Any], queue: Any) -> dict[Any, Any]:
    """Start ``procs``, collect the ``(key, result)`` each puts on ``queue``, join them."""
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return got


def apart(config: RehearsalConfig) -> tuple[list[dict[str, Any]], dict[int, RankRehearsal]]:
    """The real N-rank run alone, then N fake ranks (one process each) whose timed steps start
    together behind a barrier, as the real ranks' do.

    Each phase runs N processes, so on a machine with fewer than N free cores a rehearsed rank
    computes on the same share of the cores as a real one (the per-step barrier keeps a rank
    that finishes early from handing its share to the others for the rest of the run), and
    the real ranks' collectives are not delayed by processes the real run would not have (the
    link is measured the same way).
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    start = ctx.Barrier(config.world_size)
    _real_run(config, queue, start)
    real = queue.get(timeout=3600)[1]
    start = ctx.Barrier(config.world_size)
    return real, _results([ctx.Process(target=_fake_rank, args=(config, r, queue, start, True))
                           for r in range(config.world_size)], queue)


def side_by_side(config: RehearsalConfig) -> tuple[list[dict[str, Any]], dict[int, RankRehearsal]]:
    """The real N-rank run and N fake ranks (one process each), all started at once (forked).

    On a machine whose cores are shared (by the N ranks, and by other work), a rank's compute
    time depends on how many processes run beside it; running the rehearsals beside the real
    run gives both the same share of the cores, whatever the rest of the machine does.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    start = ctx.Barrier(2 * config.world_size)  # the timed steps of every real and fake rank begin together
    procs = [ctx.Process(target=_real_run, args=(config, queue, start))]
    procs += [ctx.Process(target=_fake_rank, args=(config, r, queue, start)) for r in range(config.world_size)]
    got = _results(procs, queue)
    real = got.pop("real")
    return real, got


def check(model: str, mode: str, world: int, steps: int, link: Link, batch: int, seq: int,
          together: bool = False) -> dict[str, Any]:
    """One model, mode and N: the real run beside its rehearsals, and their predictions."""
    precision = Precision("bf16-master")
    config = RehearsalConfig(model_spec(model, None), mode, precision, world, batch_size=batch, seq_len=seq,
                             steps=steps, threads=1)
    load0 = os.getloadavg()[0]
    real, fake = side_by_side(config) if together else apart(config)
    per_step = [max(r["walls"][i] for r in real) for i in range(len(real[0]["walls"]))]
    measured = statistics.median(per_step)
    predictions = [_prediction(fake[r], link, measured) for r in range(world)]
    slowest = max(predictions, key=lambda p: p["predicted_s"])
    return {
        "model": model, "mode": mode, "world_size": world, "batch": batch, "seq_len": seq,
        "link": {"gbps": link.gbps, "latency_us": link.latency_us},
        "real_step_s": measured, "real_step_s_min": min(per_step), "real_step_s_max": max(per_step),
        "real_compute_s_rank0": statistics.median(real[0]["computes"]),
        "real_peak_bytes": [r["peak"] for r in real], "rehearsed_peak_bytes": [fake[r].peak_bytes for r in range(world)],
        "memory_ratios": [real[r]["peak"] / fake[r].peak_bytes for r in range(world)],
        "predicted": slowest, "per_rank": predictions, "load_before": load0, "load_after": os.getloadavg()[0],
    }


def _prediction(result: RankRehearsal, link: Link, measured: float) -> dict[str, float]:
    """The CPU model (no overlap, as ``shardopt rehearse --overlap auto`` on the CPU), and the
    overlapped replay's figure beside it for comparison."""
    p = predict_steps(result.timelines, link, overlap=False)
    replay = predict_steps(result.timelines, link, overlap=True)
    return {"compute_s": p.compute_s, "comm_s": p.comm_s, "exposed_s": p.exposed_s, "predicted_s": p.step_s,
            "error": p.step_s / measured - 1, "overlapped_s": replay.step_s,
            "overlapped_error": replay.step_s / measured - 1}


def main() -> None:
    """Run the checks and print one line per case (and ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,27m")
    parser.add_argument("--modes", default="zero1,zero2,zero3")
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", default=None)
    parser.add_argument("--together", action="store_true",
                        help="run the fake ranks beside the real ones (default: the real ranks alone, then the fake "
                             "ones; see apart())")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        link = measure_link(world)
        print(f"N={world}: gloo loopback {link.gbps:.2f} Gbit/s, {link.latency_us:.0f} us per round", flush=True)
        for model in args.models.split(","):
            for mode in args.modes.split(","):
                row = check(model, mode, world, args.steps, link, args.batch, args.seq, together=args.together)
                rows.append(row)
                pred = row["predicted"]
                print(f"{model:6} {mode:6} N={world}: real {row['real_step_s']:.3f} s "
                      f"[{row['real_step_s_min']:.3f}-{row['real_step_s_max']:.3f}] (rank 0 compute "
                      f"{row['real_compute_s_rank0']:.3f}), predicted {pred['predicted_s']:.3f} s "
                      f"({pred['error']:+.0%}; compute {pred['compute_s']:.3f}, comm {pred['comm_s']:.3f}, exposed "
                      f"{pred['exposed_s']:.3f}; overlapped {pred['overlapped_s']:.3f} s, {pred['overlapped_error']:+.0%}); "
                      f"peak real/rehearsed "
                      f"{min(row['memory_ratios']):.4f}-{max(row['memory_ratios']):.4f}; load "
                      f"{row['load_before']:.1f}->{row['load_after']:.1f}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
