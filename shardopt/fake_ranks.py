"""Model-state bytes of rank ``r`` of ``N``, measured in one process under torch's fake process group.

:func:`measure_rank` makes the default process group torch's fake one (``init_process_group(
"fake", store=FakeStore(), rank=r, world_size=N)``; Note [fake process group] in
:mod:`shardopt.failures`), builds the real wrappers for one :class:`Mode` (torch's DDP, OSS
under DDP, ShardedDataParallel, FullyShardedDataParallel) over a model that really allocates
its tensors, trains it and counts the bytes this rank holds (Note [what a measured rank
holds]); then it destroys the group. The collectives complete at once and move nothing, so
the values trained are meaningless, but every allocation is the one rank ``r`` of ``N``
makes: its partition, its buckets, its optimizer state, its shards. :func:`ranks_to_measure`
picks the ranks worth measuring (rank 0, the last rank and the heaviest rank of the plan), and
:func:`measure` sweeps modes, precisions and world sizes and compares each heaviest rank
with the ideal share (Note [the ideal share]).

``FakeStore`` comes from ``torch.testing._internal.distributed.fake_pg``, a private torch
module (present in torch 2.13); the ``shardopt estimate --measure`` command is its only user.
"""

from __future__ import annotations

import enum
import gc
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardopt import comm, failures
from shardopt.nn import ShardedDataParallel
from shardopt.nn.fsdp import FullyShardedDataParallel, MixedPrecision, ModuleClassPolicy
from shardopt.optim import OSS
from shardopt.partition import cut_quantum, partition_by_size, plan_split

__all__ = ["CATEGORIES", "Measured", "Mode", "RankBytes", "Workload", "fake_group_ddp_hook", "held_bytes", "measure",
           "measure_rank", "ranks_to_measure", "state_tensors"]

CATEGORIES = ("params", "grads", "masters", "optimizer")
"""What :class:`RankBytes` counts, in the order a storage is attributed (Note [what a measured rank holds])."""



class Mode(enum.Enum):
    """A data-parallel configuration, as ``shardopt bench`` names it (Note [what a measured rank holds])."""

    DDP = "ddp"
    """torch's DDP + Adam; with masters, OSS over this rank alone (fp32 masters on every rank)."""
    ZERO1 = "zero1"
    """DDP + OSS(Adam, split_large_params=False): optimizer state (and masters) owned whole per parameter."""
    ZERO2 = "zero2"
    """ShardedDataParallel + OSS(Adam, split_large_params=False): every parameter owned whole."""
    ZERO2_SPLIT = "zero2-split"
    """ShardedDataParallel + OSS(Adam, split_large_params=True): large parameters owned in row blocks."""
    ZERO3 = "zero3"
    """FullyShardedDataParallel (a unit per :attr:`Workload.unit_class` module) + Adam."""

    @property
    def sharded(self) -> tuple[str, ...]:
        """The :data:`CATEGORIES` this mode divides among ranks (the rest every rank holds whole)."""
        return _SHARDED[self]


_SHARDED = {Mode.DDP: (), Mode.ZERO1: ("masters", "optimizer"), Mode.ZERO2: ("grads", "masters", "optimizer"),
            Mode.ZERO2_SPLIT: ("grads", "masters", "optimizer"), Mode.ZERO3: CATEGORIES}


@dataclass(frozen=True)
class Workload:
    """The model a measurement trains, built afresh for every rank.

    Attributes:
        build: returns the fp32 model (called under a fixed seed; same shapes every call).
        loss: runs a forward pass of the wrapped model and returns a scalar loss.
        unit_class: each module of this class becomes one FullyShardedDataParallel unit
            (ZeRO-3); ``None``: one unit for the whole model.
    """

    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module], torch.Tensor]
    unit_class: type[nn.Module] | None = None


@dataclass(frozen=True)
class RankBytes:
    """Model-state bytes one rank holds (Note [what a measured rank holds]).

    Attributes:
        mode: the configuration measured.
        mixed: bf16 parameters with fp32 masters (``False``: fp32 throughout).
        world_size: N.
        rank: the rank measured.
        params: bytes of the model's parameters as this rank holds them.
        grads: bytes of their gradients.
        masters: bytes of tensors the optimizer steps in place of parameters (fp32 masters)
            and their gradients.
        optimizer: bytes of the optimizer's state.
    """

    mode: Mode
    mixed: bool
    world_size: int
    rank: int
    params: int
    grads: int
    masters: int
    optimizer: int

    @property
    def total(self) -> int:
        """Every counted byte."""
        return self.params + self.grads + self.masters + self.optimizer

    @property
    def sharded(self) -> int:
        """The bytes of the categories :attr:`mode` divides among ranks."""
        return sum(getattr(self, name) for name in self.mode.sharded)


# Note [what a measured rank holds]
# A rank's model states are the distinct storages (untyped_storage(), counted once, at their
# current size: a buffer freed by resizing its storage to 0 counts 0) reachable from
#   params:    the wrapper's and the unwrapped module's parameters (ZeRO-3: the flat shards),
#   grads:     their .grad,
#   masters:   the tensors in the optimizer's param_groups that are not parameters (OSS's fp32
#              masters and flat tensors over them; OSS's own optimizer is OSS.optim) and OSS's
#              masters, with their .grad,
#   optimizer: every tensor in the optimizer's state (Adam's exp_avg, exp_avg_sq and its 0-dim
#              step, 4 bytes per stepped tensor: one per flat tensor of masters),
# each storage attributed to the first category that reaches it, in that order. Not counted:
# activations, DDP's and ShardedDataParallel's bucket buffers that no .grad views, FSDP's
# gathered full parameters once freed, buffers, allocator overhead.
# When: the model trains one forward/backward/step (so the optimizer state exists), then a
# second forward/backward, and the count is taken before that second step: every gradient the
# step will use is present (ZeRO-2's reduced gradients, in fp32 master gradients with
# masters; the step then frees them). ZeRO-1 with masters folds its owned bf16 gradients into
# fp32 master gradients inside the step only (Note [master gradients] in
# shardopt.optim.masters), so for it this is the paper's count, not the step's peak. The
# second step then runs, so a failure in it still shows.
# Mixed precision: the model is cast to bf16 under OSS(master_dtype=torch.float32) (Mode.DDP:
# over a group of this rank alone, so every rank keeps every master); ZeRO-3 keeps fp32 flat
# shards and computes in bf16 (MixedPrecision(param_dtype=torch.bfloat16)).


def _storages(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def state_tensors(value: object) -> list[torch.Tensor]:
    """Every tensor in an optimizer state entry (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in state_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in state_tensors(v)]
    return []


def held_bytes(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes per category of :data:`CATEGORIES` (Note [what a measured rank holds]).

    Args:
        modules: the wrapper and the unwrapped model (their parameters are counted once).
        optimizer: the optimizer stepped (``OSS`` counts through ``OSS.optim``).

    Returns:
        ``{category: bytes}``.
    """
    inner = optimizer.optim if isinstance(optimizer, OSS) else optimizer
    params = list(dict.fromkeys(p for m in modules for p in m.parameters()))
    stepped = [p for g in inner.param_groups for p in g["params"]]
    if isinstance(optimizer, OSS):  # each master's view and gradient, stepped flat or not (Note [flat masters])
        stepped += [m for m in (optimizer.master_of(p) for p in optimizer.params) if m is not None]
    seen: set[int] = set()
    out = {"params": _storages(params, seen), "grads": _storages((p.grad for p in params), seen)}
    out["masters"] = _storages([t for p in stepped for t in (p, p.grad)], seen)
    out["optimizer"] = _storages([t for s in inner.state.values() for t in state_tensors(s)], seen)
    return out


def fake_group_ddp_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A ``DistributedDataParallel`` communication hook for torch's fake process group.

    torch's DDP cannot run a backward pass under the fake group as it comes: its reducer
    reads the all-reduce's result from the work's future, which the fake backend completes
    holding ``None`` ("expected the hook result is either a Tensor or a TensorList found
    None", torch 2.13). This hook all-reduces the bucket through
    :func:`shardopt.comm.all_reduce` (the fake group completes it at once and moves nothing)
    and returns a completed future holding the bucket itself. :func:`measure_rank` registers
    it with ``ddp.register_comm_hook(None, fake_group_ddp_hook)``.

    Args:
        state: unused (DDP's hook state).
        bucket: the gradient bucket DDP hands over.

    Returns:
        A completed future of the bucket's flat buffer.

    Raises:
        ValueError: the default process group is not a fake one (the hook would skip the
            averaging a real group needs).
    """
    if not failures.is_fake_group():
        raise ValueError("fake_group_ddp_hook is for torch's fake process group only (backend 'fake'); the "
                         f"default group is {dist.get_backend() if dist.is_initialized() else 'not initialised'}: "
                         "leave DDP's own all-reduce in place on a real group")
    buffer = bucket.buffer()
    comm.all_reduce(buffer, None, label="shardopt::ddp::all_reduce").wait()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


# DDP checks the hook's annotations as objects (inspect.signature without eval_str), and this
# module's ``from __future__ import annotations`` leaves them strings: give it the objects.
fake_group_ddp_hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


def _own_rank_group() -> comm.ProcessGroup:
    """A group of this rank alone; only this rank takes part in making it (no data moves in it)."""
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


@dataclass
class _Built:
    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer


def _oss(module: nn.Module, mixed: bool, group: comm.ProcessGroup | None, split: bool) -> OSS:
    return OSS(module.parameters(), optim=torch.optim.Adam, group=group,
               master_dtype=torch.float32 if mixed else None, lr=1e-3, split_large_params=split)


def _build(mode: Mode, workload: Workload, mixed: bool) -> _Built:
    torch.manual_seed(0)
    module = workload.build()
    if mode is Mode.ZERO3:
        policy = None if workload.unit_class is None else ModuleClassPolicy((workload.unit_class,))
        precision = MixedPrecision(param_dtype=torch.bfloat16) if mixed else None
        fsdp = FullyShardedDataParallel(module, mixed_precision=precision, auto_wrap_policy=policy)
        return _Built(fsdp, module, torch.optim.Adam(fsdp.parameters(), lr=1e-3))
    if mixed:
        module = module.to(torch.bfloat16)
    if mode in (Mode.ZERO2, Mode.ZERO2_SPLIT):
        opt = _oss(module, mixed, None, split=mode is Mode.ZERO2_SPLIT)
        return _Built(ShardedDataParallel(module, opt), module, opt)
    ddp = DDP(module)
    ddp.register_comm_hook(None, fake_group_ddp_hook)
    if mode is Mode.ZERO1:
        return _Built(ddp, module, _oss(module, mixed, None, split=False))
    if mixed:  # fp32 masters on every rank: OSS over a group of this rank alone
        return _Built(ddp, module, _oss(module, mixed, _own_rank_group(), split=False))
    return _Built(ddp, module, torch.optim.Adam(module.parameters(), lr=1e-3))


def _check(mode: Mode, world_size: int, rank: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}; give the number of ranks to "
                         "simulate, e.g. 64")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if dist.is_initialized():
        raise RuntimeError("measure_rank makes its own fake default process group, but torch.distributed is "
                           f"already initialised (backend {dist.get_backend()!r}); call it in a process without one "
                           "(the shardopt estimate command does), or destroy_process_group() first")


def measure_rank(workload: Workload, mode: Mode, mixed: bool, world_size: int, rank: int) -> RankBytes:
    """Build rank ``rank`` of ``world_size`` under torch's fake process group, train, count its bytes.

    How it works: Note [what a measured rank holds]. The default process group exists only
    during the call (created here, destroyed before returning, also on an error).

    Args:
        workload: the model and its loss.
        mode: the configuration to build.
        mixed: bf16 parameters with fp32 masters; ``False``: fp32.
        world_size: N, the ranks simulated.
        rank: which of them this process plays.

    Returns:
        The bytes this rank holds.

    Raises:
        ValueError: a world size or rank out of range.
        RuntimeError: ``torch.distributed`` is already initialised.
    """
    _check(mode, world_size, rank)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    built: _Built | None = None
    try:
        built = _build(mode, workload, mixed)
        for counted in (False, True):
            workload.loss(built.model).backward()
            if counted:
                held = held_bytes([built.model, built.module], built.optimizer)
            built.optimizer.step()
            built.optimizer.zero_grad(set_to_none=True)
        return RankBytes(mode, mixed, world_size, rank, **held)
    finally:
        if built is not None and isinstance(built.model, ShardedDataParallel):
            built.model.close()  # its gradient hooks hold it from C++, out of the cycle collector's sight
        built = None  # drop the wrappers before the group (torch 2.13: freeing DDP after it can block)
        gc.collect()
        dist.destroy_process_group()


def ranks_to_measure(mode: Mode, shapes: Sequence[Sequence[int]], world_size: int, mixed: bool) -> tuple[int, ...]:
    """Rank 0, the last rank and the heaviest rank of ``mode``'s ownership plan, ascending.

    The plan is the one OSS builds (:func:`~shardopt.partition.partition_by_size` over each
    parameter's bytes in the model's dtype; :func:`~shardopt.partition.plan_split` for
    :attr:`Mode.ZERO2_SPLIT`); DDP and ZeRO-3 hold the same on every rank but padding.

    Args:
        mode: the configuration.
        shapes: every parameter's shape, in ``parameters()`` order.
        world_size: N.
        mixed: bf16 parameters (2 bytes each) rather than fp32 (4).

    Returns:
        The distinct ranks.
    """
    ranks = {0, world_size - 1}
    width = 2 if mixed else 4
    sizes = [math.prod(s) * width for s in shapes]
    loads: Sequence[int] = ()
    if mode in (Mode.ZERO1, Mode.ZERO2):
        loads = partition_by_size(sizes, world_size).rank_bytes
    elif mode is Mode.ZERO2_SPLIT:
        rows = [s[0] if len(s) else 1 for s in shapes]
        quanta = [cut_quantum(math.prod(s) // r if r else 0) for s, r in zip(shapes, rows, strict=True)]
        loads = plan_split(sizes, rows, world_size, quanta).rank_bytes
    if loads:
        ranks.add(max(range(world_size), key=lambda r: (loads[r], -r)))
    return tuple(sorted(ranks))


# Note [the ideal share]
# A mode's ideal rank holds what one rank holds alone (the same mode measured at N = 1) with
# the categories the mode shards (Mode.sharded) divided by N: ideal_sharded = sharded(1) / N,
# ideal_total = total(1) - sharded(1) + sharded(1) / N. Measuring the reference the same way
# keeps everything the count includes (Adam's 0-dim steps, ZeRO-3's padding at N = 1 is none)
# on both sides. The heaviest measured rank over the ideal is the imbalance the plan leaves;
# The design's target is sharded bytes within 1.05x of the ideal at N = 64, 256 and 1024.


@dataclass(frozen=True)
class Measured:
    """One mode and precision at one world size: the ranks measured and the ideal share.

    Attributes:
        mode: the configuration.
        mixed: bf16 parameters with fp32 masters, else fp32.
        world_size: N.
        ranks: each measured rank's bytes, ascending by rank.
        alone: the same mode measured at N = 1 (Note [the ideal share]).
    """

    mode: Mode
    mixed: bool
    world_size: int
    ranks: tuple[RankBytes, ...]
    alone: RankBytes

    @property
    def heaviest(self) -> RankBytes:
        """The measured rank holding the most bytes (the lowest such rank)."""
        return max(self.ranks, key=lambda r: (r.total, -r.rank))

    @property
    def ideal_sharded(self) -> float:
        """The sharded bytes of a perfectly balanced rank."""
        return self.alone.sharded / self.world_size

    @property
    def ideal_total(self) -> float:
        """Every counted byte of a perfectly balanced rank."""
        return self.alone.total - self.alone.sharded + self.ideal_sharded

    @property
    def sharded_ratio(self) -> float | None:
        """Heaviest rank's sharded bytes over the ideal; ``None`` when the mode shards nothing."""
        return None if not self.mode.sharded else max(r.sharded for r in self.ranks) / self.ideal_sharded

    @property
    def total_ratio(self) -> float:
        """Heaviest rank's bytes over the ideal total."""
        return self.heaviest.total / self.ideal_total


def measure(workload: Workload, shapes: Sequence[Sequence[int]], modes: Sequence[Mode], mixed: Sequence[bool],
            world_sizes: Sequence[int], progress: Callable[[str], None] | None = None) -> list[Measured]:
    """Measure every mode at every precision and world size on the ranks :func:`ranks_to_measure` picks.

    Args:
        workload: the model and its loss.
        shapes: the model's parameter shapes, in ``parameters()`` order (for the plans).
        modes: the configurations.
        mixed: the precisions (``True``: bf16 + fp32 masters; ``False``: fp32).
        world_sizes: the N to simulate, each >= 1.
        progress: called with a line before each rank is built (e.g. a progress display).

    Returns:
        One :class:`Measured` per (mode, precision, world size), in that nesting order.

    Raises:
        ValueError: as :func:`measure_rank`, before anything is built.
    """
    for n in world_sizes:
        _check(Mode.DDP, n, 0)
    for mode in modes:
        _check(mode, 1, 0)
    out = []
    for mode in modes:
        for m in mixed:
            alone = measure_rank(workload, mode, m, 1, 0)
            for n in world_sizes:
                ranks = []
                for r in ranks_to_measure(mode, shapes, n, m):
                    if progress is not None:
                        progress(f"{mode.value} {'bf16+fp32 masters' if m else 'fp32'} N={n} rank {r}")
                    ranks.append(alone if n == 1 else measure_rank(workload, mode, m, n, r))
                out.append(Measured(mode, m, n, tuple(ranks), alone))
    return out
