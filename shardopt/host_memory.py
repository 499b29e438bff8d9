"""Host buffers laid out for the host step: on transparent huge pages, at staggered offsets.

Note [host buffer placement]
A host optimizer step (ZeRO-Offload's, or any step over flat fp32 masters on a CPU) streams
a few long arrays in lockstep: Adam reads the masters, their gradients and both moments and
writes three of them back, 28 bytes per element, so it runs at the memory's speed and pays
for every stall of the memory pipeline. Two stalls come from where the arrays sit, not from
the kernel:

- *TLB misses.* On 4 KiB pages a 50M-element step walks the page tables for 340,000 pages.
  Linux backs a region with 2 MiB pages (transparent huge pages) when it is advised to
  (``madvise(MADV_HUGEPAGE)``, the kernel's default ``madvise`` mode) before it is first
  touched; torch's CPU allocator only does so under ``THP_MEM_ALLOC_ENABLE=1`` set before
  torch starts.
- *4 KiB aliasing.* Large allocations come straight from ``mmap``, so every array starts at
  the same offset within a page (torch's are at 64 bytes past a page boundary). A load whose
  address equals an earlier, still pending store's in the low 12 bits waits for it, and
  streams that start at equal offsets make that happen at every element.

So :func:`host_empty` maps each large buffer anonymously, advises huge pages on its 2 MiB
aligned part before anything touches it, and starts the tensor at its own *slot's* offset
within a 4 KiB page (masters, gradients and each state tensor get different slots: Note
[flat masters] in :mod:`shardopt.optim.flat_masters` says which), and
:func:`place_state` moves a flat tensor's optimizer state, which torch allocates itself, into
such buffers once. Measured on the project's CPU machine (2-core Xeon, AVX-512, 50M fp32
elements, torch's fused Adam, 2 threads; ``scripts/bench_host_step.py``): staggered offsets
alone 0.92x the step time of torch's own allocations, huge pages alone 0.83x, both 0.75x.
Nothing about the values changes (same kernels, same element order), so a placed step is
bit for bit the unplaced one.

The tensor's storage is exactly its bytes (the mapping's slack is address space that is never
touched, so never resident) and lives as long as any view of it; it is created through an
aten view, so dispatch modes (``shardopt rehearse``'s storage tracker) count it as torch's own,
and :func:`placed_bytes` counts it for :func:`shardopt.memory.heap_bytes`, as malloc counts
torch's own allocations.
Pinned (page-locked) buffers for a GPU keep torch's pinned allocator: :func:`host_empty` is
for pageable memory only. Without ``mmap.MADV_HUGEPAGE`` (not Linux) the offsets still
apply; with the kernel's THP mode ``never`` the advice is a no-op.
"""

from __future__ import annotations

import mmap
import weakref
from collections.abc import MutableMapping
from typing import Any

import torch

__all__ = ["HUGE_PAGE", "MIN_PLACED_BYTES", "SLOT_OFFSETS", "host_empty", "is_placed", "place_state", "placed_bytes"]

HUGE_PAGE = 2 << 20
"""The transparent huge page size of x86-64 and most aarch64 kernels (bytes)."""
MIN_PLACED_BYTES = 1 << 20
"""Buffers smaller than this come from torch's allocator (no huge page fits; nothing to gain)."""
SLOT_OFFSETS = (0, 1024, 2048, 3072, 512, 1536, 2560, 3584)
"""Each slot's offset within a 4 KiB page (bytes): slot ``k`` starts at ``SLOT_OFFSETS[k % 8]``."""

_placed: dict[int, int] = {}  # the live placed buffers: the address of the first element -> bytes


def _release(address: int) -> None:
    _placed.pop(address, None)


def placed_bytes() -> int:
    """The bytes of every live :func:`host_empty` buffer of this process: memory that glibc's
    ``mallinfo2`` does not see (:func:`shardopt.memory.heap_bytes` adds it)."""
    return sum(_placed.values())


def host_empty(numel: int, dtype: torch.dtype, slot: int) -> torch.Tensor:
    """An uninitialised 1-D pageable CPU tensor of ``numel`` elements for a host step's stream.

    How it works: Note [host buffer placement]. Buffers under :data:`MIN_PLACED_BYTES` are
    plain ``torch.empty``.

    Args:
        numel: the number of elements.
        dtype: the element type.
        slot: which offset within a 4 KiB page the buffer starts at (:data:`SLOT_OFFSETS`);
            give the arrays one step streams together different slots.
    """
    nbytes = numel * dtype.itemsize
    if numel == 0 or nbytes < MIN_PLACED_BYTES or not hasattr(mmap, "MAP_PRIVATE"):  # small, or not POSIX
        return torch.empty(numel, dtype=dtype)
    offset = SLOT_OFFSETS[slot % len(SLOT_OFFSETS)]
    # private: a shared anonymous mapping is shmem, which huge pages back only under shmem_enabled
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE + offset, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    head = -start % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    whole = (nbytes + offset) // HUGE_PAGE * HUGE_PAGE  # the huge pages inside the buffer
    if advice is not None and whole:
        mapping.madvise(advice, head, whole)
    # frombuffer keeps the mapping alive as long as the storage; the view passes through the dispatcher
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=head + offset).view(numel)
    address = tensor.data_ptr()
    _placed[address] = nbytes
    weakref.finalize(tensor.untyped_storage(), _release, address)
    return tensor


def is_placed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` starts a live :func:`host_empty` buffer (of at least :data:`MIN_PLACED_BYTES`)."""
    return tensor.device.type == "cpu" and tensor.storage_offset() == 0 and tensor.data_ptr() in _placed


def place_state(state: MutableMapping[str, Any], like: torch.Tensor, first_slot: int) -> None:
    """Move each tensor of ``state`` (one parameter's optimizer state) shaped as ``like`` into a
    :func:`host_empty` buffer of its own slot, ``first_slot`` for the first such entry and so on,
    unless it is in one already: one copy each, once (Note [host buffer placement]).

    The values do not change. While a tensor is moved it exists twice, so the host holds one
    state tensor more for a moment, once.
    """
    slot = first_slot
    for name, value in list(state.items()):
        if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.device.type != "cpu":
            continue
        if not is_placed(value) and value.numel() * value.element_size() >= MIN_PLACED_BYTES:
            placed = host_empty(value.numel(), value.dtype, slot).view(value.shape)
            state[name] = placed.copy_(value)
        slot += 1
