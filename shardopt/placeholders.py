"""Placeholders left in ``param.grad`` for gradients held elsewhere (fp32 master gradients,
``no_sync`` sums in master precision).

Below :mod:`shardopt.clipping`, :mod:`shardopt.optim` and :mod:`shardopt.nn`, which all
import it: ShardedDataParallel (through its owner's-gradients object) leaves and takes
placeholders, ``OSS`` takes them when it folds gradients into its masters, and shardopt's
``clip_grad_norm_`` wrapper skips them. The only state is a weak map from a parameter to the
placeholder left in its ``.grad`` and that placeholder's version counter when it was left.

Note [placeholders for moved gradients]
Under ShardedDataParallel a low-precision parameter's gradient leaves ``param.grad`` before
the step: on its owner the reduced sum goes into the master's fp32 ``.grad``, and under
``no_sync`` every rank's local sum goes into an fp32 tensor of its own. ``model.zero_grad()``
walks ``param.grad`` only, so by itself it would not see either, and a later step would add
gradients the user had discarded. So where such a gradient is held elsewhere, a placeholder
is left in ``param.grad``: zeros of the parameter's shape expanded from one element (2
bytes). Before the held gradient is used or added to (the next backward reaching the
parameter, the reduction, the step), the placeholder is checked: still there and untouched,
the held gradient stands and the placeholder is removed; gone (``zero_grad(set_to_none=True)``)
or zeroed in place (``set_to_none=False``, its version counter moved), the held gradient is
dropped, as a zeroed ``.grad`` would have been; a new tensor there is a new local gradient.
A placeholder reads as a zero gradient, and shardopt's ``clip_grad_norm_`` wrapper (Note
[clipping that bypasses the wrapper] in :mod:`shardopt.clipping`) skips it.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["is_placeholder", "leave_placeholder", "take_placeholder"]

# param -> (the placeholder left in its .grad, that placeholder's version when left)
_placeholders = WeakIdKeyDictionary()


def leave_placeholder(param: torch.Tensor) -> None:
    """Put a 2-byte zero placeholder in ``param.grad``: its gradient is held elsewhere
    (Note [placeholders for moved gradients])."""
    held: tuple[torch.Tensor, int] | None = _placeholders.get(param)
    if held is not None and param.grad is held[0] and held[0]._version == held[1]:
        return  # one placeholder stands for everything held for the parameter
    placeholder = torch.zeros((), dtype=param.dtype, device=param.device).expand_as(param)
    param.grad = placeholder
    _placeholders[param] = (placeholder, placeholder._version)


def take_placeholder(param: torch.Tensor) -> bool:
    """Remove ``param``'s placeholder and say whether what is held for it still stands.

    Returns:
        ``True`` when no placeholder was left, or it is still in ``param.grad`` untouched;
        ``False`` when it was dropped, zeroed or replaced (the held gradient was discarded).
        A placeholder still in ``param.grad`` (even zeroed) is replaced by ``None``.
    """
    held: tuple[torch.Tensor, int] | None = _placeholders.pop(param, None)
    if held is None:
        return True
    placeholder, version = held
    if param.grad is placeholder:
        param.grad = None
        return placeholder._version == version
    return False


def is_placeholder(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` is a placeholder (Note [placeholders for moved gradients])."""
    held = _placeholders.get(param)
    return held is not None and param.grad is held[0]
