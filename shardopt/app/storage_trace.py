"""Live and peak bytes of tensor storages on one device, op by op, for ``shardopt rehearse``.

:class:`StorageTracker` is a ``TorchDispatchMode``: while it is entered, every ATen operator
the thread runs (forward, backward, the optimizer, the wrappers' own copies, the allocations
torch's C++ makes through the dispatcher, such as DDP's reducer buckets) passes through it,
and every tensor the operator returns has its storage counted once, at its current size.
Note [tracking storages] says what that counts and what it does not.

On the CPU this is how ``shardopt rehearse`` measures "device memory": torch 2.13 keeps no
statistics for its CPU allocator (no ``memory_allocated`` for the CPU), ``tracemalloc`` sees
only Python's own allocations, and glibc's ``mallinfo2()`` (what
:func:`shardopt.memory.heap_bytes` reads) can only be sampled between operators, so a peak
inside a backward pass is missed. On a GPU the tracker runs too (it splits the peak into
categories) and ``torch.cuda.max_memory_allocated`` is read beside it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StorageTracker", "storage_key"]

# Note [tracking storages]
# What is counted: the storages of tensors on the tracked device type that an operator
# returns while the tracker is entered, each once (views share their base's storage), at its
# current size, from the operator that returns it until the storage is freed. A storage's
# death is seen exactly: torch keeps one Python object per storage for the storage's whole
# life (PyObject preservation), so a weak reference to it dies with the C++ storage, whichever
# thread drops the last reference. Resizing a storage in place (UntypedStorage.resize_, which
# FSDP uses to free and re-allocate its full parameter buffer, and shardopt.comm.release_storage)
# does not pass through the dispatcher, so the tracker wraps UntypedStorage.resize_ while it
# is entered; each resize is an event like an operator.
# What is not counted: scratch memory an operator allocates and frees inside its own kernel
# (the peak is taken between operators, with every input and output of the operator alive;
# a GPU's max_memory_allocated also sees the scratch), allocations on other threads (gloo's
# worker threads), and storages made before the tracker was entered (the baseline).
# Counted events: each operator and each resize increments `events`; a probe registered for
# event k runs right after that event (Note [the peak, replayed] in shardopt.app.rehearse).


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage among live storages (its C++ address)."""
    return int(tensor.untyped_storage()._cdata)


class StorageTracker(TorchDispatchMode):
    """Count the live bytes of storages on ``device_type`` op by op, with the peak.

    How it works: Note [tracking storages]. Enter it with ``with tracker:``; nesting two
    trackers is refused. Storages handed to a ``c10d`` operator (a collective, a send or a
    receive) are remembered as communication buffers while they live (:attr:`comm_keys`).

    Args:
        device_type: ``"cpu"`` or ``"cuda"``.

    Attributes:
        events: operators and resizes seen so far.
        peak_bytes: the most live bytes seen since :meth:`reset_peak`.
        peak_event: the event at which :attr:`peak_bytes` was reached.
        peak_label: :attr:`label` when the peak was reached.
        label: a phase name the caller sets (``"forward"``, ``"backward"``, ...), kept with the peak.
    """

    _active: StorageTracker | None = None

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.events = 0
        self.peak_bytes = 0
        self.peak_event = 0
        self.peak_label = ""
        self.label = ""
        self._live: dict[int, int] = {}
        self._born: dict[int, int] = {}
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._comm: set[int] = set()
        self.comm_births: list[int] = []
        """The birth event of every storage when it was first handed to a ``c10d`` operator."""
        self._total = 0
        self._lock = threading.RLock()
        self._probe: tuple[int, Callable[[], None]] | None = None
        self._saved_resize: Any = None
        self._own_resize = False

    # ------------------------------------------------------------------ reading
    @property
    def live_bytes(self) -> int:
        """Bytes of the tracked storages alive now."""
        return self._total

    def live(self) -> dict[int, int]:
        """``{storage key: bytes}`` of every tracked storage alive now (a copy)."""
        with self._lock:
            return dict(self._live)

    def born(self, key: int) -> int:
        """The event at which the live storage ``key`` was first seen."""
        return self._born[key]

    @property
    def comm_keys(self) -> frozenset[int]:
        """Keys of live storages that have been handed to a ``c10d`` operator."""
        with self._lock:
            return frozenset(self._comm)

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak_bytes, self.peak_event, self.peak_label = self._total, self.events, self.label

    def probe_at(self, event: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once, right after event number ``event`` (an operator or a resize).

        The callback runs inside the dispatch of that operator with the tracker paused (it
        may read tensors' attributes; operators it runs are not counted).
        """
        self._probe = (event, callback)

    # ------------------------------------------------------------------ counting
    def _see(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device_type or tensor.layout != torch.strided:
            return
        self._see_storage(tensor.untyped_storage())

    def _see_storage(self, storage: Any) -> None:
        key, nbytes = int(storage._cdata), int(storage.nbytes())
        with self._lock:
            old = self._live.get(key)
            if old is None:
                self._refs[key] = weakref.ref(storage, self._on_death(key))
                self._born[key] = self.events
                self._live[key] = nbytes
                self._total += nbytes
            elif old != nbytes:
                self._live[key] = nbytes
                self._total += nbytes - old
            if self._total > self.peak_bytes:
                self.peak_bytes, self.peak_event, self.peak_label = self._total, self.events, self.label

    def _on_death(self, key: int) -> Callable[[Any], None]:
        def dead(_ref: Any) -> None:
            self._dead(key)

        return dead

    def _dead(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, None)
            if nbytes is not None:
                self._total -= nbytes
            self._refs.pop(key, None)
            self._born.pop(key, None)
            self._comm.discard(key)

    def _after_event(self) -> None:
        probe = self._probe
        if probe is not None and probe[0] == self.events:
            self._probe = None
            probe[1]()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.events += 1
        if func.namespace == "c10d":
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                    self._see(t)
                    with self._lock:
                        key = storage_key(t)
                        if key in self._live and key not in self._comm:
                            self._comm.add(key)
                            self.comm_births.append(self._born[key])
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t)
        self._after_event()
        return out

    def _resize(self, storage: Any, nbytes: int) -> Any:
        was = int(storage.nbytes())
        result = self._saved_resize(storage, nbytes)
        if storage.device.type == self.device_type:
            self.events += 1
            with self._lock:
                tracked = int(storage._cdata) in self._live
            if tracked or was == 0:  # an untracked storage of the baseline shrinking frees nothing counted
                self._see_storage(storage)
            self._after_event()
        return result

    def __enter__(self) -> StorageTracker:  # noqa: PYI034 - a TorchDispatchMode subclass, entered as itself
        if StorageTracker._active is not None:
            raise RuntimeError("a StorageTracker is already entered in this process; leave it before entering another")
        StorageTracker._active = self
        self._saved_resize = torch.UntypedStorage.resize_
        self._own_resize = "resize_" in torch.UntypedStorage.__dict__
        tracker = self

        def resize_(storage: Any, nbytes: int) -> Any:
            return tracker._resize(storage, nbytes)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._own_resize:
                torch.UntypedStorage.resize_ = self._saved_resize  # type: ignore[method-assign]
            else:
                del torch.UntypedStorage.resize_
            StorageTracker._active = None
