"""A warning when torch's ``clip_grad_norm_`` clips gradients that ZeRO-2/3 have sharded.

Note [clipping that bypasses the wrapper]
Under ShardedDataParallel each rank holds only the gradients it owns, and under
FullyShardedDataParallel only its pieces of them, so ``torch.nn.utils.clip_grad_norm_``
over ``model.parameters()`` (what trainers call) computes each rank's *local* norm and clips
every rank by a different, too small factor: a silently wrong update. The correct calls are
``OSS.clip_grad_norm`` and ``FullyShardedDataParallel.clip_grad_norm_``, which combine the
ranks' sums first. While a ZeRO-2/3 wrapper is alive, shardopt therefore replaces
``torch.nn.utils.clip_grad_norm_`` (and ``torch.nn.utils.clip_grad.clip_grad_norm_``) with a
thin function that calls torch's own unchanged and warns once per process when any of the
parameters it was given is sharded, naming the method to call instead. Code that imported
the function by name before the wrapper was built (``from torch.nn.utils import
clip_grad_norm_`` at import time) keeps torch's original and is not warned. An OSS with
master weights registers its parameters too, at any world size: the owners' gradients move
to the fp32 masters before the step (Note [master gradients] in shardopt.optim.masters).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["register_sharded"]

_sharded: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_method: dict[int, str] = {}
_warned = False
_installed = False


def register_sharded(params: Iterable[torch.Tensor], method: str) -> None:
    """Mark ``params`` as holding sharded gradients (Note [clipping that bypasses the wrapper]).

    Args:
        params: the wrapper's parameters.
        method: what to call instead, for the warning (e.g. ``"OSS.clip_grad_norm"``).
    """
    _install()
    for p in params:
        _sharded[id(p)] = p
        _method[id(p)] = method


def unregister(params: Iterable[torch.Tensor]) -> None:
    """Forget ``params`` (a wrapper that was closed)."""
    for p in params:
        if _sharded.get(id(p)) is p:
            del _sharded[id(p)]
            _method.pop(id(p), None)


def _install() -> None:
    global _installed
    if _installed:
        return
    original = torch.nn.utils.clip_grad.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        global _warned
        if not _warned:
            hit = next((p for p in params if _sharded.get(id(p)) is p), None)
            if hit is not None:
                _warned = True
                warnings.warn(
                    "torch.nn.utils.clip_grad_norm_ was called on parameters whose gradients shardopt has "
                    "sharded across ranks (ZeRO-2/3) or moved to fp32 master weights (OSS master_dtype): it "
                    "clips by this rank's local norm, which is wrong. Call "
                    f"{_method[id(hit)]}(max_norm) instead (Note [clipping that bypasses the wrapper])",
                    UserWarning, stacklevel=2,
                )
        return original(params, max_norm, *args, **kwargs)

    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]
    _installed = True
