"""One rank's training run for ``shardopt demo`` and ``shardopt bench``: build, train, measure.

:func:`train` runs on every rank of an initialised process group (started by the CLI with
torch's elastic launcher, or by ``torchrun``). It builds the built-in GPT with a fixed seed,
wraps it for the chosen :mod:`~shardopt.app.modes` mode, trains on the built-in corpus with
different data per rank, and measures with :class:`~shardopt.memory.MemoryRecorder`: the
heap baseline is read before the model is built; heap is sampled after forward, backward
and step; every step after the warm-up is timed and its bytes sent counted, with the ranks
aligned by a barrier before each step (the barrier itself is outside the counted window).
It never prints: rank 0 reports progress through a callback. Every rank returns the reports
of all ranks.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt import checkpoint, comm, elastic
from shardopt.app.faults import FaultPlan
from shardopt.app.group_bytes import GROUP_KINDS, GroupBytes, ddp_step_bytes
from shardopt.app.models import PRESETS, CharBatches, build_model, stdlib_corpus
from shardopt.app.modes import Setup, Wrapped, full_parameters, get_mode, load_optimizer_state
from shardopt.app.precision import Precision
from shardopt.app.state_count import StateCount
from shardopt.memory import MemoryRecorder

__all__ = ["NothingToTrain", "RankReport", "StepInfo", "TrainJob", "check_resumable", "global_batch",
           "init_process_group_from_env", "train"]

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainJob:
    """Everything a rank needs to run; the same object on every rank.

    Attributes:
        mode: a name in :data:`shardopt.app.modes.MODES`.
        preset: a model preset in :data:`shardopt.app.models.PRESETS`.
        steps: optimizer steps to reach (a resumed run continues to this step).
        batch_size: sequences per micro-batch per rank.
        grad_accum_steps: micro-batches per optimizer step (all but the last under ``no_sync``).
        lr: Adam learning rate.
        seed: model initialisation and data sampling seed.
        amp: ``None``, ``"bf16"`` or ``"fp16"`` (fp16 uses a gradient scaler); fp32
            precision only.
        precision: parameter precision (bf16 parameters, fp32 masters on the owner, the
            reduce dtype); the mode must run at it.
        warmup_steps: first steps left out of the timing and bytes statistics.
        checkpoint_path: where to save (a file, or a folder for sharded-parameter modes).
        resume: load ``checkpoint_path`` first when it exists.
        save_every_steps: save every this many steps (0: only at the end).
        params_out: rank 0 saves the final full parameters here (``torch.save``), for comparisons.
        corpus_bytes: how much of the built-in corpus to read.
        threads_per_rank: intra-op threads per rank.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (see :func:`init_process_group_from_env`).
        shard_size: S, ranks per shard group, for a hybrid mode (``None`` otherwise).
        compile: compile every transformer block with ``torch.compile`` before wrapping
            (Note [--compile in every mode] in :mod:`shardopt.app.modes`).

    Raises:
        ValueError: ``amp`` with a precision other than fp32.
    """

    mode: str = "zero2"
    preset: str = "small"
    steps: int = 300
    batch_size: int = 8
    grad_accum_steps: int = 1
    lr: float = 1e-3
    seed: int = 0
    amp: str | None = None
    precision: Precision = field(default_factory=Precision)
    warmup_steps: int = 2
    checkpoint_path: str | None = None
    resume: bool = False
    save_every_steps: int = 0
    params_out: str | None = None
    corpus_bytes: int = 4 * 2**20
    threads_per_rank: int = 1
    device: str = "auto"
    shard_size: int | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        if self.amp is not None and self.precision.name != "fp32":
            raise ValueError(f"TrainJob(amp={self.amp!r}) autocasts fp32 parameters, but precision is "
                             f"{self.precision.name!r}; keep amp=None with bf16 parameters, or use precision fp32")


DEVICE_CHOICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class StepInfo:
    """What rank 0 reports after each step.

    Attributes:
        step: steps completed.
        total_steps: the target.
        loss: rank 0's loss of this step.
        tokens_per_s: tokens trained per second over all ranks, this step.
    """

    step: int
    total_steps: int
    loss: float
    tokens_per_s: float


@dataclass(frozen=True)
class RankReport:
    """One rank's measurements (bytes are relative to the heap before the model was built).

    Attributes:
        rank: global rank.
        world_size: ranks in the run.
        mode: the mode name.
        num_params: parameters of the full model.
        heap_after_step: heap bytes after the last optimizer step.
        heap_peak: the largest heap sample (after forward, backward or step).
        bytes_per_step: mean bytes sent per counted step.
        median_step_s: median wall time of the counted steps.
        step_times_s: every counted step's wall time.
        counted_steps: how many steps the statistics cover.
        final_loss: this rank's loss at the last step.
        start_step: the step training started from (non-zero after a resume).
        tokens_per_step: tokens per optimizer step over all ranks.
        device_peak: CUDA peak allocated bytes, on GPU.
        backend: the process group backend.
        group_bytes_per_step: mean bytes sent per counted step by group kind (``world``,
            ``shard``, ``replicate``, ``other``; Note [bytes per group] in
            :mod:`shardopt.app.group_bytes`), or ``None`` for peers' modes.
        compiled_graphs: with ``--compile``, the graphs ``torch.compile`` compiled on this
            rank (the blocks of one shape share one), else ``None``.
        device_state_bytes: model states (parameters, gradients, masters, optimizer state) on
            the device the rank trains on after the last step, counted from their storages
            (Note [counting offloaded state] in :mod:`shardopt.app.state_count`); ``None`` for
            peers' modes other than an offload one.
        host_state_bytes: the model states the mode offloads to host memory at the last
            update (0 without offload; ``None`` where not counted).
    """

    rank: int
    world_size: int
    mode: str
    num_params: int
    heap_after_step: int | None
    heap_peak: int | None
    bytes_per_step: float | None
    median_step_s: float | None
    step_times_s: tuple[float, ...]
    counted_steps: int
    final_loss: float
    start_step: int
    tokens_per_step: int
    device_peak: int | None
    backend: str
    group_bytes_per_step: dict[str, float] | None = None
    compiled_graphs: int | None = None
    device_state_bytes: int | None = None
    host_state_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain values for JSON."""
        out = asdict(self)
        out["step_times_s"] = list(self.step_times_s)
        return out


def init_process_group_from_env(timeout_s: float = 600.0, device: str = "auto") -> torch.device:
    """Join the process group described by torchrun-style environment variables.

    ``device="auto"`` picks NCCL with one GPU per local rank when there are enough GPUs, else
    gloo on the CPU; ``"cpu"`` always gloo on the CPU; ``"cuda"`` NCCL when there are enough
    GPUs, else gloo with local rank ``r`` on GPU ``r % num_gpus`` (several ranks share a GPU;
    gloo stages the bytes through host memory). gloo uses the loopback interface when there
    is one. Does nothing to the group when it exists.

    Args:
        timeout_s: the collective timeout.
        device: where the ranks train, one of :data:`DEVICE_CHOICES`.

    Returns:
        The device this rank trains on (also what :func:`train` uses).

    Raises:
        ValueError: ``device`` is unknown, or ``"cuda"`` on a machine without CUDA.
    """
    backend, where = _placement(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if not dist.is_initialized():
        # On a namespace of this torchrun attempt alone: a restart must not read the last
        # attempt's keys (Note [one store namespace per attempt] in shardopt.elastic).
        elastic.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return where


def _placement(device: str) -> tuple[str, torch.device]:
    """The backend and the device of this local rank for a ``device`` choice."""
    if device not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {device!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        raise ValueError("device='cuda' but torch sees no CUDA device; use device='auto' or 'cpu'")
    if device != "cpu" and gpus >= local_world:
        return "nccl", torch.device("cuda", local_rank)
    if device == "cuda":
        return "gloo", torch.device("cuda", local_rank % gpus)
    return "gloo", torch.device("cpu")


def _train_device(choice: str) -> torch.device:
    """The device for ``choice`` in the group that exists: NCCL trains on its current GPU;
    gloo on the CPU, or with ``"cuda"`` on a (shared) GPU."""
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {choice!r}")
    if str(dist.get_backend()) == "nccl":
        if choice == "cpu":
            raise ValueError("device='cpu' but the process group uses NCCL, which moves only GPU tensors; "
                             "use device='auto' or 'cuda', or a gloo group")
        return torch.device("cuda", torch.cuda.current_device())
    if choice == "cuda":
        return _placement("cuda")[1]
    return torch.device("cpu")


def _make_scaler(job: TrainJob, device: torch.device) -> Any | None:
    if job.amp != "fp16":
        return None
    kind = get_mode(job.mode).fp16_scaler
    if kind is None:
        raise ValueError(f"mode {job.mode!r} has no fp16 gradient scaler; use amp='bf16'")
    if kind == "torch":
        return torch.amp.GradScaler(device.type)
    from shardopt.optim.grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device.type)


def _save(job: TrainJob, wrapped: Wrapped, step: int, scaler: Any | None, faults: FaultPlan | None) -> None:
    with faults.saving(step, comm.group_rank(None)) if faults is not None else contextlib.nullcontext():
        _save_now(job, wrapped, step, scaler)


def _save_now(job: TrainJob, wrapped: Wrapped, step: int, scaler: Any | None) -> None:
    assert job.checkpoint_path is not None
    world = comm.group_size(None)
    extra = {"step": step, "mode": job.mode, "preset": job.preset, "seed": job.seed,
             "precision": job.precision.name, "scaler": scaler.state_dict() if scaler is not None else None,
             "world_size": world, "global_batch": global_batch(job, world)}
    assert wrapped.checkpoint_target is not None
    if get_mode(job.mode).sharded_checkpoint:
        checkpoint.save_sharded(job.checkpoint_path, wrapped.checkpoint_target, wrapped.optimizer, extra)
    else:
        checkpoint.save_consolidated(job.checkpoint_path, wrapped.checkpoint_target, wrapped.optimizer, extra)


# Note [what a resume restores]
# A demo run's state is the model, the optimizer state (Adam's moments and step counts, and
# the fp32 master weights of --precision bf16-master, which the consolidated file holds
# whole), the step counter and the fp16 gradient scaler's state (in the checkpoint's extra).
# Nothing else carries over because nothing else exists: a step's samples are a pure function
# of (seed, step, sample index) (shardopt.app.models.CharBatches), the GPT has no dropout and
# draws no random numbers after its seeded initialisation, and the learning rate is
# constant. So a run killed and resumed any number of times at the same world size ends bit
# for bit equal to the uninterrupted run (tests/test_chaos.py, scripts/chaos.py).
#
# Note [the same run at another world size]
# Resumed at another world size with the same global batch (--global-batch-size G), every
# step trains on the same G samples: rank r of W takes its slice of them. What changes is how
# the gradient is summed (W partial sums of G/W samples each, by the reduction of the mode)
# and which rank owns which parameter's optimizer state (elementwise Adam: owners do not
# change the arithmetic). The losses of a resumed step agree with the uninterrupted run's to
# the rounding of that sum (fp32: 0 to 2.4e-7 after 4 to 6 steps at 1, 3 and 4 ranks after 2;
# bf16 parameters with fp32 masters: 4.5e-5, as a bf16 rounding of a parameter can flip),
# against 1.5e-2 to 7e-2 when the global batch changes too. Adam turns rounding noise into
# full steps where the true gradient is zero (the attention's key bias gets none): such
# elements move by up to the learning rate per step in either run, in directions that need
# not agree. A resume that changes the global batch is allowed and says so.


def global_batch(job: TrainJob, world_size: int) -> int:
    """Sequences per optimizer step over all ranks (Note [the same run at another world size])."""
    return job.batch_size * job.grad_accum_steps * world_size


class NothingToTrain(ValueError):
    """The checkpoint is already at the job's last step or beyond.

    Attributes:
        saved_step: the checkpoint's step.
    """

    def __init__(self, saved_step: int, message: str) -> None:
        super().__init__(message)
        self.saved_step = saved_step


def check_resumable(path: str, job: TrainJob) -> dict[str, Any]:
    """Check that the checkpoint at ``path`` fits ``job`` before anything is loaded.

    The model preset, seed and precision must match (the data order depends on the seed;
    checkpoints from before precisions were recorded are fp32). The mode may change when
    the checkpoint kind stays the same: a consolidated file resumes under ddp, zero1, zero2
    or zero3 alike. The CLI calls this at startup and every rank again before loading.

    Args:
        path: the checkpoint.
        job: the job about to resume.

    Returns:
        The checkpoint's ``extra`` (see :func:`shardopt.checkpoint.read_extra`).

    Raises:
        ValueError: not a shardopt checkpoint, another model, seed or precision, a file
            where a folder is needed (or back).
        NothingToTrain: already at ``job.steps`` or beyond (a ``ValueError``).
    """
    saved = checkpoint.read_extra(path)
    if saved is None:
        raise ValueError(f"--checkpoint {path!r} exists but is not a shardopt checkpoint; point it at a file or "
                         "folder written by shardopt demo, or drop --resume")
    ours = {"preset": job.preset, "seed": job.seed}
    theirs = {k: saved.get(k) for k in ours}
    if theirs != ours:
        raise ValueError(f"checkpoint {path!r} was saved with {theirs}, not {ours}; resume with the same --model "
                         "and --seed, or point --checkpoint elsewhere")
    saved_precision = saved.get("precision", "fp32")
    if saved_precision != job.precision.name:
        raise ValueError(f"checkpoint {path!r} was saved at --precision {saved_precision}, not "
                         f"{job.precision.name}; resume with --precision {saved_precision}, or point --checkpoint "
                         "elsewhere")
    saved_step = saved.get("step")
    if isinstance(saved_step, int) and saved_step >= job.steps:
        raise NothingToTrain(saved_step, f"checkpoint {path!r} is at step {saved_step} but --steps is {job.steps}: "
                             f"there is nothing left to train; pass --steps greater than {saved_step} to continue, or "
                             "drop --resume to start over")
    sharded_checkpoint = get_mode(job.mode).sharded_checkpoint
    if os.path.isdir(path) != sharded_checkpoint:
        kind = "a sharded folder" if os.path.isdir(path) else "a consolidated file"
        raise ValueError(f"checkpoint {path!r} is {kind} (saved by mode {saved.get('mode')!r}) but mode {job.mode!r} "
                         f"{'saves sharded folders' if sharded_checkpoint else 'reads consolidated files'}; resume "
                         f"with --mode {saved.get('mode')} or point --checkpoint elsewhere")
    return saved


def _resume(job: TrainJob, wrapped: Wrapped, scaler: Any | None) -> int:
    path = job.checkpoint_path
    if not job.resume or path is None or not os.path.exists(path):
        return 0
    check_resumable(path, job)
    assert wrapped.checkpoint_target is not None
    if get_mode(job.mode).sharded_checkpoint:
        extra = checkpoint.load_sharded(path, wrapped.checkpoint_target, wrapped.optimizer)
    else:
        # The model and extra through load_consolidated; the optimizer state (saved in either
        # of two layouts, Note [two consolidated optimizer layouts] in shardopt.app.modes) through the mode.
        extra = checkpoint.load_consolidated(path, wrapped.checkpoint_target, None)
        optim_state = torch.load(path, map_location="cpu", weights_only=True)["optimizer"]
        if optim_state is not None:
            load_optimizer_state(wrapped, optim_state)
    if scaler is not None and extra.get("scaler"):
        scaler.load_state_dict(extra["scaler"])
    return int(extra["step"])


def _one_step(job: TrainJob, wrapped: Wrapped, batches: CharBatches, step: int, scaler: Any | None,
              recorder: MemoryRecorder, device: torch.device) -> float:
    wrapped.zero_grad()
    amp = job.amp or get_mode(job.mode).autocast  # --amp, or a mode defined by autocast (ddp-amp)
    # the forward and the loss only: backward runs in the dtypes autocast recorded, the step outside it
    autocast = torch.autocast(device.type, dtype=AMP_DTYPES[amp]) if amp is not None else contextlib.nullcontext()
    loss_value = 0.0
    for micro in range(job.grad_accum_steps):
        tokens, targets = (t.to(device) for t in batches.batch(step, micro))
        sync = contextlib.nullcontext() if micro == job.grad_accum_steps - 1 else wrapped.no_sync()
        with sync:
            with autocast:
                loss = wrapped.model(tokens, targets) / job.grad_accum_steps
            recorder.sample("forward")
            wrapped.backward(scaler.scale(loss) if scaler is not None else loss)
            recorder.sample("backward")
        loss_value += float(loss.detach())
    if scaler is not None:
        scaler.step(wrapped.optimizer)
        scaler.update()
    elif wrapped.step is not None:  # the mode's engine steps (DeepSpeed)
        wrapped.step()
    else:
        wrapped.optimizer.step()
    recorder.sample("step")
    return loss_value


def train(job: TrainJob, on_step: Callable[[StepInfo], None] | None = None,
          on_resume: Callable[[int], None] | None = None) -> list[RankReport]:
    """Run ``job`` on this rank; a collective (every rank calls it with the same job).

    Args:
        job: what to run.
        on_step: called on rank 0 after every step, outside the measured window.
        on_resume: called on rank 0 with the step a checkpoint was loaded at, before training
            on from it (not called when the run starts from step 0).

    Returns:
        Every rank's :class:`RankReport`, indexed by rank (the same list on every rank).

    Raises:
        ValueError: unknown or unavailable mode, unknown preset, or a checkpoint saved for
            another model.
        RuntimeError: no process group (call :func:`init_process_group_from_env` first).
    """
    comm.require_initialized("shardopt.app.runner.train")
    try:
        return _train(job, on_step, on_resume)
    except BaseException as exc:
        # The other ranks' collectives end naming this rank and why (Note [failure board] in shardopt.failures).
        comm.report_failure(f"{type(exc).__name__}: {exc}".splitlines()[0])
        raise


def _train(job: TrainJob, on_step: Callable[[StepInfo], None] | None,
           on_resume: Callable[[int], None] | None) -> list[RankReport]:
    mode = get_mode(job.mode)
    if job.preset not in PRESETS:
        raise ValueError(f"unknown model preset {job.preset!r}; choose one of {sorted(PRESETS)}")
    torch.set_num_threads(job.threads_per_rank)
    rank, world = comm.group_rank(None), comm.group_size(None)
    device = _train_device(job.device)
    cfg = PRESETS[job.preset]
    batches = CharBatches(stdlib_corpus(job.corpus_bytes), job.batch_size, cfg.seq_len, rank, job.seed, world)
    reason = mode.unavailable(device.type) or mode.refuses(job.precision)  # imports the mode's library: the baseline has it
    if reason is not None:
        raise ValueError(reason)
    if job.amp is not None and mode.autocast is not None:
        raise ValueError(f"TrainJob(amp={job.amp!r}) with mode {mode.name!r}, which autocasts in {mode.autocast} "
                         "itself; keep amp=None")
    recorder = MemoryRecorder()
    recorder.start()
    module = build_model(cfg, seed=job.seed, device=device)
    faults = FaultPlan.from_env(rank)  # None unless a restart test asks this rank to die
    if faults is not None:
        faults.arm(module)
    num_params = sum(p.numel() for p in module.parameters())
    setup = Setup(job.lr, device, job.precision, job.batch_size, job.grad_accum_steps, job.shard_size, job.compile)
    group_bytes = None if mode.peer else GroupBytes(job.shard_size)
    with group_bytes.installed() if group_bytes is not None else contextlib.nullcontext():
        wrapped = mode.wrap(module, setup)
        scaler = _make_scaler(job, device)
        start = _resume(job, wrapped, scaler)
        if start and rank == 0 and on_resume is not None:
            on_resume(start)
        # after the resume: loading rebuilds OSS's wrapped optimizer (Note [counting offloaded state])
        states = StateCount(wrapped) if not mode.peer or wrapped.offloaded else None
        # DDP reduces in C++, past shardopt.comm: its bytes are computed (Note [bytes per group]).
        ddp_bytes = ddp_step_bytes(list(wrapped.module.parameters()), world) if isinstance(wrapped.model, DDP) else 0.0
        loss, per_step = _steps(job, wrapped, batches, start, scaler, recorder, device, group_bytes, ddp_bytes,
                                on_step, faults)
        if states is not None:
            states.remove()
    if job.checkpoint_path and job.steps > start:
        _save(job, wrapped, job.steps, scaler, faults)
    if faults is not None:
        faults.at_exit(job.steps)
    counted = recorder.steps[job.warmup_steps:]
    by_group = per_step[job.warmup_steps:]
    times = tuple(s.seconds for s in counted)
    sent = [s.bytes_sent for s in counted]
    report = RankReport(
        rank=rank, world_size=world, mode=job.mode, num_params=num_params,
        heap_after_step=recorder.last("step"), heap_peak=recorder.peak(),
        # wchar sees socket writes only; NCCL moves data over NVLink/InfiniBand without them.
        bytes_per_step=(sum(b for b in sent if b is not None) / len(sent))
        if sent and None not in sent and dist.get_backend() != "nccl" else None,
        median_step_s=statistics.median(times) if times else None,
        step_times_s=times, counted_steps=len(counted), final_loss=loss, start_step=start,
        tokens_per_step=job.batch_size * PRESETS[job.preset].seq_len * job.grad_accum_steps * world,
        device_peak=recorder.device_peak, backend=str(dist.get_backend()),
        group_bytes_per_step={k: sum(d[k] for d in by_group) / len(by_group) for k in GROUP_KINDS}
        if group_bytes is not None and by_group else None,
        compiled_graphs=_compiled_graphs() if job.compile else None,
        device_state_bytes=None if states is None else states.device_bytes,
        host_state_bytes=None if states is None else states.host_bytes,
    )
    if job.params_out is not None:
        params = full_parameters(wrapped)
        if rank == 0:
            torch.save(params, job.params_out)
    return list(comm.all_gather_object(report, None))


def _compiled_graphs() -> int:
    """Graphs Dynamo compiled in this process (its own statistics counter)."""
    from torch._dynamo.utils import counters  # here, not at the top: a second of import for every command

    return int(counters["stats"]["unique_graphs"])


def _steps(job: TrainJob, wrapped: Wrapped, batches: CharBatches, start: int, scaler: Any | None,
           recorder: MemoryRecorder, device: torch.device, group_bytes: GroupBytes | None, ddp_bytes: float,
           on_step: Callable[[StepInfo], None] | None,
           faults: FaultPlan | None) -> tuple[float, list[dict[str, float]]]:
    """Train from ``start`` to ``job.steps``: the last loss, and each step's bytes by group kind."""
    rank, world = comm.group_rank(None), comm.group_size(None)
    tokens_per_step = job.batch_size * PRESETS[job.preset].seq_len * job.grad_accum_steps * world
    loss = float("nan")
    per_step: list[dict[str, float]] = []
    for step in range(start, job.steps):
        comm.barrier(None)
        if faults is not None:
            faults.begin_step(step + 1)
        before = group_bytes.snapshot() if group_bytes is not None else {}
        t0 = time.perf_counter()
        with recorder.step():
            loss = _one_step(job, wrapped, batches, step, scaler, recorder, device)
        seconds = time.perf_counter() - t0
        if group_bytes is not None:
            group_bytes.add("world", ddp_bytes)
            per_step.append({k: v - before[k] for k, v in group_bytes.snapshot().items()})
        done = step + 1
        if job.checkpoint_path and job.save_every_steps and done % job.save_every_steps == 0 and done < job.steps:
            _save(job, wrapped, done, scaler, faults)
        if rank == 0 and on_step is not None:
            on_step(StepInfo(done, job.steps, loss, tokens_per_step / seconds))
    return loss, per_step
