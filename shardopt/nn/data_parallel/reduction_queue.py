"""ShardedDataParallel's reduction queue: which bucket each gradient goes to, and the buckets
in flight.

ShardedDataParallel creates one :class:`ReductionQueue` from the bucket plan each time it
(re)builds its hooks (construction, ``refresh_trainable``, ``to``), and hands it where the
reduced gradients go (:meth:`OwnerGrads.receive
<shardopt.nn.data_parallel.owner_grads.OwnerGrads.receive>`). In: each local gradient as
autograd finishes it (:meth:`ReductionQueue.add`), and at the end of backward (or
``reduce()``) whatever no hook added (:meth:`ReductionQueue.flush`, which asks a function for
it). Out: each reduced gradient, handed to ``receive`` as its bucket is finished. The queue launches buckets strictly
in index order (Note [reduce to owner] in ``grad_buckets``), keeps launched ones in flight
under a byte budget (Note [reductions in flight]), and queues the end-of-backward callback
at most once per iteration.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from shardopt import comm
from shardopt.nn.data_parallel.grad_buckets import BucketSpec, GradBucket, Reduced
from shardopt.nn.data_parallel.replicas import DeferredSums, ReplicaReduction, Replicas
from shardopt.streams import HostStreams, StreamOps

__all__ = ["MAX_BYTES_IN_FLIGHT", "PassThroughQueue", "Receiver", "ReductionQueue"]

Receiver = Callable[[Sequence[tuple[nn.Parameter, torch.Tensor | None]], torch.dtype], None]
"""Where reduced gradients go: ``[(param, reduced or None when no rank had one), ...]`` of one bucket, and the
dtype they are owned in (at one rank a gradient may come narrower: Note [one rank passes gradients through])."""

# Note [reductions in flight]
# Reductions stay in flight until their bytes pass two default buckets' worth (2 x 2**23
# fp32 elements); then the oldest is waited for. With default buckets that is two in
# flight, as before. Without buckets (reduce_buffer_size=0: one all-to-all per parameter,
# fairscale's benchmark setting) a count of two serialised hundreds of tiny transfers, and
# a step of a model of 150 small parameters took 1.46x fairscale's (scripts/bench_bucketless.py,
# 2 ranks); a byte budget keeps as many small ones in flight as large ones would use memory.
MAX_BYTES_IN_FLIGHT = 2 * 2**23 * 4
"""Bytes of launched buckets kept in flight before the oldest is waited for."""

# Note [reentrant checkpoints]
# A reentrant activation checkpoint runs a nested backward, with its own end-of-backward
# callbacks. The flush is queued on the backward in which the first gradient of an
# iteration arrives. If that is a nested one, every bucket is sent when it ends and the
# rest of the outer backward is reduced in a second round: correct (the owner adds the
# rounds, Note [owner's gradient across backward passes] in owner_grads) but with twice the
# bytes. A parameter used in several reentrant checkpoints after the flush was queued on the
# outer backward gets one gradient per nested backward within one round, after its bucket
# may have been sent: that is refused with a ValueError naming it, rather than reduced wrongly.
# Non-reentrant checkpoints (use_reentrant=False) have neither problem.


class ReductionQueue:
    """The buckets of one plan and their progress through an iteration.

    Args:
        specs: the bucket plan, in launch order (from ``plan_buckets``).
        group: the process group to reduce over.
        rank: this process's rank in ``group``.
        world_size: ranks in ``group``.
        receive: where each reduced gradient this rank owns goes.
        streams: the stream operations (Note [reductions on a side stream] in ``streams``;
            default none: host order).
        replicas: under a hybrid layout, the replicate stage (Note [hybrid reduction] in
            ``replicas``); ``group`` is then the shard group.
    """

    def __init__(self, specs: Sequence[BucketSpec], group: comm.ProcessGroup | None, rank: int, world_size: int,
                 receive: Receiver, streams: StreamOps | None = None, replicas: Replicas | None = None) -> None:
        self._replicas = replicas
        self._alone = (replicas.world_size if replicas else world_size) == 1
        # Every gradient is scaled by 1/N of the whole world, N = S * R (Note [hybrid reduction]).
        self.buckets = [GradBucket(spec, rank, 1.0 / (replicas.world_size if replicas else world_size))
                        for spec in specs]
        """Every bucket, in launch order."""
        self._bucket_of: dict[nn.Parameter, GradBucket] = {p: b for b in self.buckets for p in b.spec.params}
        self._group = group
        self._world_size = world_size
        self._receive = receive
        self._next_launch = 0
        self._in_flight: deque[GradBucket] = deque()
        self._bytes_in_flight = 0
        self._callback_queued = False
        self._undecided: list[tuple[Reduced, torch.dtype]] = []
        self._streams = streams or HostStreams()
        self._main: object = None  # the compute stream of the current iteration
        self._unjoined: list[GradBucket] = []  # summed on the side stream, pieces kept
        self._last_done: object = None
        self.replicate = True
        """Whether the buckets finished now go across replicas (False: ``no_replicate_sync``)."""
        self._deferred = DeferredSums()
        self._replicating: deque[ReplicaReduction] = deque()

    @property
    def busy(self) -> bool:
        """Whether an iteration's reductions have started and not yet all finished."""
        return bool(self._in_flight) or self._next_launch > 0

    def queue_callback(self, callback: Callable[[], None]) -> None:
        """Queue ``callback`` to run at the end of the current backward, once per iteration."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(callback)

    def is_sent_or_holds(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s gradient is already in its bucket, or its bucket was sent, this
        iteration (a second gradient for it would be lost; Note [reentrant checkpoints])."""
        bucket = self._bucket_of[param]
        return bucket.spec.index < self._next_launch or bucket.holds(param)

    def add(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Copy ``param``'s local gradient into its bucket, and launch the buckets now complete."""
        self._bucket_of[param].add(param, grad)
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].complete:
            self._launch(self.buckets[self._next_launch])

    def flush(self, take_local: Callable[[nn.Parameter], torch.Tensor | None]) -> None:
        """Send every bucket not yet sent, with the gradients ``take_local`` still has for its
        parameters, wait for every reduction and start a new iteration."""
        for bucket in self.buckets[self._next_launch :]:
            for param in bucket.spec.params:
                grad = take_local(param)
                if grad is not None:
                    bucket.add(param, grad)
            self._launch(bucket)
        while self._in_flight:
            self._finish(self._in_flight.popleft(), retire=False)
        self._finish_replicas()
        self._join()
        self._decide()
        self.reset()

    @property
    def has_deferred(self) -> bool:
        """Whether in-group sums of a ``no_replicate_sync`` window wait for the replicate stage."""
        return bool(self._deferred)

    def reduce_deferred(self) -> None:
        """All-reduce the held in-group sums across replicas and hand them over (``reduce()``
        after a window run wholly inside ``no_replicate_sync``; Note [hybrid reduction])."""
        assert self._replicas is not None
        for bucket in self.buckets:
            held = self._deferred.take(bucket.spec.index)
            if held is not None:
                self._replicate_part(bucket, held)
        self._finish_replicas()
        self._join()
        self._decide()
        self.reset()

    def drop_deferred(self) -> None:
        """Forget the held in-group sums (``zero_grad``)."""
        self._deferred.clear()

    def reset(self) -> None:
        """Start a new iteration: nothing launched, no callback queued, nothing undecided."""
        self._join()
        self._next_launch = 0
        self._callback_queued = False
        self._undecided.clear()

    def _launch(self, bucket: GradBucket) -> None:
        streams = self._streams
        self._main = streams.current()
        streams.wait_stream(streams.side, self._main)  # the copy-ins and flags are queued
        with streams.use(streams.side):
            bucket.launch(self._group, self._world_size)
        self._in_flight.append(bucket)
        self._bytes_in_flight += bucket.nbytes
        self._next_launch += 1
        while len(self._in_flight) > 1 and self._bytes_in_flight > MAX_BYTES_IN_FLIGHT:
            self._finish(self._in_flight.popleft(), retire=True)  # Note [reductions in flight]

    def _finish(self, bucket: GradBucket, retire: bool) -> None:
        """Sum ``bucket`` and hand its gradients over, on the side stream; free its pieces now
        when there is no side stream, else after the compute stream waited for it: now when
        ``retire`` (over the byte budget), else at the join (Note [reductions on a side
        stream] in ``streams``)."""
        streams = self._streams
        with streams.use(streams.side):
            total = bucket.finish_sum(self._world_size, release=streams.side is None)
            if total is not None:  # this rank owns something in the bucket
                if self._replicas is None:
                    self._hand_over(bucket, total)
                elif not self.replicate:
                    self._deferred.add(bucket.spec.index, total)
                else:
                    held = self._deferred.take(bucket.spec.index)
                    self._replicate_part(bucket, total if held is None else total.add_(held))
            done = streams.record_event(streams.side)
        self._bytes_in_flight -= bucket.nbytes
        if streams.side is None:
            return
        if retire:
            streams.wait_event(self._main, done)
            bucket.release()
        else:
            self._unjoined.append(bucket)
            self._last_done = done

    def _hand_over(self, bucket: GradBucket, total: torch.Tensor) -> None:
        """Give the owner each gradient of its part ``total``, or keep it for :meth:`_decide`."""
        decided = []
        for item in bucket.items(total, self._alone):
            if item.used is None:
                decided.append((item.param, item.grad))
            else:
                self._undecided.append((item, bucket.spec.grad_dtype))
        self._receive(decided, bucket.spec.grad_dtype)  # together: Note [one copy per bucket] in shardopt.optim.flat_masters

    def _replicate_part(self, bucket: GradBucket, total: torch.Tensor) -> None:
        """Launch the all-reduce of the owner's part across replicas (Note [hybrid reduction])."""
        assert self._replicas is not None
        pending = comm.all_reduce(total, self._replicas.group, label=f"shardopt::sdp::replicate::bucket{bucket.spec.index}")
        self._replicating.append(ReplicaReduction(bucket, total, pending))

    def _finish_replicas(self) -> None:
        """Wait for the replicate all-reduces in launch order and hand their gradients over."""
        if not self._replicating:
            return
        streams = self._streams
        with streams.use(streams.side):
            while self._replicating:
                record = self._replicating.popleft()
                record.pending.wait()
                self._hand_over(record.bucket, record.total)
            done = streams.record_event(streams.side)
        if streams.side is not None:
            streams.wait_event(self._main, done)

    def _join(self) -> None:
        """The compute stream waits once for the last reduction; then the kept pieces go."""
        if self._unjoined:
            self._streams.wait_event(self._main, self._last_done)
            for bucket in self._unjoined:
                bucket.release()
            self._unjoined.clear()

    def _decide(self) -> None:
        """Hand over the gradients of the owned parameters this rank did not use: one host
        read of their summed flags for the whole backward (Note [host reads per step] in
        grad_buckets), none when every owned parameter was used here."""
        if not self._undecided:
            return
        flags = torch.cat([item.used for item, _ in self._undecided if item.used is not None])
        used = flags.tolist()  # host-read: once per backward, Note [host reads per step]
        for dtype in dict.fromkeys(dtype for _, dtype in self._undecided):
            self._receive([(item.param, item.grad if count > 0 else None)
                           for (item, of), count in zip(self._undecided, used, strict=True) if of == dtype], dtype)
        self._undecided.clear()


# Note [one rank passes gradients through]
# At one rank there is nothing to reduce: the owner's "reduced" gradient is its own local one
# (DDP multiplies by 1/1, which is exact). So the queue hands autograd's gradient straight to
# the owner: no bucket, no copy, no flag, no collective, and the tensor autograd produced is
# the one left in ``param.grad``. The only arithmetic the buckets did that can change a bit is
# a wire narrower than the gradient (``reduce_dtype=torch.bfloat16`` over fp32 parameters):
# that rounding is kept, so a program gives the same result at one rank as before. Gradients
# bound for fp32 master gradients are handed over in their own dtype: the copy into the
# master's segment widens them, exactly, as the bucket did, with no fp32 temporary per
# parameter (OwnerGrads widens one that goes to ``param.grad``). Offloaded masters of CUDA
# parameters take them widened on the device, as before: a bf16 download lands as a cast on
# the host, and a second backward pass adding to it would wait there (one host wait more per
# step under accumulation, as tests/test_offload_streams.py counts). Everything else
# (set-aside gradients across backward passes, no_sync sums, placeholders, unused parameters
# left untouched) is OwnerGrads' and does not change.


class PassThroughQueue:
    """The one-rank stand-in for :class:`ReductionQueue`, with the same interface (Note [one
    rank passes gradients through]).

    Args:
        params: the trainable parameters, in order.
        wire_dtypes: the dtype each parameter dtype would be sent in (only a narrower one matters).
        grad_dtypes: a low-precision parameter dtype's master gradient dtype.
        receive: where each gradient goes (``OwnerGrads.receive``).
    """

    buckets: tuple[GradBucket, ...] = ()
    """No buckets at one rank."""
    replicate = True
    """No replicas at one rank (the flag :class:`ReductionQueue` reads, kept for one interface)."""

    def __init__(self, params: Sequence[nn.Parameter], wire_dtypes: Mapping[torch.dtype, torch.dtype],
                 grad_dtypes: Mapping[torch.dtype, torch.dtype], receive: Receiver) -> None:
        self._params = tuple(params)
        self._grad_dtype = {p: grad_dtypes.get(p.dtype, p.dtype) for p in self._params}
        self._wire_dtype = {p: wire_dtypes.get(p.dtype, p.dtype) for p in self._params}
        self._receive = receive
        self._handed: set[nn.Parameter] = set()
        self._callback_queued = False

    @property
    def busy(self) -> bool:
        """Whether gradients of an iteration were handed over and the iteration is not finished."""
        return bool(self._handed)

    def queue_callback(self, callback: Callable[[], None]) -> None:
        """Queue ``callback`` to run at the end of the current backward, once per iteration."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(callback)

    def is_sent_or_holds(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s gradient was handed over this iteration (refused a second time,
        as at more ranks, so a program fails the same way at any world size)."""
        return param in self._handed

    def add(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Hand ``param``'s gradient to its owner (this rank) now."""
        self._handed.add(param)
        grad_dtype, wire = self._grad_dtype[param], self._wire_dtype[param]
        if wire.itemsize < grad.dtype.itemsize:
            grad = grad.to(wire)  # the rounding a narrower wire does at every world size
        self._receive([(param, grad)], grad_dtype)  # widened where it lands: Note [one rank passes gradients through]

    def flush(self, take_local: Callable[[nn.Parameter], torch.Tensor | None]) -> None:
        """Hand over what ``take_local`` still has (``no_sync`` sums); tell the owner of every
        other parameter that it got no gradient; start a new iteration."""
        for param in self._params:
            if param in self._handed:
                continue
            grad = take_local(param)
            if grad is not None:
                self.add(param, grad)
            else:
                self._receive([(param, None)], self._grad_dtype[param])
        self.reset()

    def reset(self) -> None:
        """Start a new iteration."""
        self._handed.clear()
        self._callback_queued = False
