"""Flat master buffers: one rank's fp32 masters of one param group in one contiguous buffer.

Note [flat masters]
An owner's masters (Note [master weights] in :mod:`shardopt.optim.masters`) of one param
group on one device live in one buffer of ``master_dtype``; each master is a view of its
segment, shaped as its parameter (or as the rows it copies), as DeepSpeed's fp32 partition
and Megatron's distributed-optimizer buffers hold theirs. Their gradients land in a matching
buffer, allocated when the first gradient arrives and freed after the step: each master's
``.grad`` is a view of its segment there (a gradient put elsewhere, as ShardedDataParallel
assigns its reduced sum, is copied in and freed when the masters' gradients are folded).
For an elementwise optimizer (:func:`~shardopt.optim.elementwise.updates_elementwise`) the
wrapped torch optimizer is given one flat tensor over the aligned segments (Note [aligned
segments]) instead of one tensor per master, so its state (Adam's moments) is flat too and a
step is a few kernels over one long tensor, not a few per parameter: with torch's default
for-loop Adam on a CPU that is 13 aten calls a step whatever the number of parameters,
against 13 per parameter. Matrix-wise optimizers (Muon, Adafactor) and unknown ones step
the views, one per master, as before. State dicts and checkpoints keep one entry per
parameter, cut from the flat state (views, the scalar ``step`` copied per parameter) and
joined back into it at load, so nothing saved changes.

Note [aligned segments]
The flat tensor must give every element the update it gets in its own tensor, bit for bit.
torch's CPU kernels run vectors over all but the last ``numel % (2 * lanes)`` elements of a
tensor, which take a scalar tail that may round differently (Note [aligned cuts] in
:mod:`shardopt.partition`). Inside a flat tensor a parameter's tail is no tail, so it takes
the vector path: measured with torch 2.13 on CPU (AVX-512 and AVX2 dispatch, 1 and 2
threads, 6 steps over 41 parameters of 1 to 300 elements), fused Adam differs on 1 of 43,591
elements and fused SGD with momentum on 7; the for-loop and foreach forms on none. Padding
each segment to 64 elements does not help (the tail elements still leave the scalar path).
So only segments of a multiple of 64 elements (every matrix and bias of a model whose hidden
sizes are multiples of 64) join the flat tensor, placed first so that each starts on a
multiple of 64; the others are stepped as their own views. Over aligned segments the flat
step matched the per-parameter one on every element for every optimizer of
:data:`~shardopt.optim.elementwise.ELEMENTWISE_OPTIMIZERS` measured (the same conditions).

Note [one copy per bucket]
ShardedDataParallel hands the owner its reduced gradients a bucket at a time (``OSS.add_grads``).
The owner's part of a bucket holds them end to end in parameter order (Note [reduce to owner]
in :mod:`shardopt.nn.data_parallel.grad_buckets`), and a group's buffer holds its masters'
segments in parameter order too, aligned ones first (Note [aligned segments]). So the owned
aligned parameters of one bucket are usually one range of the bucket and one range of the
buffer, and they land in one copy (masters without a gradient yet), or, accumulating across
backward passes, one addition (an elementwise fp32 addition rounds each element once however
the tensors are cut, so the sums are the same bits). A run ends at a parameter that is not
aligned (its segment sits after the flat ones), at a bucket's end, where a master has a
gradient and its neighbour has none, or where the gradient must be cast; the rest land one
at a time, as before. On a GPU an offloaded group's run is one copy on the copy stream (Note
[offload copies on a side stream] in :mod:`shardopt.optim.offload_copies`); its additions
go through the staging buffer one parameter at a time.

Note [flat state falls back to views]
A torch optimizer skips a parameter whose ``.grad`` is ``None`` (no step count, no moment
decay, no weight decay), and keeps a step count per parameter. A flat tensor cannot skip
part of itself, and its state holds one step count for all. So a group is stepped flat only
while its members agree: at a step, every aligned master of the group has a gradient (or
none has); at a build or a load, every member has state with the same names and the same
values for the non-elementwise entries (``step``), or none has any. Otherwise the group is
stepped as views from then on (until the next rebuild or load), its flat state cut into
views: the per-parameter semantics, never a zero gradient in place of a missing one (which
is what DeepSpeed and Megatron do). Logged at INFO.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardopt.host_memory import host_empty, place_state
from shardopt.optim.offload_copies import OffloadCopies
from shardopt.optim.state_transport import compact
from shardopt.partition import CUT_ALIGN_ELEMENTS

__all__ = ["FlatGroup", "Layout", "Segment", "compact_state", "plan_segments"]

logger = logging.getLogger(__name__)

# The offsets within a page of the streams a host step reads together (Note [host buffer placement]
# in shardopt.host_memory): the masters, their gradients (or the delayed step's copy of them), then
# each flat optimizer state tensor from STATE_SLOT on.
MASTERS_SLOT, GRADS_SLOT, STATE_SLOT, STEP_GRADS_SLOT = 0, 1, 2, 6


class Layout(enum.Enum):
    """How the wrapped optimizer steps a :class:`FlatGroup`'s aligned masters."""

    FLAT = "flat"
    """As one flat tensor (Note [flat masters])."""
    VIEWS = "views"
    """Each as its own view (Note [flat state falls back to views])."""


@dataclass(frozen=True)
class Segment:
    """Where one master lives in its group's buffer.

    Attributes:
        index: the parameter's index in ``OSS.params``.
        offset: the first element of the segment in the buffer.
        shape: the master's shape (its parameter's, or that of the rows it copies).
        numel: the number of elements.
        in_flat: whether the segment is part of the flat tensor (Note [aligned segments]).
    """

    index: int
    offset: int
    shape: torch.Size
    numel: int
    in_flat: bool


def plan_segments(entries: Sequence[tuple[int, torch.Size]], flatten: bool) -> tuple[list[Segment], int]:
    """Place masters in a buffer: with ``flatten``, the aligned ones first in the given
    order (the flat tensor), then the others; without, all in the given order.

    Args:
        entries: ``(index, shape)`` of each master, in parameter order.
        flatten: whether the optimizer may step the aligned masters as one tensor.

    Returns:
        The segments in buffer order, and the number of elements of the flat tensor (0
        without ``flatten`` or when no segment is aligned).
    """
    def aligned(shape: torch.Size) -> bool:
        return flatten and shape.numel() > 0 and shape.numel() % CUT_ALIGN_ELEMENTS == 0

    ordered = [e for e in entries if aligned(e[1])] + [e for e in entries if not aligned(e[1])]
    segments, offset = [], 0
    for index, shape in ordered:
        segments.append(Segment(index, offset, shape, shape.numel(), aligned(shape)))
        offset += shape.numel()
    return segments, sum(s.numel for s in segments if s.in_flat)


def compact_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every tensor that is a view of a larger storage (a flat buffer of an
    earlier plan) copied, so that keeping it does not keep the whole buffer alive."""
    return {k: compact(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


class FlatGroup:
    """The masters of one param group on one device, in one buffer (Note [flat masters]).

    How it works: :attr:`data` holds every master, :attr:`masters` are views of it, and
    :attr:`flat` (when some segment is aligned) is the view over the aligned ones that the
    wrapped optimizer steps while :attr:`layout` is ``FLAT``; it steps the others as
    :attr:`stepped`. Gradients go to segments of a second buffer, allocated by the first
    :meth:`take_grads` and freed by :meth:`free_grads`; :meth:`point_step_grads` hands them to
    the stepped tensors and :meth:`end_step` takes them back. The buffer's values are
    uninitialised until the owner fills the masters.

    Args:
        number: the param group's position in ``OSS.param_groups``.
        device: where the masters live (their parameters' device).
        dtype: the master dtype.
        entries: ``(index, shape)`` of each master, in parameter order.
        flatten: whether the optimizer updates element by element (may step a flat tensor).
        host: the buffers are offloaded host memory (Note [offloaded masters] in
            :mod:`shardopt.optim.masters`): pinned when ``pin`` (the parameters are on a
            GPU), and the gradient buffer is kept between steps instead of being freed.
        pin: allocate the buffers in pinned (page-locked) host memory.
        copies: with ``host``, the copies from the device that :meth:`add_grad` goes through
            (Note [offload copies on a side stream] in :mod:`shardopt.optim.offload_copies`).
    """

    def __init__(self, number: int, device: torch.device, dtype: torch.dtype,
                 entries: Sequence[tuple[int, torch.Size]], flatten: bool, host: bool = False,
                 pin: bool = False, copies: OffloadCopies | None = None) -> None:
        self.number = number
        segments, flat_numel = plan_segments(entries, flatten)
        self.segments: dict[int, Segment] = {s.index: s for s in segments}
        """Each master's segment, by parameter index."""
        self.host = host
        """Whether the buffers are offloaded host memory whose gradient buffer outlives a step."""
        self._pin = pin
        self._copies = copies
        self.data = self._empty(sum(s.numel for s in segments), device, dtype, MASTERS_SLOT)
        """The buffer holding every master of the group."""
        self.masters: dict[int, torch.Tensor] = {
            s.index: self.data[s.offset : s.offset + s.numel].view(s.shape).requires_grad_(True) for s in segments}
        """Each master (a leaf view of :attr:`data`), by parameter index."""
        self.flat: torch.Tensor | None = self.data[:flat_numel].requires_grad_(True) if flat_numel else None
        """The view over the aligned segments, or ``None`` when there are none."""
        self.stepped: dict[int, torch.Tensor] = self.masters if not host else {
            s.index: self.data[s.offset : s.offset + s.numel].view(s.shape).requires_grad_(True) for s in segments}
        """What the wrapped optimizer steps for each master outside :attr:`flat`: the master itself, or in host
        memory a second leaf view of its segment, whose ``.grad`` only a step sets (Note [delayed update] in
        :mod:`shardopt.optim.delayed_update`)."""
        self.layout = Layout.FLAT if self.flat is not None else Layout.VIEWS
        self._grad: torch.Tensor | None = None
        self._slots: dict[int, torch.Tensor] = {}
        self._step_grad: torch.Tensor | None = None  # the step's own copy of _grad (Note [delayed update])
        self._staging: torch.Tensor | None = None  # accumulations' landing place (Note [offload copies on a side stream])
        self._staged_slots: dict[int, torch.Tensor] = {}
        self._rounded: dict[torch.dtype, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}  # uploads' sources (4)

    def _empty(self, numel: int, device: torch.device, dtype: torch.dtype, slot: int) -> torch.Tensor:
        """A buffer of the group: in pageable host memory placed for the host step (Note [host
        buffer placement] in :mod:`shardopt.host_memory`), else torch's (pinned when asked)."""
        if device.type == "cpu" and not self._pin:
            return host_empty(numel, dtype, slot)
        return torch.empty(numel, device=device, dtype=dtype, pin_memory=self._pin)

    @property
    def flat_members(self) -> list[int]:
        """The indices whose segments make up :attr:`flat`, in buffer order."""
        return [s.index for s in self.segments.values() if s.in_flat]

    def use(self, layout: Layout) -> None:
        """Step the aligned masters as ``layout`` from now on (the caller moves the state and
        rebuilds the optimizer's parameter lists)."""
        assert self.flat is not None or layout is Layout.VIEWS, "a group without aligned masters has no flat tensor"
        if layout is Layout.VIEWS and self.flat is not None:
            self.flat.grad = None
        self.layout = layout

    @property
    def grad_buffer(self) -> torch.Tensor | None:
        """The masters' gradient buffer while it exists (an offloaded group keeps it between steps)."""
        return self._grad

    @property
    def step_grad_buffer(self) -> torch.Tensor | None:
        """The copy of :attr:`grad_buffer` a delayed step reads, once one ran (Note [delayed update])."""
        return self._step_grad

    def host_buffers(self) -> list[torch.Tensor]:
        """The buffers of an offloaded group that exist now: the masters, their gradients, the
        delayed step's copy of those, the staging buffer of accumulations and the buffers the
        masters are rounded into before their upload (Note [offload copies on a side stream] in
        :mod:`shardopt.optim.offload_copies`, 2 and 4); ``[]`` on the device."""
        if not self.host:
            return []
        rounded = [buffer for buffer, _ in self._rounded.values()]
        return [t for t in (self.data, self._grad, self._step_grad, self._staging, *rounded) if t is not None]

    def stepped_flat(self, index: int) -> bool:
        """Whether the optimizer steps ``params[index]``'s master as part of :attr:`flat` now."""
        return self.layout is Layout.FLAT and self.segments[index].in_flat

    # ------------------------------------------------------------------ gradients

    def _slots_now(self) -> dict[int, torch.Tensor]:
        """Each master's view of the gradient buffer (allocating the buffer and the views)."""
        if self._grad is None:
            self._grad = self._empty(self.data.numel(), self.data.device, self.data.dtype, GRADS_SLOT)
            pieces = self._grad.split_with_sizes([s.numel for s in self.segments.values()])
            self._slots = {s.index: piece if piece.shape == s.shape else piece.view(s.shape)
                           for s, piece in zip(self.segments.values(), pieces, strict=True)}
        return self._slots

    def has_grad(self, index: int) -> bool:
        """Whether ``params[index]``'s master has a gradient, in its segment of the buffer."""
        grad = self.masters[index].grad
        return grad is not None and grad is self._slots.get(index)

    def take_grads(self, fresh: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Give the masters ``fresh`` gradients (``(index, gradient)``, for masters that have
        none; cast exactly to the master dtype) in one foreach copy, and move every gradient a
        master holds outside the buffer (ShardedDataParallel's reduced sum) into it. Call
        under ``torch.no_grad()``."""
        if not fresh and all(m.grad is None for m in self.masters.values()):
            return
        slots = self._slots_now()
        if fresh:
            torch._foreach_copy_([slots[i] for i, _ in fresh], [g for _, g in fresh])
            for i, _ in fresh:
                self.masters[i].grad = slots[i]
        for i, master in self.masters.items():
            grad = master.grad
            if grad is not None and grad is not slots[i]:
                master.grad = slots[i].copy_(grad)  # the old tensor is freed here

    def add_grad(self, index: int, grad: torch.Tensor) -> None:
        """Add ``grad`` (of the master's shape, any dtype and device) to ``params[index]``'s
        master gradient in its segment of the buffer: one copy (cast, and to the host for an
        offloaded group) where the master has none yet. For an offloaded group of CUDA
        parameters the copy to the host is asynchronous, and so is an addition to a gradient
        already there (through the staging buffer): the host reads neither before the copies
        land (Note [offload copies on a side stream] in :mod:`shardopt.optim.offload_copies`).
        Call under ``torch.no_grad()``."""
        master, slot = self.masters[index], self._slots_now()[index]
        copies = self._copies
        if master.grad is None:
            master.grad = slot
            if copies is None:
                slot.copy_(grad)
            else:
                casts = grad.dtype != slot.dtype and copies.overlaps(grad.device)
                copies.download(master, slot, grad, self._cast_buffer(grad) if casts else None)
        elif copies is not None and copies.overlaps(grad.device) and master.grad.device == self.data.device:
            copies.download_to_add(master, grad, self._staging_slot(index, grad))  # added on the host once landed
        elif master.grad is slot:
            slot.add_(grad.to(slot.device))
        else:  # a gradient put there from outside: it moves into the buffer at the step (take_grads)
            master.grad.add_(grad.to(master.grad.device))

    def _downloads_overlap(self, device: torch.device) -> bool:
        """Whether a gradient from ``device`` comes to this (offloaded) group on a copy stream (Note
        [offload copies on a side stream] in :mod:`shardopt.optim.offload_copies`)."""
        return self._copies is not None and self._copies.overlaps(device)

    def add_grads(self, grads: Sequence[tuple[int, torch.Tensor]]) -> None:
        """:meth:`add_grad` of each ``(index, gradient)`` in turn (ShardedDataParallel's reduced
        gradients), but one copy into the buffer (or one addition to it) for each run of them that
        lies end to end both in one source storage and in the buffer (Note [one copy per bucket]).
        Call under ``torch.no_grad()``."""
        run: list[tuple[int, torch.Tensor]] = []
        kind: str | None = None
        for index, grad in grads:
            if grad.dtype != self.data.dtype and self._downloads_overlap(grad.device):
                # Widened on the device (Note [one rank passes gradients through] in reduction_queue): one
                # landing as a cast on the host would make the next backward pass of an accumulation wait there.
                grad = grad.to(self.data.dtype)
            joins = self._joins_runs(index, grad)
            if run and (joins != kind or not self._follows(run[-1], index, grad)):
                self._add_run(run, kind)
                run = []
            if joins is None:
                self.add_grad(index, grad)
            else:
                run.append((index, grad))
                kind = joins
        if run:
            self._add_run(run, kind)

    def _joins_runs(self, index: int, grad: torch.Tensor) -> str | None:
        """How ``grad`` for ``params[index]`` may share one operation with its neighbours: ``"copy"``
        (the master has no gradient yet), ``"add"`` (it has one in its segment, added to
        synchronously), or ``None`` (a cast, a gradient put elsewhere, a staged addition)."""
        if grad.dtype != self.data.dtype or not grad.is_contiguous():
            return None
        master = self.masters[index]
        if master.grad is None:
            return "copy"
        if self.has_grad(index) and not self._downloads_overlap(grad.device):
            return "add"
        return None

    def _follows(self, last: tuple[int, torch.Tensor], index: int, grad: torch.Tensor) -> bool:
        """Whether ``grad`` for ``params[index]`` starts where ``last`` ends, in its storage and in the buffer."""
        last_index, last_grad = last
        before, segment = self.segments[last_index], self.segments[index]
        return (before.offset + before.numel == segment.offset and grad.device == last_grad.device
                and grad.storage_offset() == last_grad.storage_offset() + last_grad.numel()
                and grad.untyped_storage().data_ptr() == last_grad.untyped_storage().data_ptr())

    def _add_run(self, run: Sequence[tuple[int, torch.Tensor]], kind: str | None) -> None:
        """Copy (``kind == "copy"``) or add the gradients of ``run`` into their segments in one operation."""
        if len(run) == 1:
            self.add_grad(*run[0])
            return
        first_index, first = run[0]
        numel = sum(grad.numel() for _, grad in run)
        slots = self._slots_now()
        assert self._grad is not None
        start = self.segments[first_index].offset
        target = self._grad[start : start + numel]
        source = first.as_strided((numel,), (1,), first.storage_offset())  # the run, end to end (_follows)
        if kind == "add":
            target.add_(source.to(target.device))  # each element rounds once, as in its own addition
            return
        for index, _ in run:
            self.masters[index].grad = slots[index]
        if self._copies is None:
            target.copy_(source)
        else:
            self._copies.download_run([slots[index] for index, _ in run], target, source)

    def _staging_slot(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """Where ``grad`` for ``params[index]`` lands before it is added: the master's segment of the
        staging buffer (allocated at the first use, kept), or, for a gradient in another dtype than
        the masters', a tensor of its own, so that the addition rounds once, as the blocking one."""
        if grad.dtype != self.data.dtype:
            return self._cast_buffer(grad)
        if self._staging is None:
            self._staging = torch.empty(self.data.shape, dtype=self.data.dtype, device=self.data.device,
                                        pin_memory=self._pin)
            pieces = self._staging.split_with_sizes([s.numel for s in self.segments.values()])
            self._staged_slots = {s.index: piece.view(s.shape)
                                  for s, piece in zip(self.segments.values(), pieces, strict=True)}
        return self._staged_slots[index]

    def _cast_buffer(self, grad: torch.Tensor) -> torch.Tensor:
        """A host tensor of ``grad``'s shape and dtype (pinned with the buffers) that a gradient in
        another dtype than the masters' lands in before it is cast on the host (Note [offload
        copies on a side stream] in :mod:`shardopt.optim.offload_copies`, 1)."""
        return torch.empty(grad.shape, dtype=grad.dtype, device=self.data.device, pin_memory=self._pin)

    def upload_source(self, index: int, dtype: torch.dtype) -> torch.Tensor:
        """Where ``params[index]``'s master is rounded to ``dtype`` (its parameter's) on the host
        before its upload: its segment of a host buffer of the group in ``dtype`` (pinned with the
        buffers), allocated at the first use and kept, so that the copy to the device moves the
        parameter's bytes without a cast (Note [offload copies on a side stream] in
        :mod:`shardopt.optim.offload_copies`, 4). One buffer per dtype asked for: one in a bf16 or
        fp16 model; a mirror's segment in it stays unused."""
        found = self._rounded.get(dtype)
        if found is None:
            buffer = torch.empty(self.data.shape, dtype=dtype, device=self.data.device, pin_memory=self._pin)
            pieces = buffer.split_with_sizes([s.numel for s in self.segments.values()])
            found = self._rounded[dtype] = (buffer, {s.index: piece.view(s.shape)
                                                     for s, piece in zip(self.segments.values(), pieces, strict=True)})
        return found[1][index]

    def choose_layout(self) -> bool:
        """Keep stepping :attr:`flat` when every aligned master has a gradient (or none has);
        switch to ``VIEWS`` when only some do (Note [flat state falls back to views]).

        Returns:
            Whether the layout switched (the optimizer's state and parameter lists must follow).
        """
        if self.flat is None or self.layout is Layout.VIEWS:
            return False
        present = [self.has_grad(i) for i in self.flat_members]
        if all(present) or not any(present):
            return False
        logger.info("param group %s: %d of %d masters have no gradient this step; stepping them as views from now on "
                    "(Note [flat state falls back to views])", self.number, present.count(False), len(present))
        self.use(Layout.VIEWS)
        return True

    def point_step_grads(self, own_buffer: bool) -> None:
        """Give what the optimizer steps the masters' gradients, after :meth:`choose_layout`:
        :attr:`flat` the head of the buffer, each :attr:`stepped` view its segment. With
        ``own_buffer`` (an offloaded group) they get a copy of the buffer that nothing else
        writes, so the masters' gradients may change during the step (Note [delayed update]
        in :mod:`shardopt.optim.delayed_update`). Call under ``torch.no_grad()``."""
        assert self.host or not own_buffer, "only an offloaded group steps in the background"
        present = {i for i in self.masters if self.has_grad(i)}
        if not present:
            return
        assert self._grad is not None
        source, slots = self._grad, self._slots
        if own_buffer:
            if self._step_grad is None:
                self._step_grad = self._empty(self._grad.numel(), self._grad.device, self._grad.dtype, STEP_GRADS_SLOT)
            source = self._step_grad.copy_(self._grad)
            pieces = source.split_with_sizes([s.numel for s in self.segments.values()])
            slots = {s.index: piece.view(s.shape) for s, piece in zip(self.segments.values(), pieces, strict=True)}
        flat_members = set(self.flat_members) if self.layout is Layout.FLAT else set()
        if self.flat is not None and flat_members and flat_members <= present:
            self.flat.grad = source[: self.flat.numel()]
        for i in present - flat_members:
            self.stepped[i].grad = slots[i]

    def end_step(self) -> None:
        """Take the gradients :meth:`point_step_grads` gave back from the stepped tensors (the
        masters' own stay: :meth:`free_grads` drops those)."""
        if self.flat is not None:
            self.flat.grad = None
        if self.stepped is not self.masters:
            for tensor in self.stepped.values():
                tensor.grad = None

    def free_grads(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Drop every master's gradient but those of ``keep`` (offloaded mirrors: Note [mirrors
        carry gradients] in :mod:`shardopt.optim.masters`), and the gradient buffer unless it is
        offloaded host memory (allocating and first touching it is most of a host step's
        overhead: Note [offloaded masters] there)."""
        assert self.host or not keep, "only an offloaded group keeps gradients across a step"
        for i, master in self.masters.items():
            if i not in keep:
                master.grad = None
        if not self.host:
            self._grad = None
            self._slots = {}

    # ------------------------------------------------------------------ optimizer state

    def split_state(self, state: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
        """The flat tensor's optimizer ``state`` cut into one entry per aligned master: its
        elementwise tensors as views of the master's segment, other tensors (``step``) copied
        per master, other values shared (Note [flat masters])."""
        assert self.flat is not None
        n = self.flat.numel()
        out: dict[int, dict[str, Any]] = {}
        for index in self.flat_members:
            s = self.segments[index]
            out[index] = {k: (v[s.offset : s.offset + s.numel].view(s.shape) if v.shape == (n,) else v.clone())
                          if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        return out

    def join_states(self, states: Mapping[int, Mapping[str, Any]]) -> dict[str, Any] | None:
        """The flat tensor's state from one entry per aligned master, or ``None`` when they do
        not agree (Note [flat state falls back to views]): ``{}`` when none has any.

        Elementwise tensors (of the master's shape, one dtype and device for all) are
        concatenated; every other entry must be equal for all (one host read per tensor name).
        """
        entries = [states.get(i, {}) for i in self.flat_members]
        if not any(entries):
            return {}
        if not all(entries) or any(e.keys() != entries[0].keys() for e in entries):
            return None
        joined: dict[str, Any] = {}
        for name, first in entries[0].items():
            values = [e[name] for e in entries]
            shapes = [self.segments[i].shape for i in self.flat_members]
            if all(isinstance(v, torch.Tensor) and v.shape == shape for v, shape in zip(values, shapes, strict=True)):
                if len({(v.dtype, v.device) for v in values}) != 1:
                    return None
                joined[name] = torch.cat([v.reshape(-1) for v in values])
            elif isinstance(first, torch.Tensor):
                if not all(isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype
                           and v.device == first.device for v in values):
                    return None
                if not bool((torch.stack(values) == first).all()):  # host-read: at a build or load only
                    return None
                joined[name] = first.clone()
            elif any(isinstance(v, torch.Tensor) or v != first for v in values):
                return None
            else:
                joined[name] = first
        return joined

    def place_state(self, optim_state: dict[torch.Tensor, Any]) -> None:
        """Move :attr:`flat`'s entry of ``optim_state`` (the wrapped optimizer's) into host
        buffers placed for the host step, when it is in host memory and not there yet (Note
        [host buffer placement] in :mod:`shardopt.host_memory`). A few checks when placed."""
        if self.flat is not None and self.layout is Layout.FLAT and self.data.device.type == "cpu":
            entry = optim_state.get(self.flat)
            if entry:
                place_state(entry, self.flat, STATE_SLOT)

    def to_views(self, optim_state: dict[torch.Tensor, Any]) -> None:
        """Switch to ``VIEWS``: the flat tensor's entry of ``optim_state`` (the wrapped
        optimizer's) becomes one entry per aligned master, on its view."""
        assert self.flat is not None
        flat_state = optim_state.pop(self.flat, None)
        if flat_state:
            for index, entry in self.split_state(flat_state).items():
                optim_state[self.stepped[index]] = entry
        self.use(Layout.VIEWS)
