"""The host<->device copies of an offloaded OSS (``offload="cpu"`` over CUDA parameters): each
reduced gradient (ZeRO-2) or DDP's gradient at the fold (ZeRO-1) down into its master's segment
of the pinned gradient buffer, each updated master up into its parameter, a mirror's gradient
back into DDP's ``param.grad``, on a copy stream, with one host wait per step.

:class:`~shardopt.optim.masters.MasterWeights` owns one :class:`OffloadCopies` for its life and
hands it to its offloaded flat groups, which download through it
(:meth:`OffloadCopies.download`, :meth:`OffloadCopies.download_to_add`); it uploads through it
after a step (:meth:`OffloadCopies.upload`, returning the :class:`Uploads` the gather waits
for) and lands it (:meth:`OffloadCopies.land`) before the host touches the buffers.

Note [offload copies on a side stream]
With ``OSS(..., offload="cpu")`` over CUDA parameters (Note [offloaded masters] in
:mod:`shardopt.optim.masters`) both directions run on one copy stream ``C`` of the device, so
they overlap what the compute stream ``S0`` and ShardedDataParallel's reduction stream ``R``
do (Note [reductions on a side stream] in :mod:`shardopt.nn.data_parallel.streams`):

1. download (``OSS.add_grad``, which ShardedDataParallel calls as each gradient is reduced,
   with the stream ``P`` that produced it current: ``R`` on NCCL, else ``S0``; under DDP,
   ``MasterWeights.fold_grads`` at the step for each ``param.grad``, with ``P = S0``, on which
   DDP's reduction finished at the end of backward): an event is
   recorded on ``P`` and ``C`` waits for it, the copy into the master's segment is issued on
   ``C`` (``non_blocking``; the host does not wait) and an event ``done`` is recorded on ``C``.
   The record keeps the device gradient until no stream can still read it: until the host
   waited (3), or, while more than :data:`COPY_BYTES_IN_FLIGHT` are kept, the oldest record's
   ``P`` waits for its ``done`` (on the device) and the record is dropped, so a block the
   allocator gives back to ``P`` is reused only after the copy read it. No ``record_stream``.
   A gradient in another dtype than the buffer (DDP's bf16 gradient for an fp32 master) is
   copied into a pinned tensor of its own dtype and cast into the segment on the host when it
   lands (3): a copy to the host that casts goes through pageable memory, which blocks the host.
2. accumulation (a gradient for a master that already has one in the buffer: several
   backward passes per step without ``no_sync``, or a mirror's gradient carried across a
   step): the gradient is downloaded as in (1) into the master's segment of a second pinned
   buffer (the staging buffer, allocated at the first accumulation and kept, 4 bytes per owned
   element), and the host adds it in once it landed (3), into the tensor that was the
   master's gradient when it arrived, as the blocking path added at once; a download into the
   master's segment in between (its gradient was dropped, then a new one arrived) overwrites
   what the addition would have changed, so the addition is forgotten. A master whose staged
   gradient is still waiting (a third backward pass before a step) makes the host land first:
   one more host wait per backward pass from the third on.
3. land: before the host reads the gradient buffer or writes a master, it waits for the last
   event recorded on ``C`` (``Event.synchronize``), then drops the kept gradients and adds
   (or casts) the staged ones. One wait covers every copy queued before it, both directions,
   since ``C`` runs them in order. Who lands: ``MasterWeights.fold_grads``, which the step,
   clipping (``OSS.clip_grad_norm``, torch's ``clip_grad_norm_`` through the wrapper),
   ``ShardedGradScaler.unscale_`` and ``OSS.collect_master_grads`` run first, after it issued
   DDP's downloads (1), so under ZeRO-1 too the one wait covers the fold's copies and the last
   step's uploads; ``OSS.wait_for_grads`` (``grad_norms``), only while a download is in flight
   (uploads do not change a gradient); a load, a rebuild, and a master following an outside
   write. So a step waits once, at its fold (or at clipping's, before it).
4. upload (``MasterWeights.write_back``, after the host step): ``C`` waits for ``S0`` (the last
   forward and backward read the parameters), the masters are copied into their parameters
   on ``C`` in the order the post-step gather sends them, with an event after every
   :data:`UPLOAD_EVENT_BYTES`; the gather makes ``S0`` wait (on the device) for the event
   covering a chunk's parameters before it packs or sends them, and ``S0`` waits for the
   last one after the gather (one rank has no gather, and the next forward reads every
   parameter). A master in another dtype than its parameter (fp32 for bf16 or fp16) is first
   rounded on the host into its segment of a pinned buffer in the parameter's dtype
   (``FlatGroup.upload_source``: one per flat group, allocated at the first upload and kept),
   which is then copied without a cast: a copy to the device that casts goes through a
   pageable temporary (ATen's ``Copy.cu``) and blocks the host per parameter, and moves 4
   bytes per element, not 2. ``Tensor.copy_`` on the CPU rounds fp32 to bf16 to nearest even,
   as the device's cast (``__float2bfloat16``): the same bits for every non-NaN value, scalar
   tail and vector body alike (checked against the rounding on the bits in
   ``tests/test_offload_streams.py``; a NaN stays NaN, its payload may differ). fp16 rounds
   to nearest even on both too. The host goes on; its next write to a master, and to the
   rounding buffer, comes after a land (3): the step's fold (or, delayed, the next step's, after
   the upload of the worker's update), a load, a rebuild. An upload that finds an earlier
   rounded one not landed lands first (one host wait; never in that order).
5. hand-back (``MasterWeights.release_grads``, after the host step, before the upload; under
   DDP only: Note [mirrors carry gradients] in :mod:`shardopt.optim.masters`): ``C`` waits for
   ``S0``, each mirror's gradient is copied from the host buffer into the tensor DDP had in
   ``param.grad``, an event is recorded on ``C`` and ``S0`` waits for it at once (on the
   device), so the next backward's accumulation, a ``zero_`` or a free of that tensor comes
   after the copy. Issued before the uploads, that wait does not hold ``S0`` behind them.
   The host's next write to the gradient buffer comes after a land (3).

With ``delay_update_after`` (Note [delayed update] in :mod:`shardopt.optim.delayed_update`)
``OSS.step`` first waits for the worker and uploads its update (4), then folds: the land there
covers the downloads (the launch copies the gradient buffer after it) and the uploads just
issued (the worker it launches writes the masters they read). That wait includes the uploads'
time, which a wait on the worker thread would hide; not done, it needs the worker's code.

On the CPU there is no copy stream and every copy is synchronous, as before. The protocol is
checked on CPU ranks against a simulated device that runs each stream's copies only when
something waits for them (``tests/test_offload_streams.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardopt.streams import CudaStreams, HostStreams, StreamOps

__all__ = ["COPY_BYTES_IN_FLIGHT", "UPLOAD_EVENT_BYTES", "OffloadCopies", "Uploads", "copy_streams_for"]

COPY_BYTES_IN_FLIGHT = 2 * 2**23 * 4
"""Bytes of device gradients kept for downloads in flight before the oldest is retired (as
ShardedDataParallel's reductions: Note [reductions in flight] in ``reduction_queue``)."""
UPLOAD_EVENT_BYTES = 2**22
"""An upload event per this many bytes of masters copied: the gather waits per event, not per parameter."""


def copy_streams_for(device: torch.device) -> StreamOps:
    """The copy stream for offloaded masters of parameters on ``device``: a side stream on CUDA,
    else none (synchronous copies)."""
    return CudaStreams(device) if device.type == "cuda" else HostStreams()


@dataclass
class _Download:
    """A gradient on its way to the host (Note [offload copies on a side stream], 1).

    Attributes:
        source: the device gradient the copy reads, kept until no stream can still read it.
        producer: the stream current when it arrived, which waits for ``done`` before an early drop.
        done: the event recorded on the copy stream after the copy.
        ops: the stream operations of its device.
    """

    source: torch.Tensor
    producer: Any
    done: Any
    ops: StreamOps

    @property
    def nbytes(self) -> int:
        return self.source.numel() * self.source.element_size()


@dataclass
class _StagedAdd:
    """A gradient downloaded into ``staged``, ``master``'s segment of the staging buffer, to be
    added into ``target`` when it lands (Note [offload copies on a side stream], 2); with
    ``assign``, a gradient in another dtype than ``target``'s, cast into it (1)."""

    master: torch.Tensor
    target: torch.Tensor
    staged: torch.Tensor
    assign: bool = False


class Uploads:
    """The masters' copies into their parameters in flight (Note [offload copies on a side
    stream], 4): which event on which copy stream covers each parameter. Empty (false) when the
    copies were synchronous.

    How it works: one list of events per copy stream, in the order recorded; each parameter
    maps to the first event recorded after its copy. The gather waits per event, once: a later
    event of one stream covers every earlier one.
    """

    def __init__(self) -> None:
        self._covering: dict[torch.Tensor, tuple[int, int]] = {}  # param -> (stream slot, event index)
        self._streams: list[tuple[StreamOps, list[Any]]] = []  # each copy stream with its events
        self._waited: list[int] = []  # per stream slot: the last event index waited for

    def __bool__(self) -> bool:
        return bool(self._streams)

    def add(self, ops: StreamOps, params: Sequence[torch.Tensor], event: Any) -> None:
        """Record that ``event`` (on ``ops``' copy stream) follows the copies into ``params``."""
        slot = next((k for k, (o, _) in enumerate(self._streams) if o is ops), None)
        if slot is None:
            slot = len(self._streams)
            self._streams.append((ops, []))
            self._waited.append(-1)
        events = self._streams[slot][1]
        events.append(event)
        self._covering.update({p: (slot, len(events) - 1) for p in params})

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        """Make the current stream wait (on the device) for the copies into ``params`` (others
        are ignored): for the latest event covering one of them, unless already waited for."""
        latest: dict[int, int] = {}
        for p in params:
            where = self._covering.get(p)
            if where is not None:
                latest[where[0]] = max(latest.get(where[0], -1), where[1])
        for slot, index in latest.items():
            self._wait(slot, index)

    def wait_all(self) -> None:
        """Make the current stream wait for every copy."""
        for slot, (_, events) in enumerate(self._streams):
            self._wait(slot, len(events) - 1)

    def _wait(self, slot: int, index: int) -> None:
        if index > self._waited[slot]:
            ops, events = self._streams[slot]
            ops.wait_event(ops.current(), events[index])
            self._waited[slot] = index


class OffloadCopies:
    """The copies between one OSS's offloaded masters and the device (Note [offload copies on a
    side stream]).

    How it works: a copy stream per device, chosen at first use (:func:`copy_streams_for`);
    downloads are typed records kept in FIFO order under a byte budget, staged additions wait
    for the next :meth:`land`, which waits on the host for the last event of each copy stream.
    Where the stream operations have no side stream (CPU parameters) every copy is synchronous
    and nothing is kept.
    """

    def __init__(self) -> None:
        self._ops: dict[torch.device, StreamOps] = {}
        self._downloads: deque[_Download] = deque()
        self._kept_bytes = 0
        self._staged: list[_StagedAdd] = []
        self._last: dict[torch.device, tuple[StreamOps, Any]] = {}  # per device: the last event on C, until landed
        self._uploads = Uploads()
        self._rounded_unlanded = False  # an upload from a rounding buffer may be in flight (4)

    def _ops_for(self, device: torch.device) -> StreamOps:
        ops = self._ops.get(device)
        if ops is None:
            ops = self._ops[device] = copy_streams_for(device)
        return ops

    def overlaps(self, device: torch.device) -> bool:
        """Whether copies from and to ``device`` run on a copy stream (else synchronously)."""
        return self._ops_for(device).side is not None

    def download(self, master: torch.Tensor, slot: torch.Tensor, grad: torch.Tensor,
                 via: torch.Tensor | None = None) -> None:
        """Copy ``grad`` (on the device) into ``slot``, the host segment that is now ``master``'s
        gradient (1). The copy overwrites the segment, so a staged addition into it that has not
        landed (made before the gradient was dropped) is forgotten: done in order, it would have
        been overwritten. With ``via`` (a host tensor in ``grad``'s dtype, for a gradient in
        another dtype than ``slot``'s) the copy goes there and is cast into ``slot`` when it lands:
        a copy to the host that casts goes through pageable memory and blocks the host."""
        self._staged = [a for a in self._staged if a.target is not slot]
        if via is None:
            self._issue(slot, grad)
            return
        self._issue(via, grad)
        self._staged.append(_StagedAdd(master, slot, via, assign=True))

    def download_run(self, slots: Sequence[torch.Tensor], target: torch.Tensor, grad: torch.Tensor) -> None:
        """:meth:`download` of several gradients in one copy: ``grad`` (on the device) into ``target``,
        the host range made of ``slots`` end to end, each now a master's gradient (Note [one copy per
        bucket] in :mod:`shardopt.optim.flat_masters`)."""
        covered = {id(slot) for slot in slots}
        self._staged = [a for a in self._staged if id(a.target) not in covered]
        self._issue(target, grad)

    def download_to_add(self, master: torch.Tensor, grad: torch.Tensor, staged: torch.Tensor) -> None:
        """Copy ``grad`` into ``staged`` (``master``'s segment of the staging buffer) and add it
        into ``master.grad`` when it lands (2); lands first if ``master`` has one waiting."""
        if any(a.master is master for a in self._staged):
            self.land()  # its staging segment is taken (a third backward pass): Note [offload copies on a side stream]
        assert master.grad is not None
        self._issue(staged, grad)
        self._staged.append(_StagedAdd(master, master.grad, staged))

    def _issue(self, dst: torch.Tensor, grad: torch.Tensor) -> None:
        ops = self._ops_for(grad.device)
        if ops.side is None:
            dst.copy_(grad)
            return
        producer = ops.current()
        ops.wait_event(ops.side, ops.record_event(producer))  # the reduction (or backward) that made grad
        with ops.use(ops.side):
            ops.copy(dst, grad)
            done = ops.record_event(ops.side)
        self._last[grad.device] = (ops, done)
        record = _Download(grad, producer, done, ops)
        self._downloads.append(record)
        self._kept_bytes += record.nbytes
        while len(self._downloads) > 1 and self._kept_bytes > COPY_BYTES_IN_FLIGHT:
            oldest = self._downloads.popleft()
            oldest.ops.wait_event(oldest.producer, oldest.done)  # then its block may go back to the producer
            self._kept_bytes -= oldest.nbytes

    def land(self) -> None:
        """Wait on the host for every copy queued so far, then drop the kept gradients and add
        the staged ones (3); without copies in flight, nothing."""
        for ops, event in self._last.values():
            ops.host_wait(event)  # Note [offload copies on a side stream], 3: the step's one host wait
        self._last.clear()
        self._rounded_unlanded = False
        self._downloads.clear()
        self._kept_bytes = 0
        staged, self._staged = self._staged, []
        for add in staged:
            if add.assign:
                add.target.copy_(add.staged)
            else:
                add.target.add_(add.staged)

    def land_grads(self) -> None:
        """:meth:`land` while a copy into the host gradients (or an addition or cast waiting for
        one) may be in flight, else nothing: for readers of the gradients, which the uploads in
        flight do not change (ZeRO-1's gradients are still on the device then, and its fold lands)."""
        if self._downloads or self._staged:
            self.land()

    @torch.no_grad()
    def hand_back(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy host gradients back into device tensors after a step (5): ``(device tensor, host
        gradient)``, a mirror's gradient into the tensor DDP had in ``param.grad``.

        How it works: on the CPU each copy is synchronous, as before. Else ``C`` waits for the
        current stream, the copies run on ``C`` and the current stream waits (on the device) for
        the event after them at once, so what it does next with the tensors (the next backward
        adding into them, a ``zero_``, freeing them) comes after; the host's next write to the
        gradient buffer comes after a :meth:`land`, which covers them.
        """
        for device in dict.fromkeys(d.device for d, _ in copies):
            mine = [(d, s) for d, s in copies if d.device == device]
            ops = self._ops_for(device)
            if ops.side is None:
                for dst, src in mine:
                    dst.copy_(src)
                continue
            ops.wait_stream(ops.side, ops.current())  # as an upload: nothing on the caller's stream still uses them
            with ops.use(ops.side):
                for dst, src in mine:
                    ops.copy(dst, src)
                event = ops.record_event(ops.side)
            ops.wait_event(ops.current(), event)
            self._last[device] = (ops, event)

    @torch.no_grad()
    def upload(self, copies: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> Uploads:
        """Copy masters into their parameters after a step (4), in the order given.

        Args:
            copies: ``(param, target, master, via)``: the parameter, what the master is copied into
                (the parameter, or its owned rows), the host master and, for a master in another
                dtype than ``target``'s copied on a copy stream, a host tensor in ``target``'s dtype
                that the master is rounded into on the host first (else ``None``): a copy to the
                device that casts goes through pageable memory and blocks the host.

        Returns:
            What the gather and :meth:`join_uploads` wait for (empty when every copy was synchronous).
        """
        synchronous = [(t, m) for p, t, m, _ in copies if not self.overlaps(p.device)]
        if synchronous:
            torch._foreach_copy_([t for t, _ in synchronous], [m for _, m in synchronous])
        uploads = Uploads()
        overlapped = [c for c in copies if self.overlaps(c[0].device)]
        if self._rounded_unlanded and any(via is not None for *_, via in overlapped):
            self.land()  # the last upload may still read the rounding buffers; the step's land came first (4)
        for device in dict.fromkeys(p.device for p, *_ in overlapped):
            ops = self._ops_for(device)
            ops.wait_stream(ops.side, ops.current())  # the last forward and backward read the parameters
            mine = [c for c in overlapped if c[0].device == device]
            covered: list[torch.Tensor] = []
            size = 0
            with ops.use(ops.side):
                for k, (param, target, master, via) in enumerate(mine):
                    if via is not None:  # rounded on the host as the device would cast: Note [offload copies on a side stream], 4
                        self._rounded_unlanded = True
                        source = via.copy_(master)
                    else:
                        source = master
                    ops.copy(target, source)
                    covered.append(param)
                    size += source.numel() * source.element_size()
                    if size >= UPLOAD_EVENT_BYTES or k == len(mine) - 1:
                        event = ops.record_event(ops.side)
                        uploads.add(ops, covered, event)
                        covered, size = [], 0
            self._last[device] = (ops, event)
        self._uploads = uploads
        return uploads

    def join_uploads(self) -> None:
        """Make the current stream wait (on the device) for the last upload: after the gather,
        before the next forward reads the parameters (4)."""
        self._uploads.wait_all()
        self._uploads = Uploads()
