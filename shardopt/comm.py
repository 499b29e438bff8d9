"""The one module that calls ``torch.distributed`` collectives.

Every collective shardopt issues goes through a function here. Each takes the process
group and the buffers explicitly, uses group-local ranks, and (for the bulk-data ones)
returns a :class:`PendingWork` record that keeps its buffers alive until waited. Each
launch is labelled for the profiler with the caller's ``shardopt::<component>::<phase>``. Pending
records are waited in the order they were issued with a plain loop (:func:`wait_all`).

With a group of one rank nothing is sent: the functions copy where a copy is the result and
otherwise return a completed record. Backend and torch-version differences (renamed
collectives, gloo vs NCCL) are handled here and nowhere else.

Note [gloo point to point]
gloo's all-gather and all-to-all are slow for bulk data next to its point-to-point
``isend``/``irecv``: exchanging 51.8 MiB each way between 2 ranks over loopback (8 MiB
pieces, two in flight) took 97 ms as ``all_gather_into_tensor``, 53 ms as
``all_to_all_single``, 42 ms as an ``all_reduce`` of the same tensor and 39 ms as
``isend``/``irecv`` pairs (2-core CPU machine, torch 2.13). So on gloo, for CPU tensors,
:func:`all_gather_into` and :func:`all_to_all` post one send and one receive per peer, and
:func:`exchange` lets a caller move tensors straight between the owners' and the receivers'
memory. The bytes are the same; only gloo's algorithm overhead goes. Two facts make this
safe: gloo matches the sends and receives between two ranks that carry the same tag in the
order they were posted (its TCP pair keeps a FIFO queue per slot), and it builds the slots of
its collectives with a per-algorithm prefix in the top byte, so small point-to-point tags
never meet them. Each function here uses its own tag, so their messages never cross. NCCL
keeps its collectives, which are what it is fast at.

Note [reduce-scatter on gloo]
gloo's reduce-scatter costs as much as an all-reduce (every rank sends the whole buffer).
For CPU tensors on gloo, :func:`reduce_scatter` instead sends slice ``r`` of the input to
rank ``r`` with one all-to-all and adds the ``N`` received copies in rank order, so each
rank sends ``(N-1)/N`` of the buffer: ZeRO-3's FULL_SHARD then sends 1.5x what DDP's ring
all-reduce does per step (two all-gathers and this), SHARD_GRAD_OP 1.0x, as in the ZeRO
paper. With two ranks the sum of two copies is DDP's sum, bit for bit. Other backends use
their own reduce-scatter.

Note [device tensors on gloo]
gloo moves bytes over TCP from host memory: it has no all-to-all at all for device tensors
("Backend gloo does not support alltoall", seen with CUDA tensors on an H100, torch 2.11),
and its point-to-point calls read the pointer they are given. Several ranks sharing one GPU
over gloo is still a real setup (tests, one-GPU experiments), so on gloo the point-to-point
paths stage device tensors: each send is copied to host first (a blocking copy, so the
device work that produced it has finished) and each receive lands in a host tensor that
:class:`_AllOf` copies back to the device when the record is waited. The arithmetic (which
copies are summed, in which order) is the CPU path's, so results match it bit for bit.
NCCL never takes this path.

Note [waiting beside the work]
A gloo wait cannot be sliced with a timeout: for a point-to-point transfer a timed wait that
runs out closes the TCP pair ("Application timeout caused pair closure" on the next wait),
so any peer more than one slice late broke the step (seen on an H100 machine, where spawned
ranks start seconds apart, and reproduced on a CPU with a peer 1.6 s late). So one daemon
thread per process blocks in torch's ``wait()`` (which releases the GIL), in issue order,
and the caller waits on its event in slices of ``WATCH_SLICE_S``, reading the failure
board between them. A peer that is merely late costs nothing; one that reported a failure
ends the wait within a slice. After such an error the thread may stay blocked in a wait
that can never complete; it holds only that work and dies with the process. Cost: one
thread handoff per wait, tens of microseconds.

Note [release scratch buffers]
When ``work.wait()`` returns, the backend's worker thread may still hold its reference to
the buffers for a moment (gloo drops it after signalling completion), so letting the last
Python reference go does not free the memory deterministically: a heap reading right after
``step()`` saw one gathered chunk still alive on some ranks. The transfer is complete, so
nothing reads the buffer any more; :func:`release_storage` shrinks its storage to zero and
frees the memory at once. Only for buffers shardopt allocated and no longer needs (and for
FSDP's full parameter buffer between phases, whose views must stay valid objects).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
import os
import queue
import threading
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from shardopt import failures
from shardopt.failures import CollectiveError

__all__ = [
    "CollectiveError",
    "PendingWork",
    "ProcessGroup",
    "all_gather_into",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_pieces",
    "barrier",
    "broadcast",
    "broadcast_object",
    "exchange",
    "group_rank",
    "group_size",
    "peers",
    "prefers_point_to_point",
    "require_initialized",
    "recv_object",
    "report_failure",
    "reduce_scatter",
    "release_storage",
    "send_object",
    "wait_all",
]

ProcessGroup = dist.ProcessGroup
"""torch's process group type (``None`` in a signature means the default group)."""

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Point-to-point tags, one per function (Note [gloo point to point]).
_GATHER_TAG = 0x53A0
_ALL_TO_ALL_TAG = 0x53A1
_EXCHANGE_TAG = 0x53A2
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class PendingWork:
    """A collective in flight, with the buffers it reads and writes.

    Attributes:
        label: what is in flight, for error messages and profiles.
        work: torch's work handle; ``None`` when nothing was sent (a group of one).
        buffers: tensors that must stay alive until the collective completes.
        watched: wait in slices and watch the failure board between them (gloo; Note
            [failure board]).
    """

    label: str
    work: Any = None
    buffers: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    watched: bool = False

    def wait(self) -> None:
        """Block until the collective has completed, then drop the buffer references.

        Raises:
            CollectiveError: the collective failed, or another rank reported a failure
                (Note [failure board]); the message names the rank and the operation.
        """
        if self.work is not None:
            _wait_work(self.work, self.label, self.watched)
            self.work = None
        self.buffers = ()


def _record(label: str, work: Any, buffers: tuple[torch.Tensor, ...], group: ProcessGroup | None) -> PendingWork:
    return PendingWork(label, work, buffers, watched=_is_gloo(group))


def _is_gloo(group: ProcessGroup | None) -> bool:
    return str(dist.get_backend(group)) == "gloo"


report_failure = failures.report_failure

class _Waiter:
    """A daemon thread that blocks in torch's ``wait()`` for this process, so the caller can
    wait in slices and watch the failure board (Note [waiting beside the work])."""

    def __init__(self) -> None:
        self._pid = -1
        self._queue: queue.SimpleQueue[tuple[Any, _Ticket]] = queue.SimpleQueue()

    def submit(self, work: Any) -> _Ticket:
        if self._pid != os.getpid():  # first use, or a forked child: the thread is not here
            self._pid, self._queue = os.getpid(), queue.SimpleQueue()
            threading.Thread(target=self._run, args=(self._queue,), name="shardopt-wait", daemon=True).start()
        ticket = _Ticket()
        self._queue.put((work, ticket))
        return ticket

    @staticmethod
    def _run(jobs: queue.SimpleQueue[tuple[Any, _Ticket]]) -> None:
        while True:
            work, ticket = jobs.get()
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                ticket.error = exc
            ticket.done.set()


@dataclass
class _Ticket:
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


_WAITER = _Waiter()


def _wait_work(work: Any, label: str, watched: bool) -> None:
    """Wait for ``work``; on gloo beside it, reading the failure board every slice (Note
    [failure board] in ``failures``). Any failure becomes a :class:`CollectiveError`."""
    if not watched:
        try:
            work.wait()
        except RuntimeError as exc:
            raise failures.collective_error(label, exc) from exc
        return
    ticket = _WAITER.submit(work)
    while not ticket.done.wait(failures.WATCH_SLICE_S):
        if failures.any_reported():
            raise failures.collective_error(label, "another rank reported a failure")
    if ticket.error is not None:
        if not isinstance(ticket.error, RuntimeError):
            raise ticket.error
        raise failures.collective_error(label, ticket.error) from ticket.error


@contextmanager
def _launch(label: str) -> Iterator[None]:
    """Profile a launch under ``label``; a launch that fails (a peer's connection already
    closed) becomes a :class:`CollectiveError` too."""
    with torch.profiler.record_function(label):
        try:
            yield
        except RuntimeError as exc:
            if isinstance(exc, CollectiveError):
                raise
            raise failures.collective_error(label, exc) from exc


def _blocking(label: str, group: ProcessGroup | None, call: Any) -> Any:
    """Run a blocking collective (object exchange, barrier), naming the failure if it fails."""
    _check_sequence(label, group)
    try:
        return call()
    except RuntimeError as exc:
        raise failures.collective_error(label, exc) from exc


_sequence: dict[Any, int] = {}


def _check_sequence(label: str, group: ProcessGroup | None) -> None:
    """Note [collective sequence check] in ``failures``: off unless SHARDOPT_DEBUG_COLLECTIVES=1."""
    if not failures.debug_enabled() or group_size(group) == 1:
        return
    key = group if group is not None else "world"
    number = _sequence.get(key, 0)
    _sequence[key] = number + 1
    seen: list[Any] = [None] * group_size(group)
    dist.all_gather_object(seen, (number, label), group=group)
    mine = (number, label)
    for rank, other in enumerate(seen):
        if tuple(other) != mine:
            raise ValueError(
                f"[rank {group_rank(group)}] collective mismatch (SHARDOPT_DEBUG_COLLECTIVES): this rank's call "
                f"#{number} is {label!r} but group rank {rank}'s is #{other[0]} {other[1]!r}; every rank must run "
                "the same shardopt operations in the same order (same model, same settings, same control flow)"
            )


def release_storage(buffer: torch.Tensor) -> None:
    """Free a buffer's memory now, whoever else still holds the tensor object (Note [release
    scratch buffers]); the tensor and its views stay valid objects of size-0 storage."""
    buffer.untyped_storage().resize_(0)


def wait_all(pending: Iterable[PendingWork]) -> None:
    """Wait for every record, in the order given (the order they were issued)."""
    for record in pending:
        record.wait()


class _AllOf:
    """Several of torch's works, waited as one in the order they were posted; then the
    host copies of device receives are copied back (Note [device tensors on gloo])."""

    def __init__(self, works: list[Any], copy_back: list[tuple[torch.Tensor, torch.Tensor]],
                 staged_sends: list[torch.Tensor]) -> None:
        self._works = works
        self._copy_back = copy_back
        self._staged_sends = staged_sends  # alive until the sends complete

    def wait(self, timeout: timedelta | None = None) -> None:
        while self._works:
            if timeout is None:
                self._works[0].wait()
            else:
                self._works[0].wait(timeout)
            self._works.pop(0)
        for target, staged in self._copy_back:
            target.copy_(staged)
        self._copy_back, self._staged_sends = [], []


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else torch.empty(tensor.shape, dtype=tensor.dtype)


def _post(
    sends: Iterable[tuple[torch.Tensor, int]],
    recvs: Iterable[tuple[torch.Tensor, int]],
    group: ProcessGroup | None,
    tag: int,
) -> _AllOf:
    """Post every receive, then every send (group ranks); empty tensors are skipped. Device
    tensors travel through host copies (Note [device tensors on gloo])."""
    works: list[Any] = []
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    staged_sends: list[torch.Tensor] = []
    for t, src in recvs:
        if t.numel():
            staged = _on_host(t)
            if staged is not t:
                copy_back.append((t, staged))
            works.append(dist.irecv(staged, _global(group, src), group=group, tag=tag))
    for t, dst in sends:
        if t.numel():
            if t.device.type != "cpu":
                t = t.cpu()
                staged_sends.append(t)
            works.append(dist.isend(t, _global(group, dst), group=group, tag=tag))
    return _AllOf(works, copy_back, staged_sends)


def peers(rank: int, size: int) -> list[int]:
    """Every other rank of a group of ``size``, starting after ``rank`` (a ring order)."""
    return [(rank + k) % size for k in range(1, size)]


def prefers_point_to_point(group: ProcessGroup | None, device: torch.device) -> bool:
    """Whether bulk data for ``device`` moves fastest point to point on ``group``.

    True on gloo with more than one rank (Note [gloo point to point]); device tensors then
    travel through host copies (Note [device tensors on gloo]).
    """
    return group_size(group) > 1 and str(dist.get_backend(group)) == "gloo"


def default_device(group: ProcessGroup | None) -> torch.device:
    """Where a module built on the meta device is materialised for ``group``: the current CUDA
    device on NCCL, else the CPU (a gloo group on a machine with GPUs trains on the CPU
    unless the module is moved there by the caller, e.g. with ``param_init_fn``)."""
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def require_initialized(who: str) -> None:
    """Raise a clear error when there is no default process group.

    Args:
        who: the class or function that needs one, for the message.

    Raises:
        RuntimeError: ``torch.distributed`` is unavailable or not initialised.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{who} needs torch.distributed to be initialised: call "
            "torch.distributed.init_process_group(backend, ...) first (launch with torchrun, or "
            "for one process use init_process_group('gloo', init_method='tcp://127.0.0.1:29500', "
            "rank=0, world_size=1)); shardopt.testing.run_ranks does this for tests"
        )


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (the default group when ``None``)."""
    return int(dist.get_world_size(group))


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank inside ``group``."""
    return int(dist.get_rank(group))


def _global(group: ProcessGroup | None, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    return int(dist.get_global_rank(group, rank))


def all_gather_into(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, label: str = "all_gather"
) -> PendingWork:
    """Gather equal-sized ``input`` slices from every rank into ``output`` (rank order).

    ``input`` may be this rank's slice of ``output`` (in place); both contiguous.
    """
    _check_sequence(label, group)
    size = group_size(group)
    if size == 1:
        if output.data_ptr() != input.data_ptr():
            output.copy_(input.view_as(output))
        return PendingWork(label)
    with _launch(label):
        if prefers_point_to_point(group, output.device):
            me, n = group_rank(group), input.numel()
            source, pieces = input.view(-1), output.view(size, n)
            if pieces[me].data_ptr() != source.data_ptr():
                pieces[me].copy_(source)
            others = peers(me, size)
            work: Any = _post([(source, r) for r in others], [(pieces[r], r) for r in others], group, _GATHER_TAG)
        else:
            work = _all_gather_single(output, input, group=group, async_op=True)
    return _record(label, work, (output, input), group)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: ProcessGroup | None,
    label: str = "all_to_all",
) -> PendingWork:
    """Send ``input_splits[r]`` elements of ``input`` to rank ``r``; receive into ``output``.

    Splits may be uneven and zero. On gloo each rank sends only what others need, which is
    why shardopt reduces gradients to their owners this way (see Note [reduce to owner]).
    """
    _check_sequence(label, group)
    size = group_size(group)
    if size == 1:
        output.copy_(input)
        return PendingWork(label)
    if prefers_point_to_point(group, output.device):
        pending = all_to_all_pieces(output.split(list(output_splits)), input.split(list(input_splits)), group, label)
        pending.buffers = (output, input)
        return pending
    with _launch(label):
        work = dist.all_to_all_single(
            output, input, list(output_splits), list(input_splits), group=group, async_op=True
        )
    return _record(label, work, (output, input), group)


def all_to_all_pieces(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    group: ProcessGroup | None,
    label: str = "all_to_all",
) -> PendingWork:
    """Send ``inputs[r]`` to rank ``r`` and receive rank ``r``'s piece into ``outputs[r]``.

    The pieces are separate tensors (sizes may differ per rank, and be zero), so a caller
    never needs one large contiguous buffer. ``outputs[rank]`` may be ``inputs[rank]``
    itself: this rank's own piece is then not copied.
    """
    _check_sequence(label, group)
    size, me = group_size(group), group_rank(group)
    if outputs[me] is not inputs[me]:
        outputs[me].copy_(inputs[me])
    if size == 1:
        return PendingWork(label)
    outs = list(outputs)
    with _launch(label):
        if prefers_point_to_point(group, inputs[me].device):
            others = peers(me, size)
            work: Any = _post([(inputs[r], r) for r in others], [(outs[r], r) for r in others], group, _ALL_TO_ALL_TAG)
        else:
            if outs[me] is inputs[me]:
                outs[me] = torch.empty_like(inputs[me])  # the backend wants distinct tensors
            work = dist.all_to_all(outs, list(inputs), group=group, async_op=True)
    return _record(label, work, (*outs, *outputs, *inputs), group)


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: ProcessGroup | None,
    label: str = "exchange",
) -> PendingWork:
    """Send each ``(tensor, dst)`` and receive into each ``(tensor, src)``, point to point.

    Between two ranks, the ``k``-th tensor one sends to the other lands in the ``k``-th
    receive the other posts from it, so both sides must list their transfers in the same
    order and sizes (Note [gloo point to point]). Tensors must be contiguous and stay
    untouched until the record is waited. For gloo on CPU; see :func:`prefers_point_to_point`.
    """
    _check_sequence(label, group)
    with _launch(label):
        work = _post(sends, recvs, group, _EXCHANGE_TAG)
    return _record(label, work, tuple(t for t, _ in sends) + tuple(t for t, _ in recvs), group)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, label: str = "reduce_scatter"
) -> PendingWork:
    """Sum ``input`` over ranks and leave rank ``r`` the ``r``-th equal slice in ``output``.

    ``output`` holds the result once the record is waited. On gloo with CPU tensors this is
    an all-to-all and a rank-order sum (Note [reduce-scatter on gloo]).
    """
    _check_sequence(label, group)
    size = group_size(group)
    if size == 1:
        output.copy_(input.view_as(output))
        return PendingWork(label)
    if prefers_point_to_point(group, input.device):
        rows = torch.empty_like(input)
        splits = [output.numel()] * size
        pending = all_to_all(rows, input, splits, splits, group, label)
        return _record(label, _SumRows(pending, rows.view(size, -1), output), (rows, input, output), group)
    with _launch(label):
        work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _record(label, work, (output, input), group)


class _SumRows:
    """Wait for an all-to-all that left every rank's copy of this rank's slice in ``rows``,
    then add the copies in rank order into ``output`` (Note [reduce-scatter on gloo])."""

    def __init__(self, pending: PendingWork, rows: torch.Tensor, output: torch.Tensor) -> None:
        self._pending, self._rows, self._output = pending, rows, output

    def wait(self, timeout: timedelta | None = None) -> None:
        work = self._pending.work
        if work is not None:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
            self._pending.work = None
        self._output.copy_(self._rows[0])
        for row in self._rows[1:]:
            self._output.add_(row)


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    op: str = "sum",
    label: str = "all_reduce",
) -> PendingWork:
    """Reduce ``tensor`` in place over ranks with ``op`` in ``{"sum", "max", "min"}``."""
    _check_sequence(label, group)
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}")
    if group_size(group) == 1:
        return PendingWork(label)
    with _launch(label):
        work = dist.all_reduce(tensor, op=ops[op], group=group, async_op=True)
    return _record(label, work, (tensor,), group)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None, label: str = "broadcast") -> PendingWork:
    """Copy ``tensor`` from group rank ``src`` to every rank, in place."""
    _check_sequence(label, group)
    if group_size(group) == 1:
        return PendingWork(label)
    with _launch(label):
        work = dist.broadcast(tensor, src=_global(group, src), group=group, async_op=True)
    return _record(label, work, (tensor,), group)


def barrier(group: ProcessGroup | None) -> None:
    """Block until every rank of ``group`` has arrived."""
    if group_size(group) > 1:
        _blocking("shardopt::barrier", group, lambda: dist.barrier(group=group))


def all_gather_object(obj: Any, group: ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj`` (picklable), indexed by group rank. For metadata, not bulk data."""
    if group_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * group_size(group)
    _blocking("shardopt::object::all_gather", group, lambda: dist.all_gather_object(out, obj, group=group))
    return out


def broadcast_object(obj: Any, src: int, group: ProcessGroup | None) -> Any:
    """Rank ``src``'s ``obj`` on every rank (others pass anything, e.g. ``None``)."""
    if group_size(group) == 1:
        return obj
    box = [obj]
    _blocking("shardopt::object::broadcast", group,
              lambda: dist.broadcast_object_list(box, src=_global(group, src), group=group))
    return box[0]


def send_object(obj: Any, dst: int, group: ProcessGroup | None) -> None:
    """Send a picklable object to group rank ``dst`` (blocking)."""
    _blocking("shardopt::object::send", None, lambda: dist.send_object_list([obj], dst=_global(group, dst), group=group))


def recv_object(src: int, group: ProcessGroup | None) -> Any:
    """Receive the object that group rank ``src`` sent with :func:`send_object`."""
    box: list[Any] = [None]
    _blocking("shardopt::object::recv", None, lambda: dist.recv_object_list(box, src=_global(group, src), group=group))
    return box[0]
