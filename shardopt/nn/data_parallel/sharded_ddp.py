"""``ShardedDataParallel``: ZeRO stage 2 on top of :class:`~shardopt.optim.OSS`."""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections import deque
from collections.abc import Generator
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from shardopt import clipping, comm
from shardopt.agreement import check_agreement
from shardopt.nn.data_parallel.ddp_habits import refuse_ddp_only
from shardopt.nn.data_parallel.grad_buckets import GradBucket, plan_buckets
from shardopt.nn.data_parallel.gradient_checks import check_accumulated, refuse_sparse_modules
from shardopt.nn.data_parallel.local_sums import LocalSums
from shardopt.optim.grad_norm import clip_for_wrapper
from shardopt.optim.masters import needs_master
from shardopt.optim.oss import OSS

__all__ = ["ShardedDataParallel"]

# Note [reductions in flight]
# Reductions stay in flight until their bytes pass two default buckets' worth (2 x 2**23
# fp32 elements); then the oldest is waited for. With default buckets that is two in
# flight, as before. Without buckets (reduce_buffer_size=0: one all-to-all per parameter,
# fairscale's benchmark setting) a count of two serialised hundreds of tiny transfers, and
# a step of a model of 150 small parameters took 1.46x fairscale's (scripts/bench_bucketless.py,
# 2 ranks); a byte budget keeps as many small ones in flight as large ones would use memory.
_MAX_BYTES_IN_FLIGHT = 2 * 2**23 * 4

_MIN_BUCKET_NUMEL = 2**16  # Note [small parameters share a bucket] in grad_buckets

# Note [owner's gradient across backward passes]
# After a reduction the owner's ``.grad`` holds the *averaged* gradient; no other rank has
# one. A later backward (gradient accumulation without no_sync) would add this rank's
# *local* gradient on top, and reducing that sum would divide the earlier average by N
# again (the other ranks have nothing to add to it). So just before autograd accumulates
# into a parameter, a ``.grad`` that is still the tensor we wrote (same object, whatever was
# done to it in place: zeroed by zero_grad, unscaled by a scaler, clipped) is moved aside;
# autograd then accumulates only local gradients, the bucket sends only those, and the
# owner adds the new reduced gradient to what it set aside. Zeros set aside add exactly;
# a ``.grad`` set to None has nothing to set aside. Hence any zero_grad, on any object, at
# any time, is safe, and an in-place edit of the reduced gradient is kept, as with DDP.
# A ``.grad`` *replaced* by a new tensor is not ours and counts as a local gradient, as DDP
# counts every ``.grad``: replace the owner's reduced gradient only before a step, not
# before more backward passes.
# The set-aside runs as a pre-hook of the parameter's AccumulateGrad node, which runs only
# when a gradient is really accumulated. A tensor hook (``param.register_hook``) would also
# fire for ``torch.autograd.grad(loss, params)``, which never touches ``.grad``: the owner's
# reduced gradient would vanish into the set-aside table and the step would skip it.

# Note [reentrant checkpoints]
# A reentrant activation checkpoint runs a nested backward, with its own end-of-backward
# callbacks. The flush is queued on the backward in which the first gradient of an
# iteration arrives. If that is a nested one, every bucket is sent when it ends and the
# rest of the outer backward is reduced in a second round: correct (the owner adds the
# rounds, Note [owner's gradient across backward passes]) but with twice the bytes. A
# parameter used in several reentrant checkpoints after the flush was queued on the outer
# backward gets one gradient per nested backward within one round, after its bucket may
# have been sent: that is refused with a ValueError naming it, rather than reduced wrongly.
# Non-reentrant checkpoints (use_reentrant=False) have neither problem.


class ShardedDataParallel(nn.Module):
    """Data parallel with gradients reduced to, and kept only on, their owner (ZeRO-2).

    Wrap the model and give it the :class:`~shardopt.optim.OSS` optimizer(s) over its
    parameters; train as with DDP. During backward each gradient is copied into a bucket
    and freed; a full bucket is sent with one all-to-all that delivers every parameter's
    gradient to its owner only (Note [reduce to owner]). After backward a rank holds
    gradients for the parameters it owns and ``OSS.step`` updates and re-gathers them.
    With OSS master weights (``master_dtype``), a low-precision parameter's reduced gradient
    goes to its master's fp32 ``.grad`` on the owner and accumulates there (Note [reduce into
    master gradients]); under ``no_sync`` local sums are kept in fp32 (Note [no_sync sums in
    master precision], 4 bytes per parameter while accumulating).

    Args:
        module: the model; all its parameters on one device type.
        sharded_optimizer: an ``OSS`` or a list of ``OSS`` over disjoint parameters that
            together cover every trainable parameter of ``module``.
        process_group: the group to reduce over (default: the optimizers' group).
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

    Raises:
        TypeError: ``sharded_optimizer`` is not an OSS or a list of OSS, or a trainable
            embedding produces sparse gradients (``sparse=True``).
        ValueError: parameters span device types, optimizers overlap or do not cover the
            module's trainable parameters, an optimizer's group differs from
            ``process_group``, the optimizers have different ``master_dtype``, a negative
            ``reduce_buffer_size``, or a ``reduce_dtype`` that is not a floating dtype.
    """

    def __init__(
        self,
        module: nn.Module,
        sharded_optimizer: OSS | list[OSS],
        process_group: comm.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        sync_models_at_startup: bool = True,
        reduce_buffer_size: int = 2**23,
        auto_refresh_trainable: bool = True,
        reduce_fp16: bool = False,
        warn_on_trainable_params_changed: bool = True,
        reduce_dtype: torch.dtype | None = None,
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
        self.process_group = process_group if process_group is not None else optimizers[0].group
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
        master = optimizers[0].master_dtype  # Note [reduce into master gradients]
        self._grad_dtypes = {p.dtype: master for p in module.parameters() if master and needs_master(p.dtype, master)}
        self._wire_dtypes.update({d: reduce_dtype or m for d, m in self._grad_dtypes.items()})
        self._local_sums = LocalSums(self._grad_dtypes)
        self._should_sync = True
        self._hook_handles: list[Any] = []
        self._accumulators: list[Any] = []
        self._buckets: list[GradBucket] = []
        self._bucket_of: dict[nn.Parameter, GradBucket] = {}
        self._next_launch = 0
        self._in_flight: deque[tuple[GradBucket, comm.PendingWork, list[torch.Tensor]]] = deque()
        self._bytes_in_flight = 0
        self._callback_queued = False
        self._set_aside: dict[nn.Parameter, torch.Tensor] = {}
        self._written: dict[nn.Parameter, weakref.ref[torch.Tensor]] = {}
        self._local_pending: set[nn.Parameter] = set()
        self._closed = False
        # Note [agree before the first collective] in shardopt.agreement
        check_agreement("ShardedDataParallel", [
            ("reduce_buffer_size", reduce_buffer_size),
            ("reduce dtype", {str(k): str(v) for k, v in self._wire_dtypes.items()}),
            ("master dtype", {str(k): str(v) for k, v in self._grad_dtypes.items()}),
            ("broadcast_buffers", broadcast_buffers), ("sync_models_at_startup", sync_models_at_startup),
            ("parameters", [(n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()]),
            ("buffers", [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers()]),
        ], self.process_group, "pass the same model and ShardedDataParallel arguments on every rank")
        if sync_models_at_startup:
            self._sync_params_and_buffers()
        self._setup()
        self._expose_forward_signature()
        if self.world_size > 1:  # Note [clipping that bypasses the wrapper] in shardopt.clipping
            clipping.register_sharded(self, module.parameters(), "OSS.clip_grad_norm", clip_for_wrapper)

    # ------------------------------------------------------------------ setup

    def _trainable_signature(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.module.parameters())

    def _owners(self) -> dict[torch.Tensor, int]:
        owners: dict[torch.Tensor, int] = {}
        self._optim_of: dict[torch.Tensor, OSS] = {}
        source: dict[torch.Tensor, int] = {}
        for k, opt in enumerate(self.sharded_optimizers):
            for i, p in enumerate(opt.params):
                if p in owners:
                    what = f"parameter {self._name_of(p)!r} of shape {tuple(p.shape)}"
                    if source[p] == k:
                        raise ValueError(
                            f"{what} is listed twice in sharded optimizer {k}: shared weights (such as a tied "
                            "embedding and LM head) are one parameter; build the OSS over model.parameters(), "
                            "which lists each parameter once"
                        )
                    raise ValueError(f"{what} is in two of the sharded optimizers ({source[p]} and {k}); "
                                     "give each parameter to exactly one OSS")
                owners[p] = opt.partition.owners[i]
                source[p] = k
                self._optim_of[p] = opt
        return owners

    def _setup(self) -> None:
        """(Re)build the bucket plan and the hooks from the current trainable parameters."""
        self._remove_hooks()
        owners = self._owners()
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        refuse_sparse_modules(self.module, "ShardedDataParallel")
        missing = [tuple(p.shape) for p in trainable if p not in owners]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameter(s) of the module (first of shape {missing[0]}) are not "
                "in any sharded optimizer; build OSS over all of them: OSS(model.parameters(), ...)"
            )
        specs = plan_buckets(trainable, [owners[p] for p in trainable], self.world_size,
                             self.reduce_buffer_size or _MIN_BUCKET_NUMEL, self._wire_dtypes, self._grad_dtypes)
        self._buckets = [GradBucket(spec, self.rank, 1.0 / self.world_size) for spec in specs]
        self._bucket_of = {p: b for b in self._buckets for p in b.spec.params}
        # The engine holds AccumulateGrad nodes weakly: keep them, or the hooks die with them.
        self._accumulators = [get_gradient_edge(p).node for p in trainable]
        for p, accumulator in zip(trainable, self._accumulators):
            self._hook_handles.append(accumulator.register_prehook(self._make_pre_hook(p)))
            self._hook_handles.append(p.register_post_accumulate_grad_hook(self._post_accumulate))
        self._trainable_sig = self._trainable_signature()
        self._reset_iteration()

    def _remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def refresh_trainable(self) -> None:
        """Re-partition the optimizers and rebuild buckets after (un)freezing. All ranks."""
        self._check_open("refresh_trainable()")
        if self._in_flight or self._next_launch:
            raise RuntimeError(
                f"[rank {self.rank}] refresh_trainable() was called while gradients are being reduced; "
                "call it between iterations (after optimizer.step())"
            )
        for opt in self.sharded_optimizers:
            opt.refresh_trainable()
        self._set_aside.clear()
        self._written.clear()
        self._local_sums.clear()
        self._setup()

    def _check_trainability(self) -> None:
        if self._trainable_signature() == self._trainable_sig:
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
            self._trainable_sig = self._trainable_signature()  # warn once per change

    # ------------------------------------------------------------------ forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (refreshing trainability and syncing buffers first).

        Raises:
            RuntimeError: the wrapper was closed (:meth:`close`) and the module is training.
        """
        if self.module.training:
            self._check_open("a training forward")
            self._check_trainability()
            self._check_grads_are_leaves()
            if self.broadcast_buffers:
                self.sync_buffers(blocking=True)
        return self.module(*inputs, **kwargs)

    def close(self) -> None:
        """Detach from the module: remove every gradient hook this wrapper registered.

        Afterwards ``self.module`` is a plain module again, whose gradients stay local as
        without the wrapper; an owner's reduced gradient set aside during a ``no_sync``
        backward is added back into its ``.grad``. Idempotent and local (no collective).
        The wrapper is also a context manager that closes on exit.

        Raises:
            RuntimeError: gradients are being reduced (called inside a backward pass).
        """
        if self._in_flight or self._next_launch:
            raise RuntimeError(
                f"[rank {self.rank}] close() was called while gradients are being reduced; "
                "call it between iterations (after optimizer.step())"
            )
        clipping.unregister(self, self.module.parameters())
        self._remove_hooks()
        self._accumulators = []
        for param, kept in self._set_aside.items():  # Note [owner's gradient across backward passes]
            param.grad = kept if param.grad is None else kept.add_(param.grad)
        self._set_aside.clear()
        for p, total in self._local_sums.items():  # no_sync sums back into .grad (rounded)
            p.grad = total.to(p.dtype) if p.grad is None else p.grad.add_(total)
        self._local_sums.clear()
        self._written.clear()
        self._closed = True

    def __enter__(self) -> ShardedDataParallel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"[rank {self.rank}] {what} on a closed ShardedDataParallel: its gradient hooks were removed by "
                "close(), so gradients would not be reduced; train the module through a new ShardedDataParallel"
            )

    def _expose_forward_signature(self) -> None:
        """Let ``inspect.signature(wrapper.forward)`` show the wrapped module's forward (the
        Hugging Face Trainer drops dataset columns the forward does not name)."""
        wrapper = self

        def forward(*inputs: Any, **kwargs: Any) -> Any:
            return ShardedDataParallel.forward(wrapper, *inputs, **kwargs)

        functools.update_wrapper(forward, self.module.forward)
        self.__dict__["forward"] = forward

    def _check_grads_are_leaves(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None and p.grad.requires_grad:
                raise RuntimeError(
                    f"parameter {self._name_of(p)!r} holds a gradient that requires grad (left by "
                    "backward(create_graph=True) or autograd.grad into .grad); ShardedDataParallel reduces plain "
                    "gradients only: call optimizer.zero_grad(set_to_none=True) or detach the gradient first"
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
        return self._should_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._should_sync = bool(value)

    def __setattr__(self, name: str, value: Any) -> None:
        refuse_ddp_only(name, setting=True)  # Note [DDP attributes on ShardedDataParallel]
        super().__setattr__(name, value)

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
        previous = self._should_sync
        self._should_sync = False
        try:
            yield
        finally:
            self._should_sync = previous

    # ------------------------------------------------------------------ hooks

    def _make_pre_hook(self, param: nn.Parameter) -> Any:
        def set_aside_reduced_grad(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            # See Note [owner's gradient across backward passes].
            if param.dtype in self._grad_dtypes:
                self._local_sums.settle(param, self._master_of(param))
            written = self._written.pop(param, None)
            if written is not None and param.grad is not None and written() is param.grad:
                self._set_aside[param] = param.grad
                param.grad = None
            return None

        return set_aside_reduced_grad

    def _post_accumulate(self, param: torch.Tensor) -> None:
        assert isinstance(param, nn.Parameter)
        check_accumulated(param, self._name_of)
        if not self._should_sync:
            self._local_pending.add(param)
            self._local_sums.keep(param)  # Note [no_sync sums in master precision]
            self._local_sums.leave(param, self._master_of(param))
            return
        bucket = self._bucket_of[param]
        if bucket.spec.index < self._next_launch or bucket.holds(param):  # Note [reentrant checkpoints]
            raise ValueError(
                f"parameter {self._name_of(param)!r} got a second gradient in one backward pass after its "
                "first was queued for reduction. This happens when it is used in several reentrant activation "
                "checkpoints (torch.utils.checkpoint(..., use_reentrant=True)), whose nested backward passes "
                "each accumulate into it: use use_reentrant=False"
            )
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        grad = self._local_sums.take(param, param.grad)
        assert grad is not None
        bucket.add(param, grad)
        param.grad = None
        self._local_pending.discard(param)
        self._launch_ready()

    def _name_of(self, param: torch.Tensor) -> str:
        return next((n for n, p in self.module.named_parameters() if p is param), "<not in module>")

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].complete:
            self._launch(self._buckets[self._next_launch])

    def _launch(self, bucket: GradBucket) -> None:
        pending, recv = bucket.launch(self.process_group, self.world_size)
        self._in_flight.append((bucket, pending, recv))
        self._bytes_in_flight += bucket.nbytes
        self._next_launch += 1
        while len(self._in_flight) > 1 and self._bytes_in_flight > _MAX_BYTES_IN_FLIGHT:
            self._finish(*self._in_flight.popleft())  # Note [reductions in flight]

    def _finish(self, bucket: GradBucket, pending: comm.PendingWork, recv: list[torch.Tensor]) -> None:
        pending.wait()
        self._bytes_in_flight -= bucket.nbytes
        for param, reduced in bucket.unpack(recv, self.world_size):
            if bucket.spec.grad_dtype != param.dtype:  # Note [reduce into master gradients]
                self._add_to_master(param, reduced)
                continue
            kept = self._set_aside.pop(param, None)
            if reduced is None:
                if kept is not None:
                    param.grad = kept
                continue
            if kept is not None:
                reduced = kept.add_(reduced)
            param.grad = reduced
            self._written[param] = weakref.ref(reduced)

    def _master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        return self._optim_of[param].master_of(param) if param.dtype in self._grad_dtypes else None

    def _add_to_master(self, param: torch.Tensor, reduced: torch.Tensor | None) -> None:
        master = self._optim_of[param].master_of(param)
        assert master is not None, f"[rank {self.rank}] {self._name_of(param)!r} was reduced here, but has no master"
        self._local_sums.settle(param, master)  # Note [placeholders for moved gradients]
        if reduced is not None:
            master.grad = reduced if master.grad is None else master.grad.add_(reduced)
        self._local_sums.leave(param, master)

    def _on_backward_end(self) -> None:
        self._flush()

    def _flush(self) -> None:
        """Send every bucket not yet sent (gradients accumulated under no_sync included)."""
        for bucket in self._buckets[self._next_launch :]:
            for param in bucket.spec.params:
                if param not in self._local_pending:
                    continue
                if param.dtype in self._grad_dtypes:  # Note [placeholders for moved gradients]
                    self._local_sums.settle(param, self._master_of(param))
                grad = self._local_sums.take(param, param.grad)
                if grad is not None:
                    bucket.add(param, grad)
                    param.grad = None
            self._launch(bucket)
        while self._in_flight:
            self._finish(*self._in_flight.popleft())
        self._local_pending.clear()
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        self._next_launch = 0
        self._callback_queued = False

    def reduce(self) -> None:
        """Reduce the gradients accumulated locally (under :meth:`no_sync`) now. All ranks.

        Use it to finish an accumulation done entirely inside ``no_sync()``.

        Raises:
            RuntimeError: there are no locally accumulated gradients to reduce.
        """
        if not self._local_pending:
            raise RuntimeError(
                f"[rank {self.rank}] ShardedDataParallel.reduce(): nothing to reduce; backward passes "
                "outside no_sync() reduce their gradients themselves. Call reduce() after backward passes "
                "run under no_sync()"
            )
        self._flush()

    # ------------------------------------------------------------------ state

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero (or drop) the gradients of every parameter, and anything set aside: masters'
        gradients and ``no_sync`` sums too (``module.zero_grad()`` reaches neither).

        Args:
            set_to_none: drop the gradients instead of zeroing them (default ``False``, as
                fairscale's; either is safe, see Note [owner's gradient across backward passes]).
        """
        self.module.zero_grad(set_to_none=set_to_none)
        for master in [opt.master_of(p) for p, opt in self._optim_of.items()]:
            if master is not None:
                master.grad = None
        self._local_sums.clear()
        self._set_aside.clear()
        self._written.clear()
        self._local_pending.clear()

    def _sync_params_and_buffers(self) -> None:
        pending = [comm.broadcast(t.data, 0, self.process_group, label="shardopt::sdp::startup_sync")
                   for t in list(self.module.parameters()) + list(self.module.buffers())]
        comm.wait_all(pending)

    def sync_buffers(self, blocking: bool = False) -> list[comm.PendingWork]:
        """Copy rank 0's buffers to every rank.

        Args:
            blocking: wait for the copies before returning.

        Returns:
            The pending copies (already completed when ``blocking``).
        """
        pending = [comm.broadcast(b.data, 0, self.process_group, label="shardopt::sdp::buffers")
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
