"""``ShardedDataParallel``: ZeRO stage 2 on top of :class:`~shardopt.optim.OSS`.

The wrapper checks its arguments, plans which rank owns each parameter (the optimizers'
partitions) and installs one pre-hook and one post-accumulate hook per trainable parameter.
The per-step machinery lives in two objects it owns: a
:class:`~shardopt.nn.data_parallel.reduction_queue.ReductionQueue` (the buckets and the
reductions in flight, rebuilt with the hooks) and an
:class:`~shardopt.nn.data_parallel.owner_grads.OwnerGrads` (gradients held across backward
passes, ``no_sync`` sums and master gradients, kept for the wrapper's life). The hooks only
route: a gradient accumulated under ``no_sync`` goes to the owner's gradients, any other to
its bucket.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.distributed.device_mesh import DeviceMesh

from shardopt import clipping, comm
from shardopt.agreement import check_agreement, raise_if_any_failed
from shardopt.nn.data_parallel.ddp_habits import refuse_ddp_only
from shardopt.nn.data_parallel.grad_buckets import GradBucket, plan_buckets
from shardopt.nn.data_parallel.gradient_checks import check_accumulated, check_grads_are_leaves
from shardopt.nn.data_parallel.owner_grads import OwnerGrads
from shardopt.nn.data_parallel.reduction_queue import PassThroughQueue, ReductionQueue
from shardopt.nn.data_parallel.replicas import Replicas, SyncScope, layout_of, mismatch
from shardopt.nn.data_parallel.streams import streams_for
from shardopt.nn.module_checks import refuse_sparse_modules
from shardopt.optim.grad_norm import clip_for_wrapper
from shardopt.optim.masters import needs_master
from shardopt.optim.oss import OSS
from shardopt.partition import Block

__all__ = ["ShardedDataParallel"]

_MIN_BUCKET_NUMEL = 2**16  # Note [small parameters share a bucket] in grad_buckets


class ShardedDataParallel(nn.Module):
    """Data parallel with gradients reduced to, and kept only on, their owner (ZeRO-2).

    Wrap the model and give it the :class:`~shardopt.optim.OSS` optimizer(s) over its
    parameters; train as with DDP. During backward each gradient is copied into a bucket
    and freed; a full bucket is sent with one all-to-all that delivers every parameter's
    gradient to its owner only (Note [reduce to owner] in ``grad_buckets``). After backward
    a rank holds gradients for the parameters it owns and ``OSS.step`` updates and
    re-gathers them.
    With OSS master weights (``master_dtype``), a low-precision parameter's reduced gradient
    goes to its master's fp32 ``.grad`` on the owner and accumulates there (Note [reduce into
    master gradients]); under ``no_sync`` local sums are kept in fp32 (Note [no_sync sums in
    master precision], 4 bytes per parameter while accumulating).
    A parameter that OSS splits across ranks (``split_large_params``) is reduced per block:
    each owner receives the averaged gradient of its rows in ``OSS.grad_holder(param).grad``
    (its master's, or a leaf of its rows) and ``param.grad`` stays ``None`` on every rank
    (Note [split parameters in buckets] in ``grad_buckets``).
    Under a hybrid layout (``OSS(shard_size=...)``, ``device_mesh=`` or a group pair) each
    bucket is reduced to its owners inside the shard group, then the owner's part is
    all-reduced across the replicate group; :meth:`no_replicate_sync` defers that second
    stage to the end of an accumulation window (Note [hybrid reduction] in ``replicas``).

    Args:
        module: the model; all its parameters on one device type.
        sharded_optimizer: an ``OSS`` or a list of ``OSS`` over disjoint parameters that
            together cover every trainable parameter of ``module``.
        process_group: the group to reduce over (default: the optimizers' group), or a hybrid
            layout's pair ``(shard_group, replicate_group)``: the layout is the optimizers'
            (``OSS.layout``; Note [hybrid reduction] in ``replicas``), and a pair,
            ``device_mesh`` or ``shard_size`` given here is only checked against it.
        broadcast_buffers: copy rank 0's buffers to all ranks at every training forward.
        sync_models_at_startup: copy rank 0's parameters and buffers to all ranks now.
        reduce_buffer_size: gradient elements per bucket; 0 puts every parameter in a
            bucket of its own.
        auto_refresh_trainable: re-partition when parameters are frozen/unfrozen.
        reduce_fp16: send fp32 gradients as fp16 (half the bytes).
        warn_on_trainable_params_changed: warn (once per change) when trainability changes.
        reduce_dtype: send fp32 gradients in this dtype instead (e.g. ``torch.bfloat16``);
            overrides ``reduce_fp16``. With master weights, also the dtype the
            low-precision gradients travel in: default the optimizers' ``master_dtype``
            (fp32, exact), ``torch.bfloat16`` for half the bytes.
        device_mesh: the optimizers' layout as a mesh (checked; see ``process_group``).
        shard_size: the optimizers' layout as S (checked; see ``process_group``).

    Raises:
        TypeError: ``sharded_optimizer`` is not an OSS or a list of OSS, or a trainable
            embedding produces sparse gradients (``sparse=True``).
        ValueError: parameters span device types, optimizers overlap or do not cover the
            module's trainable parameters, an optimizer's group differs from
            ``process_group``, a layout given here differs from the optimizers' (on every rank),
            the optimizers have different layouts or ``master_dtype``, a negative
            ``reduce_buffer_size``, or a ``reduce_dtype`` that is not a floating dtype.
    """

    def __init__(
        self,
        module: nn.Module,
        sharded_optimizer: OSS | list[OSS],
        process_group: comm.ProcessGroup | tuple[comm.ProcessGroup, comm.ProcessGroup] | None = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int = 2**23,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
        reduce_dtype: torch.dtype | None = None,
        *,
        device_mesh: DeviceMesh | None = None,
        shard_size: int | None = None,
    ) -> None:
        super().__init__()
        optimizers = sharded_optimizer if isinstance(sharded_optimizer, (list, tuple)) else [sharded_optimizer]
        bad = [o for o in optimizers if not isinstance(o, OSS)]
        if bad or not optimizers:
            raise TypeError(
                f"sharded_optimizer must be a shardopt.optim.OSS or a non-empty list of them, got "
                f"{type(bad[0]).__name__ if bad else 'an empty list'}; build it as "
                "OSS(model.parameters(), optim=torch.optim.Adam, lr=...)"
            )
        if reduce_buffer_size < 0:
            raise ValueError(f"reduce_buffer_size must be >= 0 elements (0: no bucketing), got {reduce_buffer_size}")
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating dtype such as torch.bfloat16, got {reduce_dtype}")
        device_types = {p.device.type for p in module.parameters()}
        if len(device_types) > 1:
            raise ValueError(
                f"module has parameters on several device types {sorted(device_types)}; "
                "ShardedDataParallel needs them on one: move the model with module.to(device) first"
            )
        meta = [n for n, p in module.named_parameters() if p.is_meta]
        if meta:
            raise ValueError(
                f"module parameter {meta[0]!r} is on the meta device: ShardedDataParallel needs real values; "
                "materialise the model first (module.to_empty(device=...) and re-initialise it)"
            )
        self.module = module
        self.sharded_optimizers: list[OSS] = list(optimizers)
        self.layout = layout_of(self.sharded_optimizers)  # Note [hybrid reduction] in replicas
        names_layout = isinstance(process_group, (tuple, list)) or device_mesh is not None
        self.process_group: comm.ProcessGroup | None = optimizers[0].group
        if not (process_group is None or isinstance(process_group, (tuple, list)) or device_mesh is not None):
            self.process_group = process_group
        self._world_group = None if self.layout else self.process_group  # what every rank agrees and syncs over
        self.world_size = comm.group_size(self.process_group)
        self.rank = comm.group_rank(self.process_group)
        for opt in optimizers:
            if (comm.group_size(opt.group), comm.group_rank(opt.group)) != (self.world_size, self.rank):
                raise ValueError(
                    f"process_group has {self.world_size} ranks (this process is rank {self.rank}) but a sharded "
                    f"optimizer's group has {comm.group_size(opt.group)} (rank {comm.group_rank(opt.group)}): "
                    "ownership is planned over the optimizer's group; pass the same group to OSS(group=...) and "
                    "ShardedDataParallel(process_group=...), or leave process_group=None to use the optimizer's"
                )
        self.broadcast_buffers = broadcast_buffers
        self.reduce_buffer_size = reduce_buffer_size
        self.auto_refresh_trainable = auto_refresh_trainable
        self.warn_on_trainable_params_changed = warn_on_trainable_params_changed
        master_dtypes = sorted({str(o.master_dtype) for o in optimizers})
        if len(master_dtypes) > 1:
            raise ValueError(f"the sharded optimizers have different master_dtype ({', '.join(master_dtypes)}); "
                             "gradients of one dtype are reduced alike: give every OSS the same master_dtype")
        self._wire_dtypes: dict[torch.dtype, torch.dtype] = {}
        if reduce_dtype is not None or reduce_fp16:
            self._wire_dtypes[torch.float32] = reduce_dtype or torch.float16
        master = optimizers[0].master_dtype  # Note [reduce into master gradients] in grad_buckets
        self._grad_dtypes = {p.dtype: master for p in module.parameters() if master and needs_master(p.dtype, master)}
        self._wire_dtypes.update({d: reduce_dtype or m for d, m in self._grad_dtypes.items()})
        self._grads = OwnerGrads(self._grad_dtypes, self.rank, self._name_of)
        self._queue: ReductionQueue | PassThroughQueue = ReductionQueue(
            [], self.process_group, self.rank, self.world_size, self._grads.receive)
        self._scope = SyncScope.ALL
        self._hook_handles: list[Any] = []
        self._accumulators: list[Any] = []
        self._closed = False
        # Note [agree before the first collective] in shardopt.agreement
        check_agreement("ShardedDataParallel", [
            ("reduce_buffer_size", reduce_buffer_size),
            ("reduce dtype", {str(k): str(v) for k, v in self._wire_dtypes.items()}),
            ("master dtype", {str(k): str(v) for k, v in self._grad_dtypes.items()}),
            ("broadcast_buffers", broadcast_buffers), ("sync_models_at_startup", sync_models_at_startup),
            ("layout", self.layout.fingerprint() if self.layout else None),
            ("layout arguments", (isinstance(process_group, (tuple, list)), device_mesh is not None, shard_size)),
            ("parameters", [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]),
            ("buffers", [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]),
        ], self._world_group, "pass the same model and ShardedDataParallel arguments on every rank")
        if names_layout or shard_size is not None:  # every rank got here (agreed above): all raise together
            wrong = mismatch(self.layout, process_group, device_mesh, shard_size, comm.group_size(None))
            raise_if_any_failed("ShardedDataParallel", None if wrong is None else ValueError(wrong), self._world_group)
        if sync_models_at_startup:
            comm.wait_all([comm.broadcast(t.data, 0, self._world_group, label="shardopt::sdp::startup_sync")
                           for t in list(module.parameters()) + list(module.buffers())])
        self._setup()
        _expose_forward_signature(self)
        if self.world_size > 1:  # Note [clipping that bypasses the wrapper] in shardopt.clipping
            clipping.register_sharded(self, module.parameters(), "OSS.clip_grad_norm", clip_for_wrapper)

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        """(Re)build the bucket plan and the hooks from the current trainable parameters."""
        self._remove_hooks()
        owners, optim_of = _plan_ownership(self.sharded_optimizers, self._name_of)
        self._grads.plan(optim_of)
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        refuse_sparse_modules(self.module, "ShardedDataParallel")
        missing = [tuple(p.shape) for p in trainable if p not in owners]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameter(s) of the module (first of shape {missing[0]}) are not "
                "in any sharded optimizer; build OSS over all of them: OSS(model.parameters(), ...)"
            )
        position = {p: j for j, p in enumerate(trainable)}  # Note [split parameters in buckets] in grad_buckets
        split = {position[p]: tuple(Block(position[p], b.row_start, b.row_stop, b.owner) for b in owners[p])
                 for p in trainable if len(owners[p]) > 1}
        specs = plan_buckets(trainable, [owners[p][0].owner for p in trainable], self.world_size,
                             self.reduce_buffer_size or _MIN_BUCKET_NUMEL, self._wire_dtypes, self._grad_dtypes, split)
        if self.world_size == 1 and self.layout is None:  # Note [one rank passes gradients through] in reduction_queue
            self._queue = PassThroughQueue(trainable, self._wire_dtypes, self._grad_dtypes, self._grads.receive)
        else:
            device = trainable[0].device if trainable else torch.device("cpu")
            replicas = None if self.layout is None else Replicas(self.layout.replicate_group, self.layout.world_size)
            self._queue = ReductionQueue(specs, self.process_group, self.rank, self.world_size, self._grads.receive,
                                         streams_for(device, self.process_group), replicas)
        # The engine holds AccumulateGrad nodes weakly: keep them, or the hooks die with them.
        self._accumulators = [get_gradient_edge(p).node for p in trainable]
        for p, accumulator in zip(trainable, self._accumulators, strict=True):
            # Note [owner's gradient across backward passes] in owner_grads
            self._hook_handles.append(accumulator.register_prehook(functools.partial(self._grads.before_accumulate, p)))
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._post_accumulate))
        self._trainable_sig = _trainable_signature(self.module)

    def _remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def refresh_trainable(self) -> None:
        """Re-partition the optimizers and rebuild buckets after (un)freezing. All ranks."""
        self._check_open("refresh_trainable()")
        if self._queue.busy:
            raise RuntimeError(
                f"[rank {self.rank}] refresh_trainable() was called while gradients are being reduced; "
                "call it between iterations (after optimizer.step())"
            )
        if isinstance(self._queue, ReductionQueue) and self._queue.has_deferred:
            raise RuntimeError(
                f"[rank {self.rank}] refresh_trainable() (or freezing/unfreezing parameters) inside a "
                "no_replicate_sync() window: re-planning would drop the in-group sums waiting for the all-reduce "
                "across replicas; finish the window first (a backward outside no_replicate_sync() or reduce()), "
                "then change trainability between iterations"
            )
        for opt in self.sharded_optimizers:
            opt.refresh_trainable()
        self._grads.forget()
        self._setup()

    def _check_trainability(self) -> None:
        if _trainable_signature(self.module) == self._trainable_sig:
            return
        if self.warn_on_trainable_params_changed:
            warnings.warn(
                "ShardedDataParallel: the set of trainable parameters changed"
                + ("; re-partitioning" if self.auto_refresh_trainable else
                   "; call refresh_trainable() on every rank (auto_refresh_trainable is off)"),
                UserWarning,
                stacklevel=3,
            )
        if self.auto_refresh_trainable:
            self.refresh_trainable()
        else:
            self._trainable_sig = _trainable_signature(self.module)  # warn once per change

    # ------------------------------------------------------------------ forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (refreshing trainability and syncing buffers first).

        Raises:
            RuntimeError: the wrapper was closed (:meth:`close`) and the module is training.
        """
        if self.module.training:
            self._check_open("a training forward")
            self._check_trainability()
            check_grads_are_leaves(self.module, self._name_of)
            if self.broadcast_buffers:
                self.sync_buffers(blocking=True)
        return self.module(*inputs, **kwargs)

    def close(self) -> None:
        """Detach from the module: remove every gradient hook this wrapper registered.

        Afterwards ``self.module`` is a plain module again, whose gradients stay local as
        without the wrapper; an owner's reduced gradient set aside during a ``no_sync``
        backward is added back into its ``.grad``; the in-group sums of an unfinished
        ``no_replicate_sync`` window are dropped (they were never reduced across replicas). Idempotent and local (no collective).
        The wrapper is also a context manager that closes on exit.

        Raises:
            RuntimeError: gradients are being reduced (called inside a backward pass).
        """
        if self._queue.busy:
            raise RuntimeError(
                f"[rank {self.rank}] close() was called while gradients are being reduced; "
                "call it between iterations (after optimizer.step())"
            )
        clipping.unregister(self, self.module.parameters())
        self._remove_hooks()
        self._accumulators = []
        self._grads.restore()
        if isinstance(self._queue, ReductionQueue):
            self._queue.drop_deferred()
        self._closed = True

    def __enter__(self) -> ShardedDataParallel:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"[rank {self.rank}] {what} on a closed ShardedDataParallel: its gradient hooks were removed by "
                "close(), so gradients would not be reduced; train the module through a new ShardedDataParallel"
            )

    # DDP's read-only surface, for code written against DistributedDataParallel.
    @property
    def device_type(self) -> str:
        """The device type of the parameters (``"cpu"`` or ``"cuda"``), as DDP's."""
        return next(self.module.parameters()).device.type

    @property
    def is_multi_device_module(self) -> bool:
        """Always False: every parameter lives on one device type (checked at construction)."""
        return False

    @property
    def device_ids(self) -> list[int] | None:
        """As DDP's: the single CUDA device of the module, or ``None`` on CPU."""
        device = next(self.module.parameters()).device
        return [device.index] if device.type == "cuda" and device.index is not None else None

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the next backward reduces gradients (False inside :meth:`no_sync`); settable as
        DDP's (Note [DDP attributes on ShardedDataParallel] in ``ddp_habits``)."""
        return self._scope is not SyncScope.NONE

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._scope = SyncScope.ALL if value else SyncScope.NONE

    def __setattr__(self, name: str, value: Any) -> None:
        refuse_ddp_only(name, setting=True)  # Note [DDP attributes on ShardedDataParallel]
        super().__setattr__(name, value)

    @property
    def reduction_buckets(self) -> tuple[GradBucket, ...]:
        """The gradient buckets, in launch order, for inspection (do not fill or send them):
        each one's ``spec`` is its planned layout, its ``state`` and ``holds_buffers`` say
        where it is in the current iteration."""
        return tuple(self._queue.buckets)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if not hasattr(self.module, name):
                refuse_ddp_only(name, setting=False)
            return getattr(self.module, name)

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate gradients locally; the first backward outside the context reduces them."""
        previous = self._scope
        self._scope = SyncScope.NONE
        try:
            yield
        finally:
            self._scope = previous

    @contextlib.contextmanager
    def no_replicate_sync(self) -> Generator[None, None, None]:
        """Under a hybrid layout: reduce inside the shard group at every backward, but defer
        the all-reduce across replicas to the first backward outside the context (or
        :meth:`reduce`), which runs it once over the window's summed in-group gradients (Note
        [hybrid reduction] in ``replicas``; FSDP2's ``set_requires_all_reduce(False)``).

        Raises:
            RuntimeError: the wrapper has no hybrid layout (flat: use :meth:`no_sync`).
        """
        if self.layout is None:
            raise RuntimeError(
                f"[rank {self.rank}] no_replicate_sync() needs a hybrid layout, but this ShardedDataParallel is flat "
                "(one group, no replicas): use no_sync() to skip the reduction, or build OSS with shard_size=, "
                "device_mesh= or group=(shard_group, replicate_group)")
        previous = self._scope
        self._scope = SyncScope.SHARD_GROUP if previous is SyncScope.ALL else previous
        try:
            yield
        finally:
            self._scope = previous

    def check_optimizer_step(self) -> None:
        """Called by ``OSS.step`` before it steps: refuse a step inside an unfinished
        ``no_replicate_sync`` window, whose in-group sums have not crossed the replicas yet
        (each replica would step on its own part and the replicas would drift apart).

        Raises:
            RuntimeError: naming the window and how to finish it.
        """
        if isinstance(self._queue, ReductionQueue) and self._queue.has_deferred:
            raise RuntimeError(
                f"[rank {self.rank}] OSS.step() inside an unfinished no_replicate_sync() window: its in-group "
                "gradient sums have not been all-reduced across replicas, so the replicas would step on different "
                "gradients; finish the window first (a backward outside no_replicate_sync(), or "
                "ShardedDataParallel.reduce()), then step")

    # ------------------------------------------------------------------ hooks

    def _post_accumulate(self, param: torch.Tensor) -> None:
        assert isinstance(param, nn.Parameter)
        check_accumulated(param, self._name_of)
        if self._scope is SyncScope.NONE:
            self._grads.keep_local(param)
            return
        self._queue.replicate = self._scope is SyncScope.ALL
        if self._queue.is_sent_or_holds(param):  # Note [reentrant checkpoints] in reduction_queue
            raise ValueError(
                f"parameter {self._name_of(param)!r} got a second gradient in one backward pass after its "
                "first was queued for reduction. This happens when it is used in several reentrant activation "
                "checkpoints (torch.utils.checkpoint(..., use_reentrant=True)), whose nested backward passes "
                "each accumulate into it: use use_reentrant=False"
            )
        self._queue.queue_callback(self._flush)
        self._queue.add(param, self._grads.take_for_bucket(param))

    def _name_of(self, param: torch.Tensor) -> str:
        return next((n for n, p in self.module.named_parameters() if p is param), "<not in module>")

    def _flush(self) -> None:
        """Send every bucket not yet sent (gradients accumulated under no_sync included)."""
        self._queue.flush(self._grads.take_pending)
        self._grads.end_flush()

    def reduce(self) -> None:
        """Reduce the gradients accumulated locally (under :meth:`no_sync`) now. All ranks.

        Use it to finish an accumulation done entirely inside ``no_sync()``, or inside
        ``no_replicate_sync()`` (then it runs the deferred all-reduce across replicas).

        Raises:
            RuntimeError: there are no locally accumulated gradients to reduce.
        """
        deferred = isinstance(self._queue, ReductionQueue) and self._queue.has_deferred
        if not self._grads.has_local and not deferred:
            raise RuntimeError(
                f"[rank {self.rank}] ShardedDataParallel.reduce(): nothing to reduce; backward passes "
                "outside no_sync() reduce their gradients themselves. Call reduce() after backward passes "
                "run under no_sync() or no_replicate_sync()"
            )
        self._queue.replicate = True  # reduce() ends the accumulation window
        if self._grads.has_local:
            self._flush()
        elif isinstance(self._queue, ReductionQueue):
            self._queue.reduce_deferred()

    # ------------------------------------------------------------------ state

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero (or drop) the gradients of every parameter, and anything set aside: masters'
        gradients and ``no_sync`` sums too (``module.zero_grad()`` reaches neither).

        Args:
            set_to_none: drop the gradients instead of zeroing them (default ``False``, as
                fairscale's; either is safe, see Note [owner's gradient across backward
                passes] in ``owner_grads``).
        """
        self.module.zero_grad(set_to_none=set_to_none)
        self._grads.zero()
        if isinstance(self._queue, ReductionQueue):
            self._queue.drop_deferred()  # Note [hybrid reduction] in replicas

    def sync_buffers(self, blocking: bool = False) -> list[comm.PendingWork]:
        """Copy rank 0's buffers to every rank.

        Args:
            blocking: wait for the copies before returning.

        Returns:
            The pending copies (already completed when ``blocking``).
        """
        pending = [comm.broadcast(b.data, 0, self._world_group, label="shardopt::sdp::buffers")
                   for b in self.module.buffers()]
        if blocking:
            comm.wait_all(pending)
        return pending

    def to(  # type: ignore[override]
        self,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> ShardedDataParallel:
        """Move the wrapped module, then rebuild the optimizers' plans and the buckets. All ranks.

        Args:
            device: the target device.
            dtype: the target floating dtype.
            non_blocking: as for ``torch.nn.Module.to``.

        Returns:
            ``self``.
        """
        self.module.to(device=device, dtype=dtype, non_blocking=non_blocking)
        self.refresh_trainable()
        return self


def _trainable_signature(module: nn.Module) -> tuple[bool, ...]:
    return tuple(p.requires_grad for p in module.parameters())


def _plan_ownership(optimizers: list[OSS], name_of: Callable[[torch.Tensor], str]
                    ) -> tuple[dict[torch.Tensor, tuple[Block, ...]], dict[torch.Tensor, OSS]]:
    """The owned blocks (one, whole, unless the parameter is split across ranks) and the
    optimizer of every parameter the optimizers hold.

    Raises:
        ValueError: a parameter is listed twice in one optimizer, or in two of them.
    """
    owners: dict[torch.Tensor, tuple[Block, ...]] = {}
    optim_of: dict[torch.Tensor, OSS] = {}
    source: dict[torch.Tensor, int] = {}
    for k, opt in enumerate(optimizers):
        blocks: dict[int, tuple[Block, ...]] = {}
        for block in opt.plan.blocks:
            blocks[block.param] = (*blocks.get(block.param, ()), block)
        for i, p in enumerate(opt.params):
            if p in owners:
                what = f"parameter {name_of(p)!r} of shape {tuple(p.shape)}"
                if source[p] == k:
                    raise ValueError(
                        f"{what} is listed twice in sharded optimizer {k}: shared weights (such as a tied "
                        "embedding and LM head) are one parameter; build the OSS over model.parameters(), "
                        "which lists each parameter once"
                    )
                raise ValueError(f"{what} is in two of the sharded optimizers ({source[p]} and {k}); "
                                 "give each parameter to exactly one OSS")
            owners[p] = blocks[i]
            source[p] = k
            optim_of[p] = opt
    return owners, optim_of


def _expose_forward_signature(wrapper: ShardedDataParallel) -> None:
    """Let ``inspect.signature(wrapper.forward)`` show the wrapped module's forward (the
    Hugging Face Trainer drops dataset columns the forward does not name)."""

    def forward(*inputs: Any, **kwargs: Any) -> Any:
        return ShardedDataParallel.forward(wrapper, *inputs, **kwargs)

    functools.update_wrapper(forward, wrapper.module.forward)
    wrapper.__dict__["forward"] = forward
