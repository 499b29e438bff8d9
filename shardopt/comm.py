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

import time
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from shardopt import failures, flight, waiting
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
    "recv_object",
    "reduce_scatter",
    "release_storage",
    "report_failure",
    "require_initialized",
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
            [failure board]), and the other ranks' positions after a grace (Note [flight
            recorder] in ``flight``).
        seq: the collective's number in its group's sequence (-1: not counted).
        group: the process group (for the flight recorder).
        size: bytes of the tensor of a gloo collective; -1 for point-to-point ones, whose
            ``work`` knows the bytes per peer.
        partner: the other rank (global) of a point-to-point object transfer, else -1.
    """

    label: str
    work: Any = None
    buffers: tuple[torch.Tensor, ...] = field(default_factory=tuple)
    watched: bool = False
    seq: int = -1
    group: ProcessGroup | None = None
    size: int = -1
    partner: int = -1

    def wait(self) -> None:
        """Block until the collective has completed, then drop the buffer references.

        Raises:
            CollectiveError: the collective failed, another rank reported a failure (Note
                [failure board]) or runs a different program or stopped (Note [flight
                recorder]); the message names the rank and the operation.
        """
        if self.work is not None:
            _wait_work(self)
            self.work = None
        self.buffers = ()

    def position(self) -> flight.Position:
        """Where this rank waits, for the flight recorder."""
        work = self.work._pending.work if isinstance(self.work, _SumRows) else self.work
        sends, recvs = (work.send_bytes, work.recv_bytes) if isinstance(work, _AllOf) else ({}, {})
        ranks = tuple(range(dist.get_world_size())) if self.group in (None, dist.group.WORLD) else tuple(
            dist.get_process_group_ranks(self.group))
        return flight.Position(self.label, self.seq, ranks, sends, recvs, self.size, time.time(), self.partner)


def _record(label: str, work: Any, buffers: tuple[torch.Tensor, ...], group: ProcessGroup | None, seq: int,
            size: int = -1) -> PendingWork:
    return PendingWork(label, work, buffers, watched=_is_gloo(group), seq=seq, group=group, size=size)


def _is_gloo(group: ProcessGroup | None) -> bool:
    return str(dist.get_backend(group)) == "gloo"


report_failure = failures.report_failure


def _wait_work(record: PendingWork) -> None:
    """Wait for ``record``'s work: on gloo beside it, watched (Note [waiting beside the work]
    in ``waiting``). Any failure becomes a :class:`CollectiveError`."""
    if record.watched:
        return waiting.wait_beside(record.work, record.label, record.position if max(record.seq, record.partner) >= 0
                                   else None)
    try:
        record.work.wait()
    except RuntimeError as exc:
        raise failures.collective_error(record.label, exc) from exc


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


def _blocking(label: str, group: ProcessGroup | None, call: Callable[[], Any], partner: int = -1) -> None:
    """Run a blocking collective (object exchange, barrier), naming the failure if it fails.
    On gloo it runs on the wait thread and is watched. ``partner``: the other group rank of
    a point-to-point transfer (not numbered in the group's sequence)."""
    seq = _begin(label, group) if partner < 0 else -1
    if not _is_gloo(group):
        try:
            call()
        except RuntimeError as exc:
            raise failures.collective_error(label, exc) from exc
        return
    PendingWork(label, waiting.Call(call), watched=True, seq=seq, group=group,
                partner=_global(group, partner) if partner >= 0 else -1).wait()


_sequence: weakref.WeakKeyDictionary[ProcessGroup, int] = weakref.WeakKeyDictionary()


def _begin(label: str, group: ProcessGroup | None) -> int:
    """Number this collective in its group's sequence and remember it (Note [flight
    recorder]); under SHARDOPT_DEBUG_COLLECTIVES=1 also check it against the other ranks'
    (Note [collective sequence check] in ``failures``). Returns the number (-1 for a group
    of one rank, where nothing is sent)."""
    if group_size(group) == 1:
        return -1
    key = cast(ProcessGroup, dist.group.WORLD if group is None else group)  # a later default group counts from 0
    number = _sequence.get(key, 0)
    _sequence[key] = number + 1
    flight.note_launch(label, number)
    if failures.debug_enabled():
        _check_sequence(label, group, number)
    return number


def _tag(base: int, label: str, seq: int, nbytes: int) -> int:
    """The point-to-point tag of one message: two ranks in different collectives, or in the
    same one with other sizes, never exchange a byte (Note [flight recorder] in ``flight``)."""
    return zlib.crc32(f"{base}|{label}|{seq}|{nbytes}".encode()) & 0x7FFFFFFF


def _check_sequence(label: str, group: ProcessGroup | None, number: int) -> None:
    """Note [collective sequence check] in ``failures``."""
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
                 staged_sends: list[torch.Tensor], send_bytes: dict[int, int], recv_bytes: dict[int, int]) -> None:
        self._works = works
        self._copy_back = copy_back
        self._staged_sends = staged_sends  # alive until the sends complete
        self.send_bytes, self.recv_bytes = send_bytes, recv_bytes  # by global rank, for the flight recorder

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


def _post(sends: Iterable[tuple[torch.Tensor, int]], recvs: Iterable[tuple[torch.Tensor, int]],
          group: ProcessGroup | None, base_tag: int, label: str, seq: int) -> _AllOf:
    """Post every receive, then every send (group ranks); empty tensors are skipped. Device
    tensors travel through host copies (Note [device tensors on gloo]). Each message's tag
    depends on the collective and its byte count (:func:`_tag`)."""
    works: list[Any] = []
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    staged_sends: list[torch.Tensor] = []
    send_bytes: dict[int, int] = {}
    recv_bytes: dict[int, int] = {}
    for t, src in recvs:
        if t.numel():
            staged = _on_host(t)
            if staged is not t:
                copy_back.append((t, staged))
            peer, nbytes = _global(group, src), t.numel() * t.element_size()
            recv_bytes[peer] = recv_bytes.get(peer, 0) + nbytes
            works.append(dist.irecv(staged, peer, group=group, tag=_tag(base_tag, label, seq, nbytes)))
    for t, dst in sends:
        if t.numel():
            if t.device.type != "cpu":
                t = t.cpu()
                staged_sends.append(t)
            peer, nbytes = _global(group, dst), t.numel() * t.element_size()
            send_bytes[peer] = send_bytes.get(peer, 0) + nbytes
            works.append(dist.isend(t, peer, group=group, tag=_tag(base_tag, label, seq, nbytes)))
    return _AllOf(works, copy_back, staged_sends, send_bytes, recv_bytes)


def peers(rank: int, size: int) -> list[int]:
    """Every other rank of a group of ``size``, starting after ``rank`` (a ring order)."""
    return [(rank + k) % size for k in range(1, size)]


def prefers_point_to_point(group: ProcessGroup | None, device: torch.device) -> bool:
    """Whether bulk data for ``device`` moves fastest point to point on ``group``.

    True on gloo with more than one rank (Note [gloo point to point]; device tensors travel
    through host copies, Note [device tensors on gloo]), and on torch's fake group, whose
    sends take pieces of any size (Note [fake process group] in ``failures``).
    """
    return group_size(group) > 1 and str(dist.get_backend(group)) in ("gloo", failures.FAKE_BACKEND)


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
    seq = _begin(label, group)
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
            work: Any = _post([(source, r) for r in others], [(pieces[r], r) for r in others], group, _GATHER_TAG,
                              label, seq)
        else:
            work = _all_gather_single(output, input, group=group, async_op=True)
    return _record(label, work, (output, input), group, seq, output.numel() * output.element_size())


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
    return _all_to_all(output, input, output_splits, input_splits, group, label, _begin(label, group))


def _all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                group: ProcessGroup | None, label: str, seq: int) -> PendingWork:
    if group_size(group) == 1:
        output.copy_(input)
        return PendingWork(label)
    if prefers_point_to_point(group, output.device):
        pending = _all_to_all_pieces(output.split(list(output_splits)), input.split(list(input_splits)), group, label,
                                     seq)
        pending.buffers = (output, input)
        return pending
    with _launch(label):
        work = dist.all_to_all_single(
            output, input, list(output_splits), list(input_splits), group=group, async_op=True
        )
    return _record(label, work, (output, input), group, seq)


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
    return _all_to_all_pieces(outputs, inputs, group, label, _begin(label, group))


def _all_to_all_pieces(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], group: ProcessGroup | None,
                       label: str, seq: int) -> PendingWork:
    size, me = group_size(group), group_rank(group)
    if outputs[me] is not inputs[me]:
        outputs[me].copy_(inputs[me])
    if size == 1:
        return PendingWork(label)
    outs = list(outputs)
    with _launch(label):
        if prefers_point_to_point(group, inputs[me].device):
            others = peers(me, size)
            work: Any = _post([(inputs[r], r) for r in others], [(outs[r], r) for r in others], group, _ALL_TO_ALL_TAG,
                              label, seq)
        else:
            if outs[me] is inputs[me]:
                outs[me] = torch.empty_like(inputs[me])  # the backend wants distinct tensors
            work = dist.all_to_all(outs, list(inputs), group=group, async_op=True)
    return _record(label, work, (*outs, *outputs, *inputs), group, seq)


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
    seq = _begin(label, group)
    with _launch(label):
        work = _post(sends, recvs, group, _EXCHANGE_TAG, label, seq)
    return _record(label, work, tuple(t for t, _ in sends) + tuple(t for t, _ in recvs), group, seq)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None, label: str = "reduce_scatter"
) -> PendingWork:
    """Sum ``input`` over ranks and leave rank ``r`` the ``r``-th equal slice in ``output``.

    ``output`` holds the result once the record is waited. On gloo with CPU tensors this is
    an all-to-all and a rank-order sum (Note [reduce-scatter on gloo]).
    """
    seq = _begin(label, group)
    size = group_size(group)
    if size == 1:
        output.copy_(input.view_as(output))
        return PendingWork(label)
    if prefers_point_to_point(group, input.device):
        rows = torch.empty_like(input)
        splits = [output.numel()] * size
        pending = _all_to_all(rows, input, splits, splits, group, label, seq)
        return _record(label, _SumRows(pending, rows.view(size, -1), output), (rows, input, output), group, seq)
    with _launch(label):
        work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return _record(label, work, (output, input), group, seq, input.numel() * input.element_size())


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
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}")
    if group_size(group) == 1:
        return PendingWork(label)
    seq = _begin(label, group)
    with _launch(label):
        work = dist.all_reduce(tensor, op=ops[op], group=group, async_op=True)
    return _record(label, work, (tensor,), group, seq, tensor.numel() * tensor.element_size())


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None, label: str = "broadcast") -> PendingWork:
    """Copy ``tensor`` from group rank ``src`` to every rank, in place."""
    if group_size(group) == 1:
        return PendingWork(label)
    seq = _begin(label, group)
    with _launch(label):
        work = dist.broadcast(tensor, src=_global(group, src), group=group, async_op=True)
    return _record(label, work, (tensor,), group, seq, tensor.numel() * tensor.element_size())


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
    _blocking("shardopt::object::send", group,
              lambda: dist.send_object_list([obj], dst=_global(group, dst), group=group), partner=dst)


def recv_object(src: int, group: ProcessGroup | None) -> Any:
    """Receive the object that group rank ``src`` sent with :func:`send_object`."""
    box: list[Any] = [None]
    _blocking("shardopt::object::recv", group,
              lambda: dist.recv_object_list(box, src=_global(group, src), group=group), partner=src)
    return box[0]
