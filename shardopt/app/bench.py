"""``shardopt bench``: modes side by side on the same model, data and seed, compared with DDP.

Each mode runs in its own launch (its own processes and process group), so no mode's
allocations or sockets leak into another's figures. With ``--rounds R`` the whole list of
modes runs R times, interleaved (ddp, zero2, ..., ddp, zero2, ...), and each mode's median
step is taken over the steps of all its rounds: on a shared machine the speed drifts over
minutes, and interleaving spreads that drift over every mode instead of charging it to
whichever mode ran during a slow spell (two back-to-back single-round runs of ddp and zero2
on the 2-core test machine gave zero2/ddp time ratios of 1.02 and 1.08). Every rank measures itself (see
:mod:`shardopt.app.runner`); rank 0 of each run saves the final full parameters, and this
process compares them with DDP's (max |param - DDP param|) and divides each mode's time,
heap and bytes by DDP's. Results go to a rich table, optionally JSON and a matplotlib plot.
While it runs, a progress bar on standard error counts the runs (modes x rounds) with the
elapsed time and an estimate of the time left; with ``--json -`` the table goes to standard
error too and standard output carries the JSON alone (Note [JSON on standard output] in
:mod:`shardopt.app.render`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from torch.distributed.elastic.multiprocessing.errors import record

from shardopt.app import runner
from shardopt.app.group_bytes import GROUP_KINDS
from shardopt.app.launch import run_launched
from shardopt.app.modes import resolve
from shardopt.app.render import JSON_TO_STDOUT, machine_info, mib, stdout_kept_for_json, write_json

__all__ = ["BenchConfig", "ModeResult", "bench_progress", "bench_rank", "merge_rounds", "run_bench", "start_runs"]


@dataclass(frozen=True)
class BenchConfig:
    """What ``shardopt bench`` runs and where its results go (checked by the CLI).

    Attributes:
        modes: the bench mode names to run (a mode and a precision suffix, see
            :func:`shardopt.app.modes.resolve`), ``"ddp"`` first (the reference of every ratio).
        model: the built-in model preset.
        steps: steps per mode and round, warm-up included.
        warmup_steps: steps left out of the step-time median.
        batch_size: sequences per rank and step.
        lr: Adam's learning rate.
        seed: model and data seed (the same for every mode).
        rounds: times the whole mode list runs, interleaved.
        world_size: ranks per mode.
        threads_per_rank: intra-op threads per rank.
        json_path: where to write the results as JSON, or ``None``.
        plot_path: where to draw the comparison (PNG, needs matplotlib), or ``None``.
        device: where the ranks train (:data:`shardopt.app.runner.DEVICE_CHOICES`).
        skipped: ``(name, reason)`` of requested peer modes that cannot run here (their
            library is missing); shown under the table and kept in the JSON.
        shard_size: S for the hybrid modes (``--shard-size``), ``None`` when none runs.
        compile: every mode compiles the model's blocks (``--compile``; Note [--compile in
            every mode] in :mod:`shardopt.app.modes`).
    """

    modes: tuple[str, ...]
    model: str
    steps: int
    warmup_steps: int
    batch_size: int
    lr: float
    seed: int
    rounds: int
    world_size: int
    threads_per_rank: int
    json_path: str | None = None
    plot_path: str | None = None
    device: str = "auto"
    skipped: tuple[tuple[str, str], ...] = ()
    shard_size: int | None = None
    compile: bool = False


@record
def bench_rank(job: runner.TrainJob, quiet_stdout: bool = False) -> list[dict[str, Any]] | None:
    """One rank of one benchmarked mode: join the group, train, report (rank 0 returns all ranks).

    Args:
        job: the job (``params_out`` set so rank 0 saves the final parameters).
        quiet_stdout: send whatever the rank prints (a peer library's logging) to standard
            error, as ``--json -`` needs (Note [JSON on standard output] in :mod:`shardopt.app.render`).

    Returns:
        On rank 0 every rank's report as dicts, else ``None``.
    """
    with stdout_kept_for_json(quiet_stdout):
        runner.init_process_group_from_env(device=job.device)
        try:
            reports = runner.train(job)
            return [r.as_dict() for r in reports] if dist.get_rank() == 0 else None
        finally:
            dist.destroy_process_group()


@dataclass(frozen=True)
class ModeResult:
    """One mode's per-rank figures and its comparison with DDP.

    Attributes:
        mode: the mode name.
        ranks: every rank's report (dicts, as in the JSON).
        max_param_diff: max |param - DDP param| over all parameters after the last step.
        time_ratio: this mode's median step time over DDP's (slowest rank each).
        heap_ratio: heap after step over DDP's (largest rank each).
        bytes_ratio: bytes sent per step over DDP's (largest rank each).
        group_bytes: bytes sent per step by group kind, largest rank each (Note [bytes per
            group] in :mod:`shardopt.app.group_bytes`), or ``None`` for peers' modes.
        group_ratios: each kind's ``group_bytes`` over DDP's bytes (all of them ``world``).
    """

    mode: str
    ranks: list[dict[str, Any]]
    max_param_diff: float
    time_ratio: float | None
    heap_ratio: float | None
    bytes_ratio: float | None
    group_bytes: dict[str, float] | None = None
    group_ratios: dict[str, float | None] | None = None

    def worst(self, key: str) -> float | None:
        """The largest value of ``key`` over ranks (``None`` if any rank lacks it)."""
        values = [r[key] for r in self.ranks]
        return None if any(v is None for v in values) else float(max(values))

    def worst_by_group(self) -> dict[str, float] | None:
        """The largest bytes per step of each group kind over ranks (``None``: not counted)."""
        values = [r.get("group_bytes_per_step") for r in self.ranks]
        if any(v is None for v in values):
            return None
        return {kind: float(max(v[kind] for v in values if v is not None)) for kind in GROUP_KINDS}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise AssertionError(f"parameter names differ between modes: {sorted(a.keys() ^ b.keys())[:4]}")
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0)


def run_bench(config: BenchConfig) -> int:
    """Run every mode of ``config`` (``"ddp"`` first) and show the comparison.

    Args:
        config: what to run; each mode is launched with :func:`~shardopt.app.launch.run_launched`
            (Ctrl-C and rank failures end the command with a message and an exit code).

    Returns:
        The exit code.
    """
    with stdout_kept_for_json(config.json_path == JSON_TO_STDOUT) as json_stream:
        results = _run_modes(config, Console(stderr=True))
        to_stderr = json_stream is not None
        console = Console(stderr=to_stderr)
        (console if console.is_terminal else Console(width=170, stderr=to_stderr)).print(
            bench_table(config, config.world_size, results))
        if config.json_path:
            write_json(config.json_path, {
                "command": "bench", "machine": machine_info(), "world_size": config.world_size,
                "threads_per_rank": config.threads_per_rank, "model": config.model,
                "num_params": results[0].ranks[0]["num_params"], "steps": config.steps,
                "warmup_steps": config.warmup_steps, "batch_size": config.batch_size, "seed": config.seed,
                "rounds": config.rounds, "shard_size": config.shard_size, "compile": config.compile,
                "results": [{**r.__dict__, "precision": resolve(r.mode)[1].describe()} for r in results],
                "skipped": [{"mode": name, "reason": reason} for name, reason in config.skipped],
            }, json_stream)
    if config.plot_path:
        plot(results, config.plot_path, f"{config.model}, {config.world_size} ranks")
    return 0


def _run_modes(args: BenchConfig, console: Console) -> list[ModeResult]:
    """Run every round of every mode, showing overall progress on ``console``; the results, DDP first."""
    names, world, rounds = list(args.modes), args.world_size, args.rounds
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in names}
    diffs: dict[str, float] = {name: 0.0 for name in names}
    for name, reason in args.skipped:
        console.print(f"bench: skipping {name}: {reason}")
    progress = bench_progress(console)
    with tempfile.TemporaryDirectory(prefix="shardopt-bench-") as tmp, progress:
        task = start_runs(progress, rounds * len(names))
        for round_index in range(rounds):
            reference: dict[str, torch.Tensor] | None = None
            for name in names:
                params_path = os.path.join(tmp, f"{name}.pt")
                mode, precision = resolve(name)
                job = runner.TrainJob(mode=mode.name, precision=precision, preset=args.model, steps=args.steps,
                                      batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                                      warmup_steps=args.warmup_steps, params_out=params_path,
                                      threads_per_rank=args.threads_per_rank, device=args.device,
                                      shard_size=args.shard_size if mode.hybrid else None,
                                      compile=args.compile)
                where = f" round {round_index + 1}/{rounds}" if rounds > 1 else ""
                progress.update(task, description=f"{name} on {world} ranks ({args.steps} steps){where}")
                ranks = run_launched("bench", bench_rank, world, job, args.json_path == JSON_TO_STDOUT)[0]
                params = torch.load(params_path, weights_only=True)
                os.remove(params_path)
                if reference is None:
                    reference = params
                diffs[name] = max(diffs[name], _max_diff(reference, params))
                runs[name].append(ranks)
                median = max(r["median_step_s"] or float("nan") for r in ranks)
                progress.advance(task)
                progress.console.print(f"bench: {name}{where} done, median step {1000 * median:.1f} ms")
        progress.update(task, description="done")
    results: list[ModeResult] = []
    for name in names:
        raw = ModeResult(name, merge_rounds(runs[name]), diffs[name], None, None, None)
        base = results[0] if results else raw  # ddp, the first mode, is compared with itself
        groups, ddp_groups = raw.worst_by_group(), base.worst_by_group()
        ddp_total = None if ddp_groups is None else sum(ddp_groups.values())
        time_ratio, heap_ratio, bytes_ratio = (
            _ratio(raw.worst(key), base.worst(key)) for key in ("median_step_s", "heap_after_step", "bytes_per_step"))
        results.append(ModeResult(raw.mode, raw.ranks, raw.max_param_diff, time_ratio, heap_ratio, bytes_ratio,
                                  group_bytes=groups, group_ratios=None if groups is None else {
                                      kind: _ratio(value, ddp_total) for kind, value in groups.items()}))
    return results


# Note [bench ETA]
# The time left is the runs still to do divided by the mean rate over every run so far. rich
# estimates a rate from the progress samples of its last `speed_estimate_period` seconds (30
# by default), and one run of the 27m model takes longer than that: its window would hold a
# single sample, and the estimate would read "-:--:--" for the whole bench. So the window is
# longer than any bench, and a sample at 0 runs is taken at the start, so the estimate
# appears as soon as the first run ends. Runs differ in length (zero3 is slower than ddp, a
# peer loads its library), so it is an estimate, settling as the rounds go by.
_BENCH_WINDOW_S = 7 * 24 * 3600.0


def bench_progress(console: Console, get_time: Callable[[], float] | None = None) -> Progress:
    """The bench's overall progress bar: runs done of all, elapsed time, time left (Note [bench ETA]).

    Args:
        console: where to draw it (standard error).
        get_time: the clock (default: rich's, monotonic), for tests.

    Returns:
        The progress display, not started; add the task with :func:`start_runs`.
    """
    columns = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TextColumn("runs,"), TimeElapsedColumn(),
               TextColumn("elapsed, about"), TimeRemainingColumn(), TextColumn("left: {task.description}"))
    return Progress(*columns, console=console, transient=False, speed_estimate_period=_BENCH_WINDOW_S,
                    get_time=get_time)


def start_runs(progress: Progress, total_runs: int) -> TaskID:
    """Add the one task of :func:`bench_progress` with its first sample at 0 runs (Note [bench ETA])."""
    task = progress.add_task("starting", total=total_runs)
    progress.advance(task, 0)
    return task


def merge_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One report per rank from several rounds of the same mode.

    Step times are pooled and their median recomputed; heap, bytes (by group too) and device peaks take the
    largest round (they repeat to within a page, so this only guards against an outlier).

    Args:
        rounds: each round's per-rank reports (dicts, as ``bench_rank`` returns them).

    Returns:
        The merged per-rank reports, with ``rounds`` and ``round_median_step_s`` added.
    """
    merged = []
    for per_round in zip(*rounds, strict=False):
        first = dict(per_round[0])
        times = [t for r in per_round for t in r["step_times_s"]]

        def largest(key: str, per_round: tuple[Any, ...] = per_round) -> Any:
            values = [r[key] for r in per_round]
            return None if any(v is None for v in values) else max(values)

        first.update(
            step_times_s=times, counted_steps=len(times), median_step_s=statistics.median(times) if times else None,
            heap_after_step=largest("heap_after_step"), heap_peak=largest("heap_peak"),
            bytes_per_step=largest("bytes_per_step"), device_peak=largest("device_peak"),
            rounds=len(per_round), round_median_step_s=[r["median_step_s"] for r in per_round],
        )
        if "group_bytes_per_step" in first:  # reports of shardopt's own modes
            first["group_bytes_per_step"] = None if any(r["group_bytes_per_step"] is None for r in per_round) else {
                kind: max(r["group_bytes_per_step"][kind] for r in per_round) for kind in GROUP_KINDS}
        merged.append(first)
    return merged


def _per_rank(result: ModeResult, key: str, fmt: Callable[[Any], str]) -> str:
    return " / ".join(fmt(r.get(key)) for r in result.ranks)


_STATES_CAPTION = (
    "; states on device / on host = parameters, gradients, masters and optimizer state counted from their storages, "
    "on the device the ranks train on after the step / offloaded to host memory at the update (Note \\[counting "
    "offloaded state] in shardopt.app.state_count; n/a: a peer's mode, not counted); on CPU ranks (gloo) the device "
    "is host memory too: the heap holds both columns, and offload saves nothing there (it adds host copies: OSS's "
    "fp32 mirrors)")


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def bench_table(args: BenchConfig, world: int, results: list[ModeResult]) -> Table:
    """The comparison table: per-rank heap and bytes, median step, drift from DDP, ratios.

    Args:
        args: the parsed ``bench`` arguments.
        world: ranks per mode.
        results: one per mode, DDP first.

    Returns:
        The rich table.
    """
    counted = results[0].ranks[0]["counted_steps"]
    rounds = results[0].ranks[0].get("rounds", 1)
    pooled = f" ({rounds} interleaved rounds pooled)" if rounds > 1 else ""
    offload = any(rank.get("host_state_bytes") for r in results for rank in r.ranks)
    states = _STATES_CAPTION if offload else ""
    suffixes = "; -bf16: bf16 params, -bf16m: bf16 params + fp32 masters on the owner, -bf16reduce: gradients " \
        "reduced in bf16" if any(resolve(r.mode)[1].name != "fp32" for r in results) else ""
    skipped = "".join(f"; skipped {name}: {reason}" for name, reason in args.skipped)
    table = Table(
        title=f"shardopt bench: model {args.model} ({results[0].ranks[0]['num_params'] / 1e6:.2f}M params), Adam, "
              f"{world} ranks, batch {args.batch_size}{', blocks compiled' if args.compile else ''}",
        caption=f"MiB per rank (rank 0 / rank 1 / ...); heap = malloc'ed bytes above the value before the model "
                f"was built; sent = /proc/self/io wchar per step; median over {counted} steps{pooled} after "
                f"{args.warmup_steps} warm-up each, ranks barrier-aligned; ratios against ddp (worst rank); sent by "
                f"group = bytes per step through shardopt's collectives by process group, DDP's all-reduce computed "
                f"(Note \\[bytes per group] in shardopt.app.group_bytes), over ddp's"
                f"{f'; shard groups of {args.shard_size} ranks' if args.shard_size else ''}"
                f"{suffixes}{states}{skipped}",
    )
    on_gpu = any(rank["device_peak"] is not None for r in results for rank in r.ranks)
    kinds = [k for k in GROUP_KINDS if any(r.group_bytes and r.group_bytes[k] for r in results)] or ["world"]
    by_group = f"sent by group ({' / '.join(kinds)})"
    state_columns = ("states on device", "states on host") if offload else ()
    for column in ("mode", "heap after step", "heap peak", *(("GPU peak",) if on_gpu else ()), *state_columns, "sent/step",
                   "median step ms", "max|p - p_ddp|", "time", "heap", "sent", by_group, "vs ddp"):
        table.add_column(column, justify="left" if column == "mode" else "right", no_wrap=column == "mode")
    for r in results:
        step = r.worst("median_step_s")
        gpu = (_per_rank(r, "device_peak", mib),) if on_gpu else ()
        held = tuple(_per_rank(r, key, mib) for key in ("device_state_bytes", "host_state_bytes")) if offload else ()
        groups, ratios = r.group_bytes, r.group_ratios
        table.add_row(
            r.mode, _per_rank(r, "heap_after_step", mib), _per_rank(r, "heap_peak", mib), *gpu, *held,
            _per_rank(r, "bytes_per_step", mib), "n/a" if step is None else f"{1000 * step:.1f}",
            f"{r.max_param_diff:.2e}", _x(r.time_ratio), _x(r.heap_ratio), _x(r.bytes_ratio),
            "n/a" if groups is None else " / ".join(mib(groups[k]) for k in kinds),
            "n/a" if ratios is None else " / ".join(_x(ratios[k]) for k in kinds),
        )
    return table


def plot(results: list[ModeResult], path: str, title: str) -> None:
    """Draw heap after step, bytes sent per step and median step time per mode into ``path``.

    Args:
        results: one per mode.
        path: the PNG to write (missing folders are created).
        title: the figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("heap after step (MiB, worst rank)", "heap_after_step", 2.0**-20),
              ("sent per step (MiB, worst rank)", "bytes_per_step", 2.0**-20),
              ("median step (ms)", "median_step_s", 1000.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.5))
    names = [r.mode for r in results]
    for ax, (label, key, scale) in zip(axes, panels, strict=True):
        values = [(r.worst(key) or 0.0) * scale for r in results]
        ax.bar(names, values, color=["#888888" if resolve(n)[0].peer else "#2a7ab9" for n in names])
        ax.set_title(label)
        plt.setp(ax.get_xticklabels(), rotation=40, ha="right")
    fig.suptitle(f"shardopt bench: {title}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # as --json and --checkpoint do
    fig.savefig(path, dpi=100)
    plt.close(fig)
