"""Model-state bytes one rank of ``shardopt demo`` / ``bench`` holds, split into those on the
device it trains on and those offloaded to host memory (Note [counting offloaded state]).

Note [counting offloaded state]
The heap column of the demo and the bench is malloc's view of the process: on CPU ranks it
is everything, device and host alike, and on a GPU the offloaded buffers are pinned memory
from CUDA's host allocator, which malloc does not see. So the model states are counted from
the tensors themselves: the distinct storages (``untyped_storage()``, once each, at their
current size) of
  host:   with offload (:attr:`Wrapped.offloaded <shardopt.app.wrapping.Wrapped.offloaded>`),
          the optimizer's stepped tensors (OSS's masters: the wrapped optimizer's parameters
          and ``OSS.master_of(p)`` for every parameter; FSDP2's parameter shards), their
          gradients and every tensor of the optimizer's state (Adam's two moments and its
          0-dim ``step``, 4 bytes per stepped tensor);
  device: the model's parameters and their gradients not counted as host, and without
          offload the stepped tensors and state too.
A DTensor (FSDP2) is counted by its local shard. When: the host side right after the update
of the optimizer that steps the masters (a step post-hook on ``OSS.optim``), where the
gradients it used still exist (OSS then frees the masters' gradients, keeping an offloaded
buffer for the next step that no tensor views until then); the device side after the whole
step (a post-hook on the optimizer the mode steps), when OSS has handed an fp32 mirror's
gradient back to its parameter (Note [mirrors carry gradients] in shardopt.optim.masters;
during the update OSS holds it out of sight). For a torch optimizer both are one hook.
Not counted: activations, communication buckets, FSDP's gathered parameters, allocator
overhead. OSS rebuilds its wrapped optimizer when ownership changes (``refresh_trainable``,
``add_param_group``, ``load_state_dict``), so the runner installs the count after any
resume, when the demo changes nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardopt.app.wrapping import Wrapped
from shardopt.fake_ranks import state_tensors
from shardopt.optim import OSS

__all__ = ["StateCount", "count_states"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storages(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (which they join)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def count_states(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer, offloaded: bool) -> tuple[int, int]:
    """``(device bytes, host bytes)`` of the model states reachable now (Note [counting offloaded state]).

    Args:
        modules: the wrapper and the unwrapped model (their parameters are counted once).
        optimizer: the optimizer the mode steps (``OSS`` counts through ``OSS.optim`` and
            ``OSS.master_of``).
        offloaded: whether the optimizer's side lives in host memory by offload.

    Returns:
        The bytes on the training device and the bytes offloaded to the host (0 without offload).
    """
    inner = optimizer.optim if isinstance(optimizer, OSS) else optimizer
    stepped = [p for g in inner.param_groups for p in g["params"]]
    if isinstance(optimizer, OSS):  # each master's view and gradient, stepped flat or not (Note [flat masters])
        stepped += [m for m in (optimizer.master_of(p) for p in optimizer.params) if m is not None]
    optimizer_side = [*stepped, *(p.grad for p in stepped), *(t for s in inner.state.values() for t in state_tensors(s))]
    params = list(dict.fromkeys(p for m in modules for p in m.parameters()))
    seen: set[int] = set()
    host = _storages(optimizer_side, seen) if offloaded else 0
    device = _storages([*params, *(p.grad for p in params), *optimizer_side], seen)
    return device, host


class StateCount:
    """The latest :func:`count_states` of a wrapped mode, the host side at each update and the
    device side after each step (Note [counting offloaded state]).

    How it works: a step post-hook on the optimizer that updates the parameters (``OSS.optim``
    for OSS) and one on the optimizer the mode steps (the same one for a torch optimizer);
    :meth:`remove` takes them away (idempotent).

    Args:
        wrapped: the mode's model and optimizer, after any checkpoint was loaded.

    Attributes:
        device_bytes: model-state bytes on the training device after the last step (``None``
            before the first).
        host_bytes: model-state bytes offloaded to host memory at the last update (0 without
            offload, ``None`` before the first).
    """

    def __init__(self, wrapped: Wrapped) -> None:
        self._modules = (wrapped.model, wrapped.module)
        self._optimizer = wrapped.optimizer
        self._offloaded = wrapped.offloaded
        inner = wrapped.optimizer.optim if isinstance(wrapped.optimizer, OSS) else wrapped.optimizer
        self._handles: list[Any] = [inner.register_step_post_hook(self._count_host)]
        self._handles.append(wrapped.optimizer.register_step_post_hook(self._count_device))
        self.device_bytes: int | None = None
        self.host_bytes: int | None = None

    def _count_host(self, *_: object) -> None:
        self.host_bytes = count_states(self._modules, self._optimizer, self._offloaded)[1]

    def _count_device(self, *_: object) -> None:
        self.device_bytes = count_states(self._modules, self._optimizer, self._offloaded)[0]

    def remove(self) -> None:
        """Remove the hooks; the last counts stay."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
