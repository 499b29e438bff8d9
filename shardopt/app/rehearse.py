"""One rank of N at full size, in one process: its memory peak by category and its step's timeline.

:func:`rehearse_rank` makes the default process group torch's fake one (Note [fake process
group] in :mod:`shardopt.failures`) as rank ``r`` of ``N``, builds the real model and wrappers
(:func:`~shardopt.app.rehearse_build.build_rank`), and trains it on a real batch:
three steps under a :class:`~shardopt.app.storage_trace.StorageTracker` (Note [the peak,
replayed]), then the timed steps under a :class:`~shardopt.app.timeline.TimelineRecorder`.
:func:`rehearse_on_group` does the same on whatever group exists, so a real gloo rank can be
measured by the same code (the tests and ``scripts/rehearse_check.py`` do).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardopt import comm, failures
from shardopt.app.precision import Precision
from shardopt.app.rehearse_build import Built, ModelSpec, build_rank, make_batch
from shardopt.app.storage_trace import StorageTracker, storage_key
from shardopt.app.timeline import StepTimeline, TimelineRecorder
from shardopt.nn import ShardedDataParallel
from shardopt.partition import cut_quantum, partition_by_size, plan_split

__all__ = ["CATEGORIES", "MIN_STEPS", "TRACKED_STEPS", "MemoryBreakdown", "RankRehearsal", "RehearsalConfig",
           "heaviest_rank", "rehearse_on_group", "rehearse_rank"]

TRACKED_STEPS = 3
"""Steps run under the storage tracker: the first, the peak and its replay (Note [the peak, replayed]); up to
two more when a replay does not match (DDP rebuilds its buckets in its second step)."""
MIN_STEPS = TRACKED_STEPS + 1
"""The fewest steps a rehearsal runs: the tracked ones and one timed step."""

CATEGORIES = ("params", "grads", "masters", "optimizer", "comm", "activations", "other")
"""The parts of a peak, in the order a storage is attributed (Note [what the peak is made of])."""


@dataclass(frozen=True)
class RehearsalConfig:
    """What to rehearse; the same for every rank.

    Attributes:
        spec: the model.
        mode: one of :data:`shardopt.app.rehearse_build.REHEARSED_MODES`.
        precision: parameter precision.
        world_size: N.
        shard_size: S for the hybrid modes, else ``None``.
        batch_size: sequences per rank per step.
        seq_len: tokens per sequence.
        checkpointing: recompute each block's activations in backward.
        steps: steps in all (:data:`TRACKED_STEPS` tracked, the rest timed).
        seed: initialisation and data seed.
        device: ``"cpu"`` or ``"cuda"``.
        threads: intra-op threads (``None``: torch's default).
        delayed_update: ``zero1-offload`` / ``zero2-offload`` only: build the OSS with
            ``delay_update_after`` (Note [a rehearsed delayed update] in
            :mod:`shardopt.app.rehearse_build`), so the host holds the delayed step's copy of the
            gradient buffer too.
    """

    spec: ModelSpec
    mode: str
    precision: Precision
    world_size: int
    shard_size: int | None = None
    batch_size: int = 1
    seq_len: int = 512
    checkpointing: bool = False
    steps: int = MIN_STEPS
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    delayed_update: bool = False


@dataclass(frozen=True)
class MemoryBreakdown:
    """A peak split into what holds it (Note [what the peak is made of]); bytes.

    Attributes:
        params: parameters as this rank holds them (ZeRO-3: its flat shards).
        grads: gradients of parameters (ZeRO-3: also the full gradients of a unit waiting
            for its reduce-scatter).
        masters: fp32 masters (or split rows) the optimizer steps, and their gradients.
        optimizer: the optimizer's state.
        comm: communication buffers and gathers: storages handed to a collective (DDP's and
            ShardedDataParallel's buckets, receive buffers, OSS's gather chunks) and
            ZeRO-3's full parameter buffers.
        activations: every other storage made during the step (activations saved for
            backward, temporaries, the loss).
        other: every other storage made before the step and still alive (the batch, the
            wrappers' small bookkeeping tensors).
        phase: where in the step the peak fell (``forward``, ``backward``, ``step``).
        host: of the categories' bytes, those an offload mode keeps in host memory (Note
            [device and host at the peak]); 0 without offload.
        host_held: every host storage alive at the peak was alive from the step's start to its
            end, so :attr:`device` is the step's device peak too (Note [device and host at the peak]).
    """

    params: int
    grads: int
    masters: int
    optimizer: int
    comm: int
    activations: int
    other: int
    phase: str
    host: int = 0
    host_held: bool = True

    @property
    def total(self) -> int:
        """Every category: the live bytes at the replayed peak."""
        return sum(getattr(self, name) for name in CATEGORIES)

    @property
    def device(self) -> int:
        """The live bytes at the replayed peak that are not the host's: :attr:`total` less :attr:`host`."""
        return self.total - self.host


@dataclass(frozen=True)
class RankRehearsal:
    """What one rank measured.

    Attributes:
        rank: the rank played.
        world_size: N.
        peak_bytes: the steady-state peak (the second step's), tracked storages.
        memory: the peak by category, measured at the replayed event of the third step.
        build_peak_bytes: the peak while the model was materialised and wrapped.
        first_step_peak_bytes: the first step's peak (the optimizer state is created in it).
        device_peak_bytes: on a GPU, ``torch.cuda.max_memory_allocated`` over the tracked
            steps (kernels' scratch included); ``None`` on the CPU.
        timelines: one per timed step.
        tokens_per_step: tokens this rank trains per step.
    """

    rank: int
    world_size: int
    peak_bytes: int
    memory: MemoryBreakdown
    build_peak_bytes: int
    first_step_peak_bytes: int
    device_peak_bytes: int | None
    timelines: tuple[StepTimeline, ...] = field(default=())
    tokens_per_step: int = 0

    @property
    def replay_matched(self) -> bool:
        """The replayed step reached the same live bytes at the same event as the measured one."""
        return self.memory.total == self.peak_bytes

    @property
    def needed_bytes(self) -> int:
        """The most the rank held at any point: the build, the first step or the steady state."""
        return max(self.peak_bytes, self.build_peak_bytes, self.first_step_peak_bytes, self.device_peak_bytes or 0)

    @property
    def device_needed_bytes(self) -> int:
        """What must fit the device: :attr:`needed_bytes` without offload, else the steady peak's
        device side (Note [device and host at the peak])."""
        return self.needed_bytes if self.memory.host == 0 else self.memory.device

    def as_dict(self) -> dict[str, Any]:
        """Plain values for JSON (the timelines as their compute times and bytes)."""
        out = {k: v for k, v in asdict(self).items() if k != "timelines"}
        out["memory"]["total"] = self.memory.total
        out["memory"]["device"] = self.memory.device
        out["device_needed_bytes"] = self.device_needed_bytes
        out["replay_matched"] = self.replay_matched
        out["needed_bytes"] = self.needed_bytes
        out["steps"] = [{"wall_s": t.wall_s, "compute_s": t.compute_s, "collectives": len(t.calls),
                         "bytes_by_group": t.bytes_by_kind()} for t in self.timelines]
        return out


# Note [the peak, replayed]
# Which storages make the peak is known only at the peak, and the peak is known only once the
# step is over. A training step repeats itself exactly once the optimizer state exists: the
# same operators allocate the same sizes in the same order (the batch, the model and the
# collectives are the same; under the fake group nothing arrives from another rank). So
# step 1 creates the optimizer state (its peak is kept apart: the first step's), step 2 is
# watched for its peak (the live bytes and the event number, counted from the step's first
# event), and step 3 is stopped at the same event number to look at what is alive there
# (Note [what the peak is made of]). The garbage collector is run before and kept off during
# these steps, so it frees nothing at a different point. The replayed live bytes equal the
# measured peak when the step repeated exactly (RankRehearsal.replay_matched, checked by the
# tests; the report flags a mismatch). A step can differ from the one before it (DDP rebuilds
# its buckets in its second iteration), so when a replay does not match, the replayed step's
# own peak is replayed in the next one, up to three times.

# Note [what the peak is made of]
# At the replayed event every live tracked storage is attributed to the first category that
# reaches it, in CATEGORIES order: the optimizer's state, the masters and their gradients,
# the parameters, their gradients (Built.param_tensors and friends say where each mode keeps
# them), then communication: storages handed to a c10d operator (a collective, a send or a
# receive) so far, storages made at the event of the previous step that made one that was
# later handed to a c10d operator (a bucket filled now and sent later in the step), and
# ZeRO-3's full parameter buffers. Whatever is left
# is split by age: made during this step (activations and temporaries: the remainder, as
# measured storages, not a difference) or before it (other). The categories therefore sum to
# the live bytes at that event, which is the peak when the replay matched.

# Note [device and host at the peak]
# With offload the tracker still counts one ledger of storages (on a CPU-only machine host and
# device are the same memory, and `.device` cannot tell them apart). At the replayed event the
# storages that Built.host_tensors names (Note [host storages of a rehearsal] in
# shardopt.app.rehearse_build) are summed as `host`; they stay in their categories too, so the
# categories still sum to the peak, and device = peak - host at the same event. That is also
# the step's device peak when every host storage alive at the peak was alive from the step's
# start to its end (MemoryBreakdown.host_held, checked after the replayed step): then the host
# bytes at any other event E of the step are at least those at the peak, so
# device(E) = total(E) - host(E) <= total(peak) - host(peak). It holds for zero1-offload and
# zero2-offload (masters, their kept gradient buffer and Adam's state persist from the first
# step on) and for zero3-offload at the sizes the tests run (its peak is in backward, before
# the reduced gradients land on the host; shards and Adam's state persist); where it does not
# hold the report marks the device figure with '?'. The build's and the first step's peaks
# are reported as device + host and not split. On a GPU
# the tracker counts only CUDA storages, so host is 0 there and the peak is the device's.


def _attribute(tracker: StorageTracker, built: Built, step_start: int, comm_offsets: frozenset[int],
               phase: str) -> tuple[MemoryBreakdown, frozenset[int]]:
    live = tracker.live()
    seen: set[int] = set()
    device = tracker.device_type

    def take(tensors: Sequence[torch.Tensor | None] | frozenset[int]) -> int:
        keys = set(tensors) if isinstance(tensors, frozenset) else {
            storage_key(t) for t in tensors if t is not None and t.device.type == device}
        fresh = {k for k in keys if k in live and k not in seen}
        seen.update(fresh)
        return sum(live[k] for k in fresh)

    parts = {"optimizer": take(built.optimizer_tensors()), "masters": take(built.master_tensors()),
             "params": take(built.param_tensors()), "grads": take(built.grad_tensors())}
    host = {storage_key(t) for t in built.host_tensors() if t is not None and t.device.type == device}
    host_live = frozenset(k for k in host if k in live and k in seen)
    gathers = {storage_key(t) for t in built.gather_tensors()}
    to_come = {k for k in live if tracker.born(k) - step_start in comm_offsets}
    parts["comm"] = take(frozenset(tracker.comm_keys | gathers | to_come))
    rest = [k for k in live if k not in seen]
    parts["activations"] = sum(live[k] for k in rest if tracker.born(k) >= step_start)
    parts["other"] = sum(live[k] for k in rest if tracker.born(k) < step_start)
    host_bytes = sum(live[k] for k in host_live)
    return MemoryBreakdown(parts["params"], parts["grads"], parts["masters"], parts["optimizer"], parts["comm"],
                           parts["activations"], parts["other"], phase, host_bytes), host_live


def _one_step(config: RehearsalConfig, built: Built, batch: tuple[torch.Tensor, torch.Tensor],
              tracker: StorageTracker | None) -> None:
    def phase(name: str) -> None:
        if tracker is not None:
            tracker.label = name

    phase("zero_grad")
    built.optimizer.zero_grad(set_to_none=True)
    phase("forward")
    loss = config.spec.loss(built.model, *batch)
    phase("backward")
    loss.backward()
    built.finish_backward()
    del loss
    phase("step")
    built.optimizer.step()


@dataclass
class _Watched:
    """One tracked step: its peak, where it fell, and the storages it handed to collectives."""

    start: int
    peak: int
    offset: int
    phase: str
    comm_offsets: frozenset[int]


def _watch(config: RehearsalConfig, built: Built, batch: tuple[torch.Tensor, torch.Tensor],
           tracker: StorageTracker, look: Callable[[int], None] | None = None, at: int = 0) -> _Watched:
    """Run one step under the tracker; ``look(start)`` runs ``at`` events into it (at once when ``at`` is 0)."""
    gc.collect()
    tracker.reset_peak()
    start, births = tracker.events, len(tracker.comm_births)
    if look is not None:
        if at == 0:
            look(start)
        else:
            tracker.probe_at(start + at, lambda: look(start))
    _one_step(config, built, batch, tracker)
    offsets = frozenset(b - start for b in tracker.comm_births[births:] if b >= start)
    return _Watched(start, tracker.peak_bytes, tracker.peak_event - start, tracker.peak_label, offsets)


_MAX_REPLAYS = 3


def _look(found: list[tuple[MemoryBreakdown, frozenset[int]]], tracker: StorageTracker, built: Built,
          previous: _Watched, start: int) -> None:
    """At the replayed event: what the live storages are (Note [what the peak is made of])."""
    found.append(_attribute(tracker, built, start, previous.comm_offsets, previous.phase))


def _held(tracker: StorageTracker, host: frozenset[int], start: int) -> bool:
    """Whether the host storages seen at the peak were born before the step and are alive after it."""
    live = tracker.live()
    return all(k in live and tracker.born(k) <= start for k in host)  # event `start` is the last before the step


def _tracked_steps(config: RehearsalConfig, built: Built, batch: tuple[torch.Tensor, torch.Tensor],
                   tracker: StorageTracker) -> tuple[int, int, MemoryBreakdown]:
    """The first step's peak, the steady peak and its parts (Note [the peak, replayed])."""
    gc.collect()
    gc.disable()
    try:
        first = _watch(config, built, batch, tracker)
        measured = _watch(config, built, batch, tracker)
        for _ in range(_MAX_REPLAYS):
            found: list[tuple[MemoryBreakdown, frozenset[int]]] = []
            previous = measured
            look = partial(_look, found, tracker, built, previous)
            measured = _watch(config, built, batch, tracker, look, previous.offset)
            if not found:
                raise AssertionError(f"[rank {comm.group_rank(None)}] the replayed step ended before event "
                                     f"{previous.offset}: the step did not repeat (Note [the peak, replayed])")
            memory = replace(found[0][0], host_held=_held(tracker, found[0][1], measured.start))
            if memory.total == previous.peak:
                break
    finally:
        gc.enable()
    return first.peak, previous.peak, memory


def rehearse_on_group(config: RehearsalConfig, progress: Callable[[str], None] | None = None) -> RankRehearsal:
    """Build this rank on the group that exists, track three steps, time the rest.

    Args:
        config: what to run.
        progress: called with a short line before each phase.

    Returns:
        This rank's measurements.
    """
    rank = comm.group_rank(None)
    device = torch.device(config.device)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    say = progress or (lambda line: None)
    tracker = StorageTracker(device.type)
    built: Built | None = None
    try:
        with tracker:
            tracker.label = "build"
            say("building")
            built = build_rank(config.spec, config.mode, config.precision, device, shard_size=config.shard_size,
                               checkpointing=config.checkpointing, batch_size=config.batch_size, seed=config.seed,
                               delayed_update=config.delayed_update)
            build_peak = tracker.peak_bytes
            batch = make_batch(config.spec, config.batch_size, config.seq_len, rank, config.seed, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            say("tracking memory")
            first, peak, memory = _tracked_steps(config, built, batch, tracker)
            device_peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
        timelines: list[StepTimeline] = []
        recorder = TimelineRecorder(config.shard_size, device)
        real = not failures.is_fake_group() and comm.group_size(None) > 1
        with recorder.installed():
            for step in range(config.steps - TRACKED_STEPS):
                say(f"timing step {step + 1} of {config.steps - TRACKED_STEPS}")
                if real:
                    comm.barrier(None)  # start together; the barrier is outside the timed step
                with recorder.step(timelines):
                    _one_step(config, built, batch, None)
        return RankRehearsal(rank, comm.group_size(None), peak, memory, build_peak, first, device_peak,
                             tuple(timelines), config.batch_size * config.seq_len)
    finally:
        if built is not None and isinstance(built.model, ShardedDataParallel):
            built.model.close()  # its hooks hold it from C++, out of the collector's sight
        built = None  # drop the wrappers before the group (torch 2.13: freeing DDP after it can block)
        gc.collect()


def rehearse_rank(config: RehearsalConfig, rank: int, progress: Callable[[str], None] | None = None) -> RankRehearsal:
    """Play ``rank`` of ``config.world_size`` under torch's fake group (made and destroyed here).

    Raises:
        RuntimeError: ``torch.distributed`` is already initialised in this process.
        ValueError: a rank out of range, or as :func:`~shardopt.app.rehearse_build.build_rank`.
    """
    if not 0 <= rank < config.world_size:
        raise ValueError(f"--ranks: rank {rank} is not in [0, {config.world_size}); give ranks below --world-size")
    if dist.is_initialized():
        raise RuntimeError("rehearse makes its own fake default process group, but torch.distributed is already "
                           f"initialised (backend {dist.get_backend()!r}); run it in a process without one")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=config.world_size)
    try:
        return rehearse_on_group(config, progress)
    finally:
        dist.destroy_process_group()


def heaviest_rank(mode: str, shapes: Sequence[Sequence[int]], world_size: int, shard_size: int | None,
                  width: int) -> int | None:
    """The rank holding the most optimizer state under ``mode``'s ownership plan, or ``None`` when all hold the same.

    The plan is the one OSS builds (as :func:`shardopt.fake_ranks.ranks_to_measure` computes
    it): whole parameters for ``zero2`` and ``zero2-offload``, row-split large parameters for ``zero1``,
    ``zero2-split`` and the hybrid modes (OSS's default with Adam), over the shard group of
    ``shard_size`` ranks for the hybrid modes (the heaviest shard rank of the first group).

    Args:
        mode: the mode.
        shapes: every parameter's shape.
        world_size: N.
        shard_size: S, or ``None``.
        width: bytes of one parameter element.
    """
    if mode in ("ddp", "zero3", "zero3-offload"):
        return None
    ranks = shard_size if mode.endswith("hybrid") and shard_size is not None else world_size
    sizes = [math.prod(s) * width for s in shapes]
    if mode in ("zero2", "zero2-offload"):
        loads = partition_by_size(sizes, ranks).rank_bytes
    else:
        rows = [s[0] if len(s) else 1 for s in shapes]
        quanta = [cut_quantum(math.prod(s) // r if r else 0) for s, r in zip(shapes, rows, strict=True)]
        loads = plan_split(sizes, rows, ranks, quanta).rank_bytes
    return max(range(ranks), key=lambda r: (loads[r], -r))
