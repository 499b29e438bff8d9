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
parameters it was given is sharded by a live wrapper, naming the method to call instead. Code
that imported the function by name before the wrapper was built (``from torch.nn.utils import
clip_grad_norm_`` at import time) keeps torch's original and is not warned. An OSS with
master weights registers its parameters too, at any world size: the owners' gradients move
to the fp32 masters before the step (Note [master gradients] in shardopt.optim.masters). When no live
wrapper is left (the last one was closed or collected), torch's own function is put back,
unless something else has replaced shardopt's meanwhile: a process that is done with ZeRO-2/3
sees an unchanged torch, and a later wrapper installs it again.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from shardopt.placeholders import is_placeholder

__all__ = ["register_sharded", "unregister"]

# id(param) -> (weak reference to it, weak reference to the wrapper that shards it, what to
# call instead); an entry leaves when its parameter is unregistered or collected, and counts
# only while its wrapper lives.
_sharded: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[object], str]] = {}
_live: weakref.WeakSet[object] = weakref.WeakSet()
_warned = False
_original: Callable[..., torch.Tensor] | None = None
_patched: Callable[..., torch.Tensor] | None = None


def register_sharded(wrapper: object, params: Iterable[torch.Tensor], method: str) -> None:
    """Mark ``params`` as holding gradients sharded by ``wrapper`` (Note [clipping that bypasses the wrapper]).

    Args:
        wrapper: the live wrapper (held weakly: once it is collected its parameters stop counting).
        params: the wrapper's parameters.
        method: what to call instead, for the warning (e.g. ``"OSS.clip_grad_norm"``).
    """
    _install()
    owner = weakref.ref(wrapper)
    for p in params:
        key = id(p)
        _sharded[key] = (weakref.ref(p, functools.partial(_collected, key)), owner, method)
    if wrapper not in _live:
        _live.add(wrapper)
        weakref.finalize(wrapper, _restore_when_unused)


def unregister(wrapper: object, params: Iterable[torch.Tensor]) -> None:
    """Forget ``wrapper`` and its ``params`` (it was closed); put torch's function back if it was the last."""
    for p in params:
        entry = _sharded.get(id(p))
        if entry is not None and entry[0]() is p and entry[1]() is wrapper:
            del _sharded[id(p)]
    _live.discard(wrapper)
    _restore_when_unused()


def _collected(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    entry = _sharded.get(key)
    if entry is not None and entry[0] is ref:  # not a newer parameter that reused the id
        del _sharded[key]


def _method_for(param: torch.Tensor) -> str | None:
    """What to call instead of torch's clip for ``param``, or ``None`` when no live wrapper shards it."""
    entry = _sharded.get(id(param))
    if entry is None or entry[0]() is not param or entry[1]() is None:
        return None
    return entry[2]


def _restore_when_unused() -> None:
    global _original, _patched
    if _patched is None or any(True for _ in _live):  # a WeakSet yields only live wrappers
        return
    # Leave a later replacement by someone else alone.
    if torch.nn.utils.clip_grad.clip_grad_norm_ is _patched:
        torch.nn.utils.clip_grad.clip_grad_norm_ = _original  # type: ignore[assignment]
    if torch.nn.utils.clip_grad_norm_ is _patched:
        torch.nn.utils.clip_grad_norm_ = _original  # type: ignore[assignment]
    _original = _patched = None


def _install() -> None:
    global _original, _patched
    if _patched is not None:
        return
    original = torch.nn.utils.clip_grad.clip_grad_norm_

    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        global _warned
        if not _warned:
            hit = next((method for method in map(_method_for, params) if method is not None), None)
            if hit is not None:
                _warned = True
                warnings.warn(
                    "torch.nn.utils.clip_grad_norm_ was called on parameters whose gradients shardopt has "
                    "sharded across ranks (ZeRO-2/3) or moved to fp32 master weights (OSS master_dtype): it "
                    "clips by this rank's local norm, which is wrong. Call "
                    f"{hit}(max_norm) instead (Note [clipping that bypasses the wrapper])",
                    UserWarning, stacklevel=2,
                )
        # A placeholder for a gradient held as an fp32 master gradient reads as zeros and
        # cannot be scaled in place (Note [placeholders for moved gradients] in shardopt.placeholders).
        return original([p for p in params if not is_placeholder(p)], max_norm, *args, **kwargs)

    _original, _patched = original, clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]
