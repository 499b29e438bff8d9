"""``shardopt rehearse``'s output: a memory table and a time table (rich), and the JSON."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
import torch

from shardopt.app.group_bytes import GROUP_KINDS
from shardopt.app.rehearse import CATEGORIES, RankRehearsal
from shardopt.app.step_model import Prediction, predict_steps

if TYPE_CHECKING:
    from shardopt.app.rehearse_cmd import Plan

__all__ = ["rank_row", "rehearsal_json", "render_rehearsal"]

_GIB = 2.0**30


def _unit(results: Sequence[RankRehearsal]) -> tuple[str, float]:
    """GiB, or MiB when every rank needs less than a GiB."""
    return ("GiB", _GIB) if max((r.needed_bytes for r in results), default=0) >= _GIB else ("MiB", 2.0**20)


def _bytes_per_step(result: RankRehearsal) -> dict[str, float]:
    steps = [t.bytes_by_kind() for t in result.timelines]
    return {k: statistics.fmean(s[k] for s in steps) if steps else 0.0 for k in GROUP_KINDS}


def rank_row(plan: Plan, result: RankRehearsal) -> dict[str, Any]:
    """One rank's figures as plain values (a JSON row; the tables show the same)."""
    prediction: Prediction | None = predict_steps(result.timelines, plan.link, plan.overlap) if result.timelines else None
    row: dict[str, Any] = result.as_dict()
    row["model_state_bound_bytes"] = plan.bounds.get(result.rank)
    row["fits"] = result.device_needed_bytes <= plan.device_memory
    row["headroom_bytes"] = plan.device_memory - result.device_needed_bytes
    row["bytes_per_step"] = _bytes_per_step(result)
    if prediction is not None:
        tokens = result.tokens_per_step * result.world_size
        row["prediction"] = {"compute_s": prediction.compute_s, "comm_s": prediction.comm_s,
                             "exposed_s": prediction.exposed_s, "hidden_s": prediction.hidden_s,
                             "step_s": prediction.step_s, "tokens_per_s": tokens / prediction.step_s,
                             "tokens_per_s_per_rank": result.tokens_per_step / prediction.step_s}
    return row


def _title(plan: Plan) -> str:
    c = plan.config
    layout = f", S={c.shard_size}" if c.shard_size else ""
    ckpt = ", activation checkpointing" if c.checkpointing else ""
    precision = "fp32 shards, bf16 compute" if c.mode.startswith("zero3") and c.precision.name == "bf16-master" else \
        c.precision.describe()
    delayed = " with the delayed update" if c.delayed_update else ""
    return (f"{c.spec.name} ({plan.num_params / 1e9:.3g}B params), {c.mode}{delayed} at {precision}, "
            f"rank r of N={c.world_size}{layout}, batch {c.batch_size} x {c.seq_len} tokens{ckpt}, on {c.device}")


def render_rehearsal(plan: Plan, results: Sequence[RankRehearsal], stderr: bool = False) -> None:
    """Print the memory table and the time table.

    Args:
        plan: the checked options.
        results: one per rank played.
        stderr: print on standard error.
    """
    rows = [rank_row(plan, r) for r in results]
    unit, size = _unit(results)

    def show(value: float) -> str:
        return f"{value / size:.2f}"

    memory = Table(title=escape(f"memory, {unit}: {_title(plan)}"),
                   caption=escape("peak = the steady step's peak of tracked storages, split at the same event of the "
                                  "next step (params ... other sum to it; '*' marks a step that did not repeat); "
                                  "host = what an offload mode keeps in host memory at that event (inside the "
                                  "categories), device = peak - host ('?': maybe not the step's device peak); "
                                  "needed = the largest of the peak, the build's and the first step's; "
                                  "fits = needed (with offload: device) <= --device-memory "
                                  f"{show(plan.device_memory)} {unit}, (headroom); "
                                  f"the plan's heaviest rank holds {show(max(plan.bounds.values()))} {unit} of model "
                                  "states by the ZeRO formulas over the real ownership plan (docs/rehearse.md)"))
    for name in ("rank", *CATEGORIES, "peak", "host", "device", "build", "1st step", "needed", "fits"):
        memory.add_column(name, justify="left" if name == "fits" else "right")
    for r, row in zip(results, rows, strict=True):
        parts = [show(getattr(r.memory, name)) for name in CATEGORIES]
        mark = "" if r.replay_matched else "*"
        fits = ("yes" if row["fits"] else "NO") + f" ({row['headroom_bytes'] / size:+.2f})"
        memory.add_row(str(r.rank), *parts, show(r.peak_bytes) + mark, show(r.memory.host),
                       show(r.memory.device) + ("" if r.memory.host_held else "?"),
                       show(r.build_peak_bytes),
                       show(r.first_step_peak_bytes), show(r.needed_bytes), fits)
    overlap = "communication beside compute" if plan.overlap else "communication added to compute (no overlap)"
    timing = Table(title=escape(f"time per step, on a link of {plan.link.gbps:g} Gbit/s and "
                                f"{plan.link.latency_us:g} us per round, {overlap}"),
                   caption=escape("compute = measured step time less time inside collective calls (median of the "
                                  "timed steps); comm = every collective on the link; exposed = what the replayed "
                                  "step could not hide behind compute; predicted = compute + exposed; MB/step = "
                                  "bytes this rank sends per process group kind; tokens/s over all N ranks "
                                  "(docs/rehearse.md)"))
    for name in ("rank", "compute s", "collectives", *(f"MB/step {k}" for k in GROUP_KINDS if k != "other"),
                 "comm s", "exposed s", "predicted s", "tokens/s"):
        timing.add_column(name, justify="right")
    for r, row in zip(results, rows, strict=True):
        pred = row.get("prediction")
        sent = row["bytes_per_step"]
        calls = len(r.timelines[0].calls) if r.timelines else 0
        cells = [f"{sent[k] / 1e6:.1f}" for k in GROUP_KINDS if k != "other"]
        if pred is None:
            timing.add_row(str(r.rank), "-", str(calls), *cells, "-", "-", "-", "-")
        else:
            timing.add_row(str(r.rank), f"{pred['compute_s']:.3f}", str(calls), *cells, f"{pred['comm_s']:.3f}",
                           f"{pred['exposed_s']:.3f}", f"{pred['step_s']:.3f}", f"{pred['tokens_per_s']:,.0f}")
    console = Console(stderr=stderr)
    console = console if console.is_terminal else Console(width=200, stderr=stderr)
    console.print(memory)
    console.print(timing)


def rehearsal_json(plan: Plan, results: Sequence[RankRehearsal]) -> dict[str, Any]:
    """The JSON of a rehearsal: the options, the link, one row per rank (:func:`rank_row`), the machine."""
    c = plan.config
    return {
        "command": "rehearse", "model": c.spec.name, "num_params": plan.num_params, "mode": c.mode,
        "precision": c.precision.name, "world_size": c.world_size, "shard_size": c.shard_size,
        "delayed_update": c.delayed_update, "batch_size": c.batch_size, "seq_len": c.seq_len,
        "activation_checkpointing": c.checkpointing,
        "steps": c.steps, "device": c.device, "device_memory_bytes": plan.device_memory,
        "link": {"gbps": plan.link.gbps, "latency_us": plan.link.latency_us}, "overlap": plan.overlap,
        "memory_method": "torch dispatch-mode storage tracking (docs/rehearse.md)",
        "ranks": [rank_row(plan, r) for r in results],
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "load_average_1min": os.getloadavg()[0],
                    "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
    }
