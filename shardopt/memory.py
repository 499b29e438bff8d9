"""Model-state memory: the ZeRO paper's estimates, and process-level measurements.

Two halves. :func:`estimate_model_states` applies the formulas of the ZeRO paper
(Rajbhandari et al., 2020, section 3 and Figure 1) to a parameter count, and
:func:`estimate_plans` puts next to them what the heaviest rank really holds under
shardopt's ownership plans (whole parameters as OSS plans today, and the row-split plan of
:func:`shardopt.partition.plan_split`); :func:`estimate_offload` splits each stage's bytes per
parameter into those on the device and those in host memory, with and without
``OSS(offload="cpu")`` (Note [offload bytes per parameter]). The measuring half
reads what the process really did, for use in any training loop:

- :func:`bytes_sent` reads ``wchar`` from ``/proc/self/io``: every byte this process handed
  to ``write``/``send`` system calls, which includes everything gloo puts on its sockets.
  The delta around a training step is the bytes that step sent (nothing else may print or
  write inside the window).
- :func:`heap_bytes` calls glibc's ``mallinfo2()`` and returns ``uordblks + hblkhd``: bytes
  in use in the malloc arenas plus those in mmap'ed chunks, which is where CPU tensors live,
  plus the host buffers shardopt maps itself (Note [host buffer placement] in
  :mod:`shardopt.host_memory`).
- On CUDA, :func:`device_memory` reads ``torch.cuda.memory_allocated`` and its peak.

:class:`MemoryRecorder` puts these together: take a baseline before the model is built,
call :meth:`MemoryRecorder.sample` after forward, backward and step, and wrap counted steps
in :meth:`MemoryRecorder.step` to get bytes sent and seconds per step. Where a source is
unavailable (not Linux, not glibc) the readings are ``None`` and :func:`capabilities` says
why, instead of reporting zeros.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from shardopt.host_memory import placed_bytes
from shardopt.partition import cut_quantum, partition_by_size, plan_split

__all__ = [
    "MemoryRecorder",
    "ModelStateEstimate",
    "PlanEstimate",
    "StageBytes",
    "StepRecord",
    "bytes_sent",
    "capabilities",
    "device_memory",
    "estimate_model_states",
    "estimate_offload",
    "estimate_plans",
    "heap_bytes",
]

GB = 1e9


@dataclass(frozen=True)
class ModelStateEstimate:
    """Model-state bytes per rank for DDP and ZeRO stages 1-3 (ZeRO paper, Figure 1).

    With ``Psi`` parameters, ``K`` optimizer-state bytes per parameter and ``N`` ranks, mixed
    precision keeps 2-byte parameters and 2-byte gradients: DDP holds ``(2 + 2 + K) Psi``,
    stage 1 ``(2 + 2) Psi + K Psi / N``, stage 2 ``2 Psi + (2 + K) Psi / N`` and stage 3
    ``(2 + 2 + K) Psi / N``. In fp32 the parameter and gradient terms are 4 bytes each.

    The paper counts a 2-byte gradient per parameter. shardopt's mixed-precision stages 1
    and 2 (``OSS(..., master_dtype=torch.float32)`` over bf16 parameters, under DDP or
    ShardedDataParallel) fold the owner's gradients into fp32 master gradients for the step
    and free them after it (Note [master gradients] in :mod:`shardopt.optim.masters`): from
    the reduction to the end of the step the owner's gradient share is
    :attr:`master_grad_bytes` (4) per parameter instead of 2, which
    :attr:`stage1_at_step` and :attr:`stage2_at_step` count.

    Attributes:
        num_params: Psi.
        world_size: N.
        optimizer_bytes_per_param: K (12 for mixed-precision Adam: fp32 master weights,
            momentum and variance; 8 for fp32 Adam).
        param_bytes: bytes of one parameter as the model holds it (2 or 4).
        grad_bytes: bytes of one gradient (2 or 4).
        largest_layer_params: the biggest single parameter tensor, when known (ZeRO-3 must
            gather at least that much at once); ``None`` for a bare count.
        master_grad_bytes: bytes of one gradient as the owner holds it for the step with
            master weights (4 for fp32 masters); ``None`` when gradients stay ``grad_bytes``
            wide (fp32 training).
    """

    num_params: int
    world_size: int
    optimizer_bytes_per_param: float
    param_bytes: int
    grad_bytes: int
    largest_layer_params: int | None = None
    master_grad_bytes: int | None = None

    @property
    def ddp(self) -> float:
        """Bytes per rank with plain data parallelism (everything replicated)."""
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes_per_param) * self.num_params

    @property
    def stage1(self) -> float:
        """Bytes per rank with optimizer state partitioned (ZeRO-1, ``OSS``)."""
        return (self.param_bytes + self.grad_bytes) * self.num_params + (
            self.optimizer_bytes_per_param * self.num_params / self.world_size)

    @property
    def stage2(self) -> float:
        """Bytes per rank with optimizer state and gradients partitioned (ZeRO-2)."""
        return self.param_bytes * self.num_params + (
            (self.grad_bytes + self.optimizer_bytes_per_param) * self.num_params / self.world_size)

    @property
    def stage3(self) -> float:
        """Bytes per rank with parameters partitioned too (ZeRO-3)."""
        return self.ddp / self.world_size

    @property
    def stage1_at_step(self) -> float:
        """Stage 1 while the owner's gradients are master-width (full low-precision gradients
        elsewhere, as DDP left them): :attr:`stage1` when there are no masters."""
        extra = 0 if self.master_grad_bytes is None else self.master_grad_bytes - self.grad_bytes
        return self.stage1 + extra * self.num_params / self.world_size

    @property
    def stage2_at_step(self) -> float:
        """Stage 2 while the owner's gradient partition is master-width: :attr:`stage2` when
        there are no masters."""
        extra = 0 if self.master_grad_bytes is None else self.master_grad_bytes - self.grad_bytes
        return self.stage2 + extra * self.num_params / self.world_size

    def as_dict(self) -> dict[str, float | int | None]:
        """Inputs and the per-rank byte counts (the paper's four and shardopt's two at the step), for JSON."""
        return {
            "num_params": self.num_params, "world_size": self.world_size,
            "optimizer_bytes_per_param": self.optimizer_bytes_per_param,
            "param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes,
            "largest_layer_params": self.largest_layer_params, "master_grad_bytes": self.master_grad_bytes,
            "ddp_bytes": self.ddp, "stage1_bytes": self.stage1, "stage2_bytes": self.stage2,
            "stage3_bytes": self.stage3, "stage1_at_step_bytes": self.stage1_at_step,
            "stage2_at_step_bytes": self.stage2_at_step,
        }


def estimate_model_states(
    num_params: int,
    world_size: int,
    mixed_precision: bool = True,
    optimizer_bytes_per_param: float | None = None,
    largest_layer_params: int | None = None,
) -> ModelStateEstimate:
    """Model-state bytes per rank under DDP and ZeRO 1/2/3 (see :class:`ModelStateEstimate`).

    Example: the paper's 7.5B-parameter model on 64 ranks with mixed-precision Adam gives
    120 / 31.4 / 16.6 / 1.9 GB; shardopt's stages 1 and 2 hold 31.6 and 16.9 GB during the
    step (fp32 master gradients on the owner).

    Args:
        num_params: parameters in the model (Psi).
        world_size: data-parallel ranks (N).
        mixed_precision: fp16/bf16 parameters and gradients with fp32 optimizer state
            (default K=12) and fp32 master gradients at the step (``master_grad_bytes=4``);
            otherwise fp32 everywhere (default K=8, Adam's two moments).
        optimizer_bytes_per_param: K, overriding the default for the precision.
        largest_layer_params: the biggest parameter tensor, carried into the result.

    Returns:
        The estimate.

    Raises:
        ValueError: a count is not positive or K is negative.
    """
    if num_params < 1:
        raise ValueError(f"num_params must be >= 1, got {num_params}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    k = optimizer_bytes_per_param
    if k is None:
        k = 12.0 if mixed_precision else 8.0
    if k < 0:
        raise ValueError(f"optimizer_bytes_per_param must be >= 0, got {k}")
    width = 2 if mixed_precision else 4
    return ModelStateEstimate(int(num_params), int(world_size), float(k), width, width, largest_layer_params,
                              master_grad_bytes=4 if mixed_precision else None)


# Note [the formula and the plan]
# The ZeRO formulas divide the sharded bytes by N as if every rank owned Psi / N parameters.
# Where OSS keeps parameters whole (partition_by_size: matrix-wise optimizers, or
# split_large_params=False) the heaviest rank owns at least the largest parameter: on a
# Llama-3-8B shape (untied 525M-parameter embedding and head) ZeRO-2 with mixed precision
# holds 23.4 GB on the heaviest rank from 16 ranks up, where the formula promises 17.8 GB at
# 64 ranks and 16.2 GB at 1024. PlanEstimate replaces Psi / N by the heaviest rank's owned
# parameters under both real plans, whole and split (plan_split, OSS's default for
# elementwise optimizers), for the sharded terms of stages 1 and 2: stage 1
# shards the optimizer state (K), stage 2 also the gradients. ZeRO-3 shards FlatParameter
# units evenly by elements, so its formula row stands.


@dataclass(frozen=True)
class PlanEstimate:
    """The heaviest rank's model states under shardopt's real ownership plans (Note [the formula and the plan]).

    Attributes:
        formula: the ZeRO-paper estimate for the same model, world size and precision.
        unsplit_heaviest_params: parameters (elements) owned by the heaviest rank when
            every parameter stays whole (:func:`~shardopt.partition.partition_by_size`, as
            ``OSS`` plans today).
        split_heaviest_params: the same under :func:`~shardopt.partition.plan_split`.
        unsplit_imbalance: heaviest rank over the mean, whole parameters.
        split_imbalance: heaviest rank over the mean, split plan.
        split_param_count: how many parameters the split plan cuts into row blocks.
    """

    formula: ModelStateEstimate
    unsplit_heaviest_params: int
    split_heaviest_params: int
    unsplit_imbalance: float
    split_imbalance: float
    split_param_count: int

    def _owned(self, split: bool) -> int:
        return self.split_heaviest_params if split else self.unsplit_heaviest_params

    def stage1(self, split: bool) -> float:
        """Heaviest rank's bytes with ZeRO-1: replicated parameters and gradients, its own optimizer state."""
        f = self.formula
        return (f.param_bytes + f.grad_bytes) * f.num_params + f.optimizer_bytes_per_param * self._owned(split)

    def stage2(self, split: bool) -> float:
        """Heaviest rank's bytes with ZeRO-2: replicated parameters, its own gradients and optimizer state."""
        f = self.formula
        return f.param_bytes * f.num_params + (f.grad_bytes + f.optimizer_bytes_per_param) * self._owned(split)

    def _master_extra(self, split: bool) -> int:
        f = self.formula
        return 0 if f.master_grad_bytes is None else (f.master_grad_bytes - f.grad_bytes) * self._owned(split)

    def stage1_at_step(self, split: bool) -> float:
        """:meth:`stage1` while the owner's gradients are fp32 master gradients (as
        :attr:`ModelStateEstimate.stage1_at_step`)."""
        return self.stage1(split) + self._master_extra(split)

    def stage2_at_step(self, split: bool) -> float:
        """:meth:`stage2` while the owner's gradients are fp32 master gradients."""
        return self.stage2(split) + self._master_extra(split)

    def as_dict(self) -> dict[str, float | int]:
        """The plan figures and the heaviest rank's bytes, for JSON."""
        out: dict[str, float | int] = {
            "unsplit_heaviest_params": self.unsplit_heaviest_params,
            "split_heaviest_params": self.split_heaviest_params, "unsplit_imbalance": self.unsplit_imbalance,
            "split_imbalance": self.split_imbalance, "split_param_count": self.split_param_count}
        for name, split in (("unsplit", False), ("split", True)):
            out[f"stage1_{name}_bytes"] = self.stage1(split)
            out[f"stage2_{name}_bytes"] = self.stage2(split)
            out[f"stage1_{name}_at_step_bytes"] = self.stage1_at_step(split)
            out[f"stage2_{name}_at_step_bytes"] = self.stage2_at_step(split)
        return out


def estimate_plans(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    mixed_precision: bool = True,
    optimizer_bytes_per_param: float | None = None,
) -> PlanEstimate:
    """The heaviest rank's ZeRO-1/2 model states under the whole-parameter and the row-split plan.

    How it works: each parameter's bytes (numel times the parameter width) and dim-0 length
    go to :func:`~shardopt.partition.partition_by_size` and
    :func:`~shardopt.partition.plan_split` exactly as OSS would plan them (every parameter
    trainable); the heaviest rank's owned parameters replace ``Psi / N`` in the sharded terms.

    Args:
        shapes: each parameter's shape, in module order (``()`` for a 0-dim parameter).
        world_size: data-parallel ranks (N).
        mixed_precision: as :func:`estimate_model_states`.
        optimizer_bytes_per_param: K, as :func:`estimate_model_states`.

    Returns:
        The :class:`PlanEstimate` (its ``formula`` is :func:`estimate_model_states`'s).

    Raises:
        ValueError: no parameters, or as :func:`estimate_model_states`.
    """
    numels = [math.prod(shape) for shape in shapes]
    if not numels or sum(numels) < 1:
        raise ValueError(f"shapes must describe at least one parameter element, got {len(numels)} shapes with "
                         f"{sum(numels)} elements")
    formula = estimate_model_states(sum(numels), world_size, mixed_precision, optimizer_bytes_per_param,
                                    largest_layer_params=max(numels))
    width = formula.param_bytes
    sizes = [n * width for n in numels]
    whole = partition_by_size(sizes, world_size)
    rows = [shape[0] if len(shape) else 1 for shape in shapes]
    quanta = [cut_quantum(n // r if r else 0) for n, r in zip(numels, rows, strict=True)]  # as OSS cuts
    split = plan_split(sizes, rows, world_size, quanta)
    return PlanEstimate(formula, max(whole.rank_bytes) // width, max(split.rank_bytes) // width,
                        whole.imbalance, split.imbalance, len(split.split_params))


# Note [offload bytes per parameter]
# Bytes per parameter of the model one rank holds, N ranks, Adam, P the parameter width (4 in
# fp32, 2 for bf16 parameters), K the optimizer bytes of the paper (8: two fp32 moments; 12
# with fp32 masters: master + moments). Without offload everything is on the device (the
# paper's rows): DDP 2P + K, ZeRO-1 2P + K/N, ZeRO-2 P + (P + K)/N, ZeRO-3 (2P + K)/N.
# With OSS(offload="cpu") (Note [offloaded masters] in shardopt.optim.masters) the owner's
# side moves to the host: its masters (fp32 parameters get exact fp32 mirrors, 4 bytes that
# the run without offload does not have), Adam's moments and the fp32 gradient buffer the
# step reads, kept between steps, 4 bytes: host (K + 4 + mirror) / N with mirror = 4 in
# fp32 and 0 with masters, so 16 / N in both precisions. On the device:
#   ZeRO-1 + offload: 2P, the parameters and DDP's full gradients (after backward; the step
#     folds the owned ones into the host buffer and frees them);
#   ZeRO-2 + offload: P, the parameters; gradients are on the device only in flight (autograd's
#     gradient until its bucket is reduced, and the buckets: a constant, not per parameter),
#     the owner's reduced share goes to the host as it arrives, straight into the kept buffer
#     (OSS.add_grad: one copy), so the host holds (K + 4 + mirror) / N throughout;
#   ZeRO-3 + offload: FullyShardedDataParallel(cpu_offload=CPUOffload(offload_params=True))
#     (Note [offloaded shards] in shardopt.nn.fsdp.offload), like torch FSDP2's CPUOffloadPolicy,
#     keeps the parameter shard, its gradient and the moments on the host, (K + 4 + mirror) / N
#     again (its fp32 shard plays the mirror or the master), and on the device only the units
#     it gathers in flight: 0 per parameter.
# With OSS(offload="cpu", delay_update_after=k) (Note [delayed update] in
# shardopt.optim.delayed_update) the host also keeps the copy of the gradient buffer that a
# delayed step reads, 4 bytes per owned element, from the first delayed step on: ZeRO-1 and
# ZeRO-2 + offload then hold (K + 8 + mirror) / N on the host (20 / N in both precisions).
# ZeRO-3's offload keeps no OSS and has no delayed update: its row does not change.
# Adam's 0-dim step count adds 4 bytes per stepped tensor (one flat tensor per param group and
# one per unaligned master: Note [flat masters] in shardopt.optim.flat_masters), and a real
# plan replaces Psi / N by what the rank owns (Note [the formula and the plan]).


@dataclass(frozen=True)
class StageBytes:
    """One stage's bytes per model parameter on one rank, on the device and on the host
    (Note [offload bytes per parameter]); multiply by the parameter count for bytes per rank.

    Attributes:
        stage: ``"DDP"``, ``"ZeRO-1"``, ``"ZeRO-2"`` or ``"ZeRO-3"``.
        offload: whether the optimizer's side is offloaded to host memory.
        device: bytes per parameter on the device the rank trains on.
        host: bytes per parameter in host memory at the update.
        host_peak: the most bytes per parameter in host memory during a step (``host``: the
            reduced gradients land in the kept buffer).
        world_size: N.
        delayed_update: the host side counts the delayed update's copy of the gradient buffer
            (``OSS(delay_update_after=...)``; ZeRO-1/2 with offload only).
    """

    stage: str
    offload: bool
    device: float
    host: float
    host_peak: float
    world_size: int
    delayed_update: bool = False

    def as_dict(self) -> dict[str, float | int | str | bool]:
        """Plain values for JSON."""
        return {"stage": self.stage, "offload": self.offload, "device_bytes_per_param": self.device,
                "host_bytes_per_param": self.host, "host_peak_bytes_per_param": self.host_peak,
                "world_size": self.world_size, "delayed_update": self.delayed_update}


def estimate_offload(world_size: int, mixed_precision: bool = True, optimizer_bytes_per_param: float | None = None,
                     *, delayed_update: bool = False) -> tuple[StageBytes, ...]:
    """Device and host bytes per parameter for DDP and ZeRO-1/2/3, with and without offload.

    How it works: Note [offload bytes per parameter]; the rows without offload are the ZeRO
    paper's (:func:`estimate_model_states`). Example: ZeRO-2 with bf16 parameters, fp32 masters
    and Adam on 8 ranks holds 2 + 16/8 = 4 bytes per parameter on the device without offload,
    and with it 2 on the device and 16/8 = 2 on the host; with ``delayed_update``, 20/8 = 2.5.

    Args:
        world_size: data-parallel ranks (N).
        mixed_precision: bf16 parameters with fp32 masters (default K=12), else fp32 (K=8).
        optimizer_bytes_per_param: K, overriding the default for the precision.
        delayed_update: the ZeRO-1/2 offload rows count the copy of the gradient buffer that
            ``OSS(offload="cpu", delay_update_after=k)`` keeps on the host, 4 bytes per owned
            element (ZeRO-3's offload has no delayed update; its row is unchanged).

    Returns:
        DDP, ZeRO-1, ZeRO-1 + offload, ZeRO-2, ZeRO-2 + offload, ZeRO-3, ZeRO-3 + offload.

    Raises:
        ValueError: as :func:`estimate_model_states`.
    """
    est = estimate_model_states(1, world_size, mixed_precision, optimizer_bytes_per_param)
    p, k, n = est.param_bytes, est.optimizer_bytes_per_param, est.world_size
    host = (k + 4 + (0 if mixed_precision else 4)) / n
    oss_host = host + (4 / n if delayed_update else 0.0)  # the delayed step's copy of the gradient buffer
    return (
        StageBytes("DDP", False, 2 * p + k, 0.0, 0.0, n),
        StageBytes("ZeRO-1", False, 2 * p + k / n, 0.0, 0.0, n),
        StageBytes("ZeRO-1", True, 2 * p, oss_host, oss_host, n, delayed_update),
        StageBytes("ZeRO-2", False, p + (p + k) / n, 0.0, 0.0, n),
        StageBytes("ZeRO-2", True, p, oss_host, oss_host, n, delayed_update),
        StageBytes("ZeRO-3", False, (2 * p + k) / n, 0.0, 0.0, n),
        StageBytes("ZeRO-3", True, 0.0, host, host, n),
    )


# ---------------------------------------------------------------------- measuring


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _load_mallinfo2() -> tuple[object | None, str]:
    if not sys.platform.startswith("linux"):
        return None, f"heap measurement needs glibc's mallinfo2 (Linux); this is {sys.platform}"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None, "heap measurement needs glibc >= 2.33 (mallinfo2); this C library lacks it"
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn, "glibc mallinfo2: uordblks + hblkhd"


_MALLINFO2, _HEAP_SOURCE = _load_mallinfo2()
_IO_PATH = "/proc/self/io"


def heap_bytes() -> int | None:
    """Bytes this process has allocated through malloc and not freed, or ``None`` if unknown.

    Returns:
        ``uordblks + hblkhd`` from glibc's ``mallinfo2()`` (arena bytes in use plus mmap'ed
        chunks) plus :func:`shardopt.host_memory.placed_bytes` (buffers mapped outside malloc),
        or ``None`` off glibc (see :func:`capabilities`).
    """
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()  # type: ignore[operator]
    return int(info.uordblks + info.hblkhd) + placed_bytes()


def bytes_sent() -> int | None:
    """Total bytes this process has written to files and sockets (``wchar``), or ``None``.

    Returns:
        ``wchar`` from ``/proc/self/io``; ``None`` where that file does not exist.
    """
    try:
        with open(_IO_PATH, "rb") as f:
            for line in f:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def device_memory() -> tuple[int, int] | None:
    """``(allocated, peak allocated)`` bytes on the current CUDA device, or ``None`` without CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return int(torch.cuda.memory_allocated()), int(torch.cuda.max_memory_allocated())


def capabilities() -> dict[str, str | None]:
    """What each measurement reads on this machine, or why it is unavailable.

    Returns:
        ``{"heap": ..., "bytes_sent": ...}``: a description of the source when it works,
        else a sentence saying why it reads ``None``.
    """
    io = "/proc/self/io wchar" if bytes_sent() is not None else (
        f"bytes sent needs {_IO_PATH} (Linux with task I/O accounting); unavailable here")
    return {"heap": _HEAP_SOURCE, "bytes_sent": io}


@dataclass(frozen=True)
class StepRecord:
    """What one counted step cost.

    Attributes:
        seconds: wall time of the step.
        bytes_sent: bytes written by this process during the step (``None`` if unknown).
    """

    seconds: float
    bytes_sent: int | None


@dataclass
class MemoryRecorder:
    """Heap, bytes sent and step time of one process over a training loop.

    How it works: :meth:`start` reads the baseline heap (call it before building the model,
    so the figures are what the model, its gradients, optimizer state and activations
    cost). :meth:`sample` reads the heap (and CUDA memory) at chosen points, e.g. after
    forward, backward and step; labels are kept so the peak can be attributed. Wrapping a
    step in ``with recorder.step():`` records its wall time and ``wchar`` delta.

    Attributes:
        baseline_heap: heap bytes at :meth:`start`.
        samples: ``(label, heap bytes above baseline)`` per :meth:`sample` call.
        steps: one :class:`StepRecord` per counted step.
        device_peak: the largest CUDA allocation peak seen, on GPU.
    """

    baseline_heap: int | None = None
    samples: list[tuple[str, int]] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    device_peak: int | None = None

    def start(self) -> None:
        """Record the baseline heap; call before the model is built."""
        self.baseline_heap = heap_bytes()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    def sample(self, label: str) -> int | None:
        """Read the heap now (bytes above baseline) and keep it under ``label``.

        Args:
            label: where in the step this is, e.g. ``"forward"``, ``"backward"``, ``"step"``.

        Returns:
            Heap bytes above the baseline, or ``None`` when the heap cannot be read.
        """
        heap = heap_bytes()
        dev = device_memory()
        if dev is not None:
            self.device_peak = max(self.device_peak or 0, dev[1])
        if heap is None or self.baseline_heap is None:
            return None
        self.samples.append((label, heap - self.baseline_heap))
        return heap - self.baseline_heap

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time the enclosed step and count the bytes it sent; keeps a :class:`StepRecord`."""
        sent0 = bytes_sent()
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        sent1 = bytes_sent()
        delta = None if sent0 is None or sent1 is None else sent1 - sent0
        self.steps.append(StepRecord(seconds, delta))

    def peak(self) -> int | None:
        """The largest sampled heap above baseline, or ``None`` without samples."""
        return max((v for _, v in self.samples), default=None)

    def last(self, label: str) -> int | None:
        """The most recent sample taken under ``label``, or ``None``."""
        return next((v for name, v in reversed(self.samples) if name == label), None)

    def median_step_s(self) -> float | None:
        """Median wall time of the counted steps, or ``None`` when none were counted."""
        return statistics.median(s.seconds for s in self.steps) if self.steps else None

    def mean_bytes_sent(self) -> float | None:
        """Mean bytes sent per counted step, or ``None`` when unknown."""
        sent = [s.bytes_sent for s in self.steps]
        if not sent or any(b is None for b in sent):
            return None
        return statistics.fmean(b for b in sent if b is not None)
