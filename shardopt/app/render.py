"""What the ``shardopt`` command shows: the demo's rank entry point, progress bar and tables.

The demo entry point :func:`demo_rank` runs on every rank (started by the elastic launcher
or by torchrun); global rank 0 draws a rich progress bar while training and then the
per-rank table, and writes the JSON. The estimate and bench tables are drawn by the
launching process.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import IO, TYPE_CHECKING, Any

import torch.distributed as dist
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from shardopt.app import runner
from shardopt.files import atomic_write
from shardopt.memory import GB, ModelStateEstimate, PlanEstimate, StageBytes, capabilities

if TYPE_CHECKING:  # the measurement (and torch's fake group) loads only with estimate --measure
    from shardopt.app.measure import Measurement

__all__ = ["JSON_TO_STDOUT", "demo_rank", "demo_table", "estimate_rows", "hybrid_rows", "machine_info",
           "measured_rows", "mib", "offload_rows", "render_estimate", "render_hybrid", "render_measured",
           "render_offload", "render_plan", "stdout_kept_for_json", "write_json"]

JSON_TO_STDOUT = "-"
"""``--json -``: the JSON goes to standard output, and everything else to standard error."""

MiB = 2.0**20


def mib(value: float | None) -> str:
    """``value`` bytes as MiB with one decimal, or ``"n/a"``."""
    return "n/a" if value is None else f"{value / MiB:.1f}"


def machine_info() -> dict[str, Any]:
    """Where and when a measurement was taken, for JSON and captions."""
    return {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "measures": capabilities()}


def write_json(path: str, payload: dict[str, Any], stdout: IO[str] | None = None) -> None:
    """Write ``payload`` as indented JSON to ``path`` atomically (temp file, then rename).

    Args:
        path: the file, or :data:`JSON_TO_STDOUT` for standard output.
        payload: plain values.
        stdout: where :data:`JSON_TO_STDOUT` writes (the stream :func:`stdout_kept_for_json`
            yields); ``sys.stdout`` when ``None``.
    """
    if path == JSON_TO_STDOUT:
        out = sys.stdout if stdout is None else stdout
        out.write(json.dumps(payload, indent=2) + "\n")
        out.flush()
        return
    text = json.dumps(payload, indent=2).encode()

    def write(f: IO[bytes]) -> None:
        f.write(text)

    atomic_write(path, write)


# Note [JSON on standard output]
# With `--json -` a script reads the JSON from standard output, so nothing else may reach it:
# not the rich tables and progress bars (they take a stderr console), and not what libraries
# print from inside a rank either (DeepSpeed's logger writes to stdout). So each process that
# might print points its file descriptor 1 at standard error for the whole run and keeps a
# duplicate of the original for the JSON alone. A rank must do this itself: ranks come from a
# fork server that may have been started before, with the original standard output.


@contextmanager
def stdout_kept_for_json(active: bool) -> Iterator[IO[str] | None]:
    """While ``active``, send this process's standard output to standard error and yield a
    stream to the original standard output, for the JSON only (Note [JSON on standard output]).

    Args:
        active: whether the JSON goes to standard output (``--json -``); when ``False``
            nothing changes and ``None`` is yielded.

    Yields:
        The stream to write the JSON to, or ``None``.
    """
    if not active:
        yield None
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    kept = os.fdopen(os.dup(saved), "w")
    try:
        yield kept
    finally:
        kept.close()
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def demo_table(job: runner.TrainJob, reports: Sequence[runner.RankReport]) -> Table:
    """The demo's closing table: one row per rank, and the mean loss in the caption.

    Args:
        job: the job that ran.
        reports: every rank's report.

    Returns:
        The rich table.
    """
    first = reports[0]
    mean_loss = statistics.fmean(r.final_loss for r in reports)
    median = statistics.median(r.median_step_s for r in reports if r.median_step_s is not None) \
        if all(r.median_step_s is not None for r in reports) else None
    tokens_s = f"{first.tokens_per_step / median:,.0f}" if median else "n/a"
    on_gpu = any(r.device_peak is not None for r in reports)
    offload = any(r.host_state_bytes for r in reports)  # Note [counting offloaded state] in shardopt.app.state_count
    precision = ("" if job.precision.name == "fp32" else f" ({job.precision.describe()})") + (
        ", blocks compiled" if job.compile else "")
    table = Table(title=f"shardopt demo: {job.mode}{precision}, model {job.preset} ({first.num_params / 1e6:.2f}M params), "
                        f"{first.world_size} ranks ({first.backend})",
                  caption=f"final loss (mean over ranks) {mean_loss:.4f}; {tokens_s} tokens/s; steps "
                          f"{first.start_step}->{job.steps}, statistics over {first.counted_steps} steps after "
                          f"{job.warmup_steps} warm-up; heap is relative to before the model was built"
                          + ("; states: model states on the training device after the step and offloaded to the "
                             "host at the update" + ("" if on_gpu else " (CPU ranks: both in host memory, both in the heap)")
                             if offload else "")
                          + (f"; checkpoint: {job.checkpoint_path}" if job.checkpoint_path else ""))
    hybrid = job.shard_size is not None  # bytes by group: Note [bytes per group] in shardopt.app.group_bytes
    for name in ("rank", "heap after step (MiB)", "heap peak (MiB)", *(("GPU peak (MiB)",) if on_gpu else ()),
                 *(("states on device (MiB)", "states on host (MiB)") if offload else ()), "sent/step (MiB)",
                 *((f"world / shard ({job.shard_size}) / replicate (MiB)",) if hybrid else ()),
                 "median step (ms)", "final loss"):
        table.add_column(name, justify="right")
    for r in reports:
        step_ms = "n/a" if r.median_step_s is None else f"{1000 * r.median_step_s:.1f}"
        gpu = (mib(r.device_peak),) if on_gpu else ()
        groups = r.group_bytes_per_step
        by_group = (("n/a" if groups is None else " / ".join(mib(groups[k]) for k in ("world", "shard", "replicate")),)
                    if hybrid else ())
        held = (mib(r.device_state_bytes), mib(r.host_state_bytes)) if offload else ()
        table.add_row(str(r.rank), mib(r.heap_after_step), mib(r.heap_peak), *gpu, *held, mib(r.bytes_per_step),
                      *by_group, step_ms, f"{r.final_loss:.4f}")
    return table


@record
def demo_rank(job: runner.TrainJob, json_path: str | None) -> list[dict[str, Any]] | None:
    """One rank of ``shardopt demo``: join the group, train, and on rank 0 show and save results.

    Args:
        job: the training job (identical on every rank).
        json_path: where rank 0 writes the JSON results, or ``None``.

    Returns:
        On global rank 0 every rank's report as dicts; ``None`` on other ranks.
    """
    with stdout_kept_for_json(json_path == JSON_TO_STDOUT) as json_stream:
        return _demo_rank(job, json_path, json_stream)


def _demo_rank(job: runner.TrainJob, json_path: str | None, json_stream: IO[str] | None) -> list[dict[str, Any]] | None:
    runner.init_process_group_from_env(device=job.device)
    try:
        rank = dist.get_rank()
        console = Console(stderr=json_stream is not None)
        if rank != 0:
            runner.train(job)
            return None
        precision = ("" if job.precision.name == "fp32" else f" ({job.precision.describe()})") + (
            ", blocks compiled" if job.compile else "")
        console.print(f"shardopt demo: training {job.preset} with {job.mode}{precision} on {dist.get_world_size()} "
                      f"ranks, {job.steps} steps")
        columns = (TextColumn("step"), MofNCompleteColumn(), BarColumn(), TextColumn("loss {task.fields[loss]}"),
                   TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn())
        # No refresh thread: the bar is drawn in on_step only, outside the measured window, so
        # rank 0's terminal writes never count as bytes sent (wchar counts every write).
        with Progress(*columns, console=console, transient=False, auto_refresh=False) as progress:
            task = progress.add_task("train", total=job.steps, loss="-", tps="-")

            def on_step(info: runner.StepInfo) -> None:
                progress.update(task, completed=info.step, loss=f"{info.loss:.4f}", tps=f"{info.tokens_per_s:,.0f}",
                                refresh=True)

            def on_resume(step: int) -> None:  # a line, so a restarted job's log says where it resumed
                progress.update(task, completed=step)
                console.print(f"shardopt demo: resumed from step {step} of {job.steps} ({job.checkpoint_path})",
                              soft_wrap=True)

            reports = runner.train(job, on_step, on_resume)
        console.print(demo_table(job, reports))
        payload = [r.as_dict() for r in reports]
        if json_path:
            write_json(json_path, {"command": "demo", "job": asdict(job), "machine": machine_info(),
                                    "final_loss": statistics.fmean(r.final_loss for r in reports),
                                    "ranks": payload}, json_stream)
        return payload
    finally:
        dist.destroy_process_group()


# (stage, the shardopt configuration that holds it, its bench mode or None), per precision
_SETUPS = {
    "mixed": (
        ("DDP", "DDP, bf16 params, fp32 masters + Adam on every rank (the paper's baseline; no shardopt mode)", None),
        ("ZeRO-1", "DDP(bf16 model) + OSS(Adam, master_dtype=torch.float32)", "zero1-bf16m"),
        ("ZeRO-2", "ShardedDataParallel(bf16 model, OSS(Adam, master_dtype=torch.float32))", "zero2-bf16m"),
        ("ZeRO-3", ("FullyShardedDataParallel(model, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)) "
                    "+ Adam"), None),
    ),
    "fp32": (
        ("DDP", "DDP(model) + Adam", "ddp"),
        ("ZeRO-1", "DDP(model) + OSS(Adam)", "zero1"),
        ("ZeRO-2", "ShardedDataParallel(model, OSS(Adam))", "zero2"),
        ("ZeRO-3", "FullyShardedDataParallel(model) + Adam", "zero3"),
    ),
}


def estimate_rows(est: ModelStateEstimate) -> list[dict[str, Any]]:
    """One row per stage: the stage, the shardopt configuration that reaches it, its bench
    mode (or ``None``), the paper's bytes per rank and the bytes during the step.

    Args:
        est: the estimate.

    Returns:
        The rows, DDP first, as plain values for the table and the JSON.
    """
    paper = (est.ddp, est.stage1, est.stage2, est.stage3)
    at_step = (est.ddp, est.stage1_at_step, est.stage2_at_step, est.stage3)
    setups = _SETUPS["mixed" if est.param_bytes == 2 else "fp32"]
    return [{"stage": stage, "configuration": configuration, "bench_mode": bench, "bytes": value,
             "at_step_bytes": step}
            for (stage, configuration, bench), value, step in zip(setups, paper, at_step, strict=True)]


def _gb(value: float) -> str:
    return f"{value / GB:.1f}" if value >= GB else f"{value / GB:.3f}"


def render_estimate(est: ModelStateEstimate, stderr: bool = False) -> None:
    """Print the ZeRO-paper estimate as a rich table, each row labelled with the shardopt
    configuration that reaches it.

    Args:
        est: the estimate to show.
        stderr: print on standard error (``--json -`` keeps standard output for the JSON).
    """
    mixed = est.param_bytes == 2
    precision = "mixed precision (bf16 params, fp32 master weights)" if mixed else "fp32"
    table = Table(title=f"model states per rank: {est.num_params:,} params, {est.world_size} ranks, {precision}, "
                        f"K={est.optimizer_bytes_per_param:g}",
                  caption="ZeRO paper (Rajbhandari et al. 2020) formulas; GB = 1e9 bytes; activations, buffers "
                          "and fragmentation not included"
                          + ("; during the step: shardopt's owner holds its gradients as fp32 master gradients "
                             "from the reduction to the end of the step (4 bytes, not the paper's 2, on 1/N of the "
                             "parameters)" if mixed else "")
                          + ("" if mixed else "; shardopt estimate without --fp32 for bf16 parameters with fp32 "
                             "masters"))
    table.add_column("stage", no_wrap=True)
    table.add_column("shardopt configuration (bench mode)", overflow="fold")
    table.add_column("bytes per rank", justify="right")
    table.add_column("GB", justify="right")
    table.add_column("vs DDP", justify="right")
    if mixed:
        table.add_column("GB during the step", justify="right")
    for row in estimate_rows(est):
        label = row["configuration"] + (f" ({row['bench_mode']})" if row["bench_mode"] else "")
        step = (_gb(row["at_step_bytes"]),) if mixed else ()
        table.add_row(row["stage"], label, f"{row['bytes']:,.0f}", _gb(row["bytes"]),
                      f"{row['bytes'] / est.ddp:.3f}x", *step)
    console = Console(stderr=stderr)
    (console if console.is_terminal else Console(width=160, stderr=stderr)).print(table)
    if est.largest_layer_params is not None:
        console.print(f"largest parameter tensor: {est.largest_layer_params:,} params; ZeRO-3 gathers at least "
                        f"{est.largest_layer_params * est.param_bytes / GB:.3f} GB at once")


def plan_rows(plan: PlanEstimate) -> list[dict[str, Any]]:
    """The heaviest rank under each real plan, as plain values: stage, plan, bytes, bytes
    during the step, imbalance and the ratio to the formula (Note [the formula and the plan]).

    Args:
        plan: the plan estimate.

    Returns:
        ZeRO-1 whole, ZeRO-1 split, ZeRO-2 whole, ZeRO-2 split.
    """
    f = plan.formula
    rows = []
    for stage, formula, bytes_of, at_step_of in (("ZeRO-1", f.stage1, plan.stage1, plan.stage1_at_step),
                                                 ("ZeRO-2", f.stage2, plan.stage2, plan.stage2_at_step)):
        for split in (False, True):
            value = bytes_of(split)
            rows.append({"stage": stage, "plan": "row-split (OSS default, elementwise optimizers)" if split else
                         "whole parameters (matrix-wise optimizers)", "bytes": value, "at_step_bytes": at_step_of(split),
                         "imbalance": plan.split_imbalance if split else plan.unsplit_imbalance,
                         "vs_formula": value / formula})
    return rows


def render_plan(plan: PlanEstimate, stderr: bool = False) -> None:
    """Print the heaviest rank of the real ownership plans next to the formula.

    Args:
        plan: the plan estimate.
        stderr: print on standard error.
    """
    f = plan.formula
    mixed = f.param_bytes == 2
    table = Table(title=f"heaviest rank under shardopt's ownership plans: {f.world_size} ranks",
                  caption="imbalance = heaviest rank's owned parameters over the mean; row-split: "
                          f"shardopt.partition.plan_split ({plan.split_param_count} parameters cut into dim-0 row "
                          "blocks), what OSS (and ShardedDataParallel with it) plans by default for an optimizer "
                          "that updates elementwise (AdamW, SGD, ...); whole parameters: "
                          "shardopt.partition.partition_by_size, its plan for a matrix-wise optimizer (Muon, "
                          "Adafactor) or with split_large_params=False; ZeRO-3 shards evenly by elements, as its "
                          "formula row")
    table.add_column("stage", no_wrap=True)
    table.add_column("plan")
    table.add_column("GB, heaviest rank", justify="right")
    if mixed:
        table.add_column("GB during the step", justify="right")
    table.add_column("imbalance", justify="right")
    table.add_column("vs formula", justify="right")
    for row in plan_rows(plan):
        step = (_gb(row["at_step_bytes"]),) if mixed else ()
        table.add_row(row["stage"], row["plan"], _gb(row["bytes"]), *step, f"{row['imbalance']:.3f}x",
                      f"{row['vs_formula']:.3f}x")
    console = Console(stderr=stderr)
    (console if console.is_terminal else Console(width=160, stderr=stderr)).print(table)


def hybrid_rows(flat: ModelStateEstimate, hybrid: ModelStateEstimate, plan: PlanEstimate | None) -> list[dict[str, Any]]:
    """ZeRO-1 and ZeRO-2, flat over N ranks and hybrid over shard groups of S, as plain values.

    The hybrid rows are the same formulas and plans with N replaced by S: ownership is
    planned over the shard group, whose S ranks split the optimizer state (and, for ZeRO-2,
    the gradients); the R = N / S groups hold equal copies.

    Args:
        flat: the formula at N ranks.
        hybrid: the formula at S ranks.
        plan: the real ownership plans over S ranks, or ``None`` for a bare parameter count.

    Returns:
        For each stage: flat formula, hybrid formula, then (with ``plan``) the heaviest rank of
        the hybrid whole-parameter and row-split plans; each with ``sharded_fraction`` (1/N
        or 1/S of the sharded terms) and ``vs_flat`` (bytes over the flat formula's).
    """
    n, s = flat.world_size, hybrid.world_size
    rows: list[dict[str, Any]] = []
    for stage, name in (("ZeRO-1", "stage1"), ("ZeRO-2", "stage2")):
        base = getattr(flat, name)
        entries = [(f"flat, {n} ranks", "formula", 1 / n, base, getattr(flat, f"{name}_at_step")),
                   (f"hybrid, shard groups of {s} ({n // s} replicas)", "formula", 1 / s, getattr(hybrid, name),
                    getattr(hybrid, f"{name}_at_step"))]
        if plan is not None:
            for split in (False, True):
                entries.append((f"hybrid, shard groups of {s} ({n // s} replicas)",
                                "row-split plan, heaviest rank" if split else "whole-parameter plan, heaviest rank",
                                (plan.split_heaviest_params if split else plan.unsplit_heaviest_params) /
                                hybrid.num_params, getattr(plan, name)(split), getattr(plan, f"{name}_at_step")(split)))
        rows.extend({"stage": stage, "layout": layout, "plan": how, "sharded_fraction": fraction, "bytes": value,
                     "at_step_bytes": step, "vs_flat": value / base}
                    for layout, how, fraction, value, step in entries)
    return rows


def render_hybrid(flat: ModelStateEstimate, hybrid: ModelStateEstimate, plan: PlanEstimate | None,
                  stderr: bool = False) -> None:
    """Print :func:`hybrid_rows` as a rich table.

    Args:
        flat: the formula at N ranks.
        hybrid: the formula at S ranks.
        plan: the real plans over S ranks, or ``None``.
        stderr: print on standard error.
    """
    mixed = flat.param_bytes == 2
    table = Table(title=f"hybrid sharding: shard groups of {hybrid.world_size} ranks, {flat.world_size} ranks in all",
                  caption="sharded = optimizer state (ZeRO-1), and gradients (ZeRO-2): planned over the shard group, "
                          "so 1/S of the model per rank instead of 1/N; parameters stay whole on every rank; "
                          "bench mode zero1-hybrid with --shard-size S (docs/hybrid.md)")
    for name in ("stage", "layout", "plan"):
        table.add_column(name, overflow="fold")
    table.add_column("sharded share", justify="right")
    table.add_column("GB per rank", justify="right")
    if mixed:
        table.add_column("GB during the step", justify="right")
    table.add_column("vs flat", justify="right")
    for row in hybrid_rows(flat, hybrid, plan):
        step = (_gb(row["at_step_bytes"]),) if mixed else ()
        table.add_row(row["stage"], row["layout"], row["plan"], f"{row['sharded_fraction']:.4f}", _gb(row["bytes"]),
                      *step, f"{row['vs_flat']:.3f}x")
    console = Console(stderr=stderr)
    (console if console.is_terminal else Console(width=160, stderr=stderr)).print(table)


# (stage, offloaded) -> the bench mode that holds it, per precision (None: no such mode)
_OFFLOAD_MODES: dict[str, dict[tuple[str, bool], str | None]] = {
    "mixed": {("DDP", False): None, ("ZeRO-1", False): "zero1-bf16m", ("ZeRO-1", True): "zero1-offload-bf16m",
              ("ZeRO-2", False): "zero2-bf16m", ("ZeRO-2", True): "zero2-offload-bf16m", ("ZeRO-3", False): None,
              ("ZeRO-3", True): None},
    "fp32": {("DDP", False): "ddp", ("ZeRO-1", False): "zero1", ("ZeRO-1", True): "zero1-offload",
             ("ZeRO-2", False): "zero2", ("ZeRO-2", True): "zero2-offload", ("ZeRO-3", False): "zero3",
             ("ZeRO-3", True): "zero3-offload"},
}


def offload_rows(rows: Sequence[StageBytes], num_params: int, mixed: bool) -> list[dict[str, Any]]:
    """:func:`~shardopt.memory.estimate_offload`'s rows as plain values, with bytes per rank for
    ``num_params`` parameters and the bench mode of each (``None`` where there is none: the bench
    modes never delay the update, so a row counting its copy has none).

    Args:
        rows: the stages.
        num_params: the model's parameters.
        mixed: bf16 parameters with fp32 masters (else fp32).

    Returns:
        One dict per stage: its :meth:`~shardopt.memory.StageBytes.as_dict`, ``bench_mode``,
        ``device_bytes``, ``host_bytes`` and ``host_peak_bytes``.
    """
    modes = _OFFLOAD_MODES["mixed" if mixed else "fp32"]
    return [{**r.as_dict(), "bench_mode": None if r.delayed_update else modes[(r.stage, r.offload)],
             "device_bytes": r.device * num_params,
             "host_bytes": r.host * num_params, "host_peak_bytes": r.host_peak * num_params} for r in rows]


def render_offload(rows: Sequence[StageBytes], num_params: int, mixed: bool, stderr: bool = False) -> None:
    """Print device and host bytes per parameter and per rank for each stage, with and without
    offload (``shardopt estimate --offload cpu``; Note [offload bytes per parameter] in
    :mod:`shardopt.memory`).

    Args:
        rows: :func:`~shardopt.memory.estimate_offload`'s stages.
        num_params: the model's parameters.
        mixed: bf16 parameters with fp32 masters (else fp32).
        stderr: print on standard error.
    """
    n, delayed = rows[0].world_size, any(r.delayed_update for r in rows)
    table = Table(title=f"device and host memory, {n} ranks, {'bf16 params + fp32 masters' if mixed else 'fp32'}, "
                        f"Adam: without and with offload{' (ZeRO-1/2: and the delayed update)' if delayed else ''}",
                  caption="B/param = bytes per parameter of the model on one rank; offload cpu: OSS(offload='cpu') "
                          "keeps the owner's masters (fp32 parameters: exact fp32 mirrors), Adam's moments and the "
                          "fp32 gradient buffer in host memory and steps there; device: ZeRO-1 counts DDP's full "
                          "gradients, ZeRO-2 no gradients (only in flight: autograd's until its bucket is reduced, "
                          "and the buckets, a constant); host peak: the most during a step (reduced gradients land "
                          "in the kept buffer); ZeRO-3 + offload: FullyShardedDataParallel(cpu_offload=CPUOffload("
                          "offload_params=True)) keeps the shard, its gradient and Adam's state on the host (torch "
                          "FSDP2's CPUOffloadPolicy the same), the units it gathers not counted; Adam's step counts "
                          "(4 bytes per stepped tensor) not counted; docs/memory.md"
                          + ("; cpu+delay: OSS(offload='cpu', delay_update_after=k) also keeps the copy of the gradient "
                             "buffer its delayed step reads, 4 B per owned parameter (no bench mode delays)" if delayed else ""))
    for name in ("stage", "offload", "bench mode"):
        table.add_column(name, no_wrap=True)
    for name in ("device B/param", "host B/param", "host peak B/param", "device GB/rank", "host GB/rank"):
        table.add_column(name, justify="right")
    for row in offload_rows(rows, num_params, mixed):
        table.add_row(row["stage"], ("cpu+delay" if row["delayed_update"] else "cpu") if row["offload"] else "-",
                      row["bench_mode"] or "-",
                      f"{row['device_bytes_per_param']:.4g}", f"{row['host_bytes_per_param']:.4g}",
                      f"{row['host_peak_bytes_per_param']:.4g}", _gb(row["device_bytes"]), _gb(row["host_bytes"]))
    console = Console(stderr=stderr)
    (console if console.is_terminal else Console(width=160, stderr=stderr)).print(table)


_MODE_WORDS = {"ddp": "DDP", "zero1": "ZeRO-1 whole", "zero2": "ZeRO-2 whole", "zero2-split": "ZeRO-2 split",
               "zero3": "ZeRO-3"}
_MODE_ORDER = tuple(_MODE_WORDS)


def measured_rows(measurement: Measurement) -> list[dict[str, Any]]:
    """One row per mode, precision and world size of ``estimate --measure``, as plain values
    (Note [the ideal share] in :mod:`shardopt.fake_ranks`).

    Args:
        measurement: what was measured.

    Returns:
        The rows by precision (mixed first), world size and mode.
    """
    rows: list[dict[str, Any]] = []
    for m in sorted(measurement.results, key=lambda m: (not m.mixed, m.world_size, _MODE_ORDER.index(m.mode.value))):
        heaviest = m.heaviest
        rows.append({
            "mode": m.mode.value, "stage": _MODE_WORDS[m.mode.value],
            "precision": "bf16 + fp32 masters" if m.mixed else "fp32", "world_size": m.world_size,
            "ranks_measured": [r.rank for r in m.ranks], "heaviest_rank": heaviest.rank,
            "heaviest_bytes": heaviest.total, "heaviest_sharded_bytes": max(r.sharded for r in m.ranks),
            "ideal_bytes": m.ideal_total, "ideal_sharded_bytes": m.ideal_sharded, "sharded_ratio": m.sharded_ratio,
            "total_ratio": m.total_ratio, "sharded": list(m.mode.sharded),
            "per_rank": [{"rank": r.rank, "params": r.params, "grads": r.grads, "masters": r.masters,
                          "optimizer": r.optimizer, "total": r.total} for r in m.ranks]})
    return rows


def render_measured(measurement: Measurement, stderr: bool = False) -> None:
    """Print ``estimate --measure``'s rows as a rich table.

    Args:
        measurement: what was measured.
        stderr: print on standard error.
    """
    shape = measurement.shape
    table = Table(title=f"measured under torch's fake process group: a 1/{measurement.scale}-width copy "
                        f"({measurement.num_params:,} params; vocab {shape.vocab_size}, hidden {shape.hidden_size}, "
                        f"{shape.num_layers} layers), one forward/backward/step, then counted before the next step",
                  caption=escape("whole: every parameter owned whole by one rank (split_large_params=False, "
                                 "matrix-wise optimizers); split: large parameters owned in row blocks "
                                 "(OSS(split_large_params=True)); bytes = distinct storages of "
                                 "parameters, gradients, fp32 masters (with their gradients) and optimizer state on "
                                 "the rank (Note [what a measured rank holds] in shardopt.fake_ranks); ideal = the same "
                                 "mode at N = 1 with its sharded part divided by N; MB = 1e6 bytes"))
    for name, justify in (("precision", "left"), ("N", "right"), ("mode", "left"), ("ranks measured", "left"),
                          ("heaviest rank", "right"), ("MB, heaviest", "right"), ("MB, ideal", "right"),
                          ("sharded MB, heaviest", "right"), ("sharded MB, ideal", "right"),
                          ("sharded vs ideal", "right"), ("total vs ideal", "right")):
        table.add_column(name, justify=justify, no_wrap=name == "mode")  # type: ignore[arg-type]
    for row in measured_rows(measurement):
        ranks = row["ranks_measured"]
        table.add_row(row["precision"], str(row["world_size"]), row["stage"],
                      ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{len(ranks)} ranks",
                      str(row["heaviest_rank"]), f"{row['heaviest_bytes'] / 1e6:.2f}", f"{row['ideal_bytes'] / 1e6:.2f}",
                      f"{row['heaviest_sharded_bytes'] / 1e6:.3f}", f"{row['ideal_sharded_bytes'] / 1e6:.3f}",
                      "-" if row["sharded_ratio"] is None else f"{row['sharded_ratio']:.3f}x",
                      f"{row['total_ratio']:.3f}x")
    console = Console(stderr=stderr)
    console = console if console.is_terminal else Console(width=200, stderr=stderr)
    console.print(table)
