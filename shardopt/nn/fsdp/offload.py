"""CPU offload of FSDP units (``CPUOffload(offload_params=True)``): the host side of a
unit's shard (:class:`HostShard`) and a reduced gradient shard on its way to host memory
(:class:`PendingDownload`).

Note [offloaded shards]
With ``offload_params=True`` a unit's shard (this rank's rows of its parameters in their
original dtype, Note [flat parameter layout]) is a host tensor, so the original parameters
are host views between steps and the optimizer, its state and the sharded gradients it
reads are on the CPU, as with torch FSDP1's ``CPUOffload``. The compute device (the module's
device at wrap time) keeps what a step computes with: the gathered parameters, the
gradients of a backward before they are reduced (also ``no_sync``'s accumulated ones) and
the reduction's buffers. The shard is never the full buffer (without offload, one rank in
the master dtype uses the shard as the full buffer), so every transfer below is a real copy
into a tensor of its own, also on a CPU-only machine, where host and compute device are
both the CPU. The arithmetic is the one without offload: the same cast, reduction and
accumulation, in the same dtypes and order, so offloaded training on the CPU equals it bit
for bit.

* upload (:meth:`HostShard.upload`): before a unit's all-gather (and before the gathers of
  ``summon_full_params``) the shard is copied into a new compute-device buffer; the cast to
  ``param_dtype`` then runs on the device, as without offload;
* download (:meth:`HostShard.download`): after the reduction (and the replicas'
  all-reduce), the reduced gradient shard, cast to the master dtype unless
  ``keep_low_precision_grads``, is copied into a new host tensor, and each trainable
  parameter's rows of it become its ``.grad``, or are added to the ``.grad`` already there
  (accumulation across backwards without ``no_sync``), when the record lands
  (:meth:`PendingDownload.land`). The step context lands every download at the end of
  backward, in the order they were made.

On CUDA the host tensors are pinned and the copies asynchronous. Uploads are
``non_blocking`` copies on the current stream ``S0``, before the all-gather that reads
them; an event marks the last one. Downloads run on a side stream ``D`` of the unit:
``D.wait_stream(S0)``, the copy, an event ``done``. The device buffer the copy reads stays
referenced by the record until ``S0`` has waited for ``done`` (when the next download is
made: :meth:`PendingDownload.release_source`) or the host has (when it lands), so no block
returns to the allocator while ``D`` may still read it, without ``record_stream``. Landing
makes the host wait for ``done`` (``Event.synchronize``, every record in turn, so in effect
until the last copy is done): the one host wait per backward that offloading needs, since
the optimizer reads the gradients on the host next (torch FSDP1 synchronises its stream
there). It covers every upload queued before the last download; uploads after it (a frozen
unit's) are waited for there too (:meth:`HostShard.settle`). Other accelerators, and the CPU, copy synchronously.

A host write to the shard while an upload may still read it would race: after a backward
(landed) nothing is pending, :meth:`HostShard.settle` runs before ``load_sharded_state_dict``
writes the shards, and ``summon_full_params``'s write-back copies are blocking. What remains
is the caller's: after a forward without a backward, synchronise before writing to the
parameters in place (as with torch FSDP1).

Uploads stay on ``S0`` because the unit issues its all-gathers from ``S0`` (the gather waits
for the copy either way); a side stream for them would overlap nothing until the all-gathers
move to one too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["HostShard", "PendingDownload", "land_grad"]


def land_grad(param: nn.Parameter, piece: torch.Tensor) -> None:
    """Give ``param`` its rows ``piece`` of a reduced gradient shard: the piece itself when
    it has no gradient, else added to the one it has (accumulation without ``no_sync``)."""
    if param.grad is None:
        if piece.dtype != param.dtype:
            param.grad_dtype = None  # keep_low_precision_grads: a grad of another dtype, on purpose
        param.grad = piece
    else:
        param.grad.add_(piece)


@dataclass
class PendingDownload:
    """A reduced gradient shard on its way to host memory (Note [offloaded shards]).

    Attributes:
        grads: each trainable parameter with its rows of the host copy, given to it by
            :meth:`land`.
        source: the device buffer the copy reads, referenced until no stream can still
            read it; ``None`` once released (or for a synchronous copy).
        done: the CUDA event recorded after the copy on the side stream, else ``None``.
        stream: the stream ``source`` was allocated on (CUDA), which waits for ``done``
            before ``source`` is released.
    """

    grads: list[tuple[nn.Parameter, torch.Tensor]]
    source: torch.Tensor | None = None
    done: Any = None
    stream: Any = None

    def release_source(self) -> None:
        """Let the allocator have the device buffer back once the copy has read it: the
        allocating stream waits for ``done`` on the device (the host does not wait)."""
        if self.source is not None and self.stream is not None:
            self.stream.wait_event(self.done)
        self.source = None

    def land(self) -> None:
        """Wait for the copy (the host waits on CUDA), then give every parameter its rows;
        once (the step context pops the record first)."""
        if self.done is not None:
            self.done.synchronize()  # Note [offloaded shards]: the host's wait at the end of backward
        self.source = None
        for param, piece in self.grads:
            land_grad(param, piece)
        self.grads = []


class HostShard:
    """Where an offloaded unit's shard lives, and its copies to and from the compute device.

    How it works: see Note [offloaded shards].

    Args:
        device: the compute device (the module's device at wrap time).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        """Pinned host tensors and asynchronous copies (else synchronous ones)."""
        self.uploaded: Any = None
        """The CUDA event after the last upload, until :meth:`settle` waits for it."""
        self._side: Any = None

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled host tensor, pinned on CUDA."""
        return torch.zeros(numel, dtype=dtype, device="cpu", pin_memory=self.cuda)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """A compute-device copy of ``host`` (a new tensor, also when the device is the CPU)."""
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        if not self.cuda:
            out.copy_(host)
            return out
        out.copy_(host, non_blocking=host.is_pinned())
        self.uploaded = torch.cuda.current_stream(self.device).record_event()
        return out

    def settle(self) -> None:
        """Wait (on the host) until no upload can still read the shard; before host writes."""
        if self.uploaded is not None:
            self.uploaded.synchronize()
            self.uploaded = None

    def download(self, grads: torch.Tensor,
                 rows_of: Callable[[torch.Tensor], list[tuple[nn.Parameter, torch.Tensor]]]) -> PendingDownload:
        """Start copying a reduced gradient shard ``grads`` into a new host tensor.

        Args:
            grads: the reduced shard on the compute device, in the gradients' dtype.
            rows_of: maps a shard-sized tensor to each trainable parameter with its rows of it.

        Returns:
            The record to land at the end of backward.
        """
        host = torch.empty(grads.shape, dtype=grads.dtype, device="cpu", pin_memory=self.cuda)
        views = rows_of(host)
        if not self.cuda:
            host.copy_(grads)
            return PendingDownload(views)
        compute = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        self._side.wait_stream(compute)
        with torch.cuda.stream(self._side):
            host.copy_(grads, non_blocking=True)
            done = self._side.record_event()
        return PendingDownload(views, source=grads, done=done, stream=compute)
