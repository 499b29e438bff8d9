"""Stream operations behind one small interface, for every side stream shardopt runs work on:
ZeRO-2's reductions (Note [reductions on a side stream] in
:mod:`shardopt.nn.data_parallel.streams`) and the offloaded optimizer's host<->device copies
(Note [offload copies on a side stream] in :mod:`shardopt.optim.offload_copies`).

Code that may run on a GPU routes every stream operation, and every copy meant to overlap,
through a :class:`StreamOps` chosen once (``CudaStreams`` for CUDA tensors, else
``HostStreams``, where everything runs in host order and costs nothing). Tests put a recorder
in its place to check the order of records, waits and copies on CPU ranks, without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CudaStreams", "HostStreams", "StreamOps"]


class StreamOps:
    """The stream operations; the base does nothing but copy (host order).

    ``side`` is the side stream the caller runs work on, ``None`` where there is none (then
    every operation is a no-op and copies are synchronous).
    """

    side: Any = None

    def current(self) -> Any:
        """The stream current in the caller (autograd's compute stream in a hook)."""
        return None

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        """Make ``waiter`` wait for all work queued on ``waitee`` so far."""

    def record_event(self, stream: Any) -> Any:
        """An event marking the work queued on ``stream`` so far."""
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event``."""

    def host_wait(self, event: Any) -> None:
        """Block the host until ``event`` has completed (on a GPU a host sync: callers say why)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` on the current stream: in host order here, without waiting
        for the device on CUDA (pinned host memory on the host side)."""
        dst.copy_(src)

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        """Make ``stream`` current inside the block."""
        yield


class HostStreams(StreamOps):
    """CPU tensors, or gloo: work completes on the host, so there is nothing to order."""


class CudaStreams(StreamOps):
    """A side stream on ``device``.

    Args:
        device: the CUDA device.
        priority: the side stream's priority (lower runs first; -1 is high, 0 the default).
    """

    def __init__(self, device: torch.device, priority: int = 0) -> None:
        self._device = device
        self.side = torch.cuda.Stream(device=device, priority=priority)

    def current(self) -> Any:
        return torch.cuda.current_stream(self._device)

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        waiter.wait_stream(waitee)

    def record_event(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def host_wait(self, event: Any) -> None:
        event.synchronize()  # host-read: the callers' documented waits (StreamOps.host_wait)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield
