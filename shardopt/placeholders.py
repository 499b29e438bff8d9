"""Placeholders left in ``param.grad`` for gradients held elsewhere (fp32 master gradients,
``no_sync`` sums in master precision).

Below :mod:`shardopt.clipping`, :mod:`shardopt.optim` and :mod:`shardopt.nn`, which all
import it: ShardedDataParallel (through its owner's-gradients object) leaves and takes
placeholders, ``OSS`` takes them when it folds gradients into its masters, and shardopt's
``clip_grad_norm_`` wrapper skips them. The only state is a map from a live parameter to the
placeholder left in its ``.grad``, that placeholder's version counter when it was left, and
whether it stands now (a taken one that nobody wrote to is left again, not made anew).

Note [placeholders for moved gradients]
Under ShardedDataParallel a low-precision parameter's gradient leaves ``param.grad`` before
the step: on its owner the reduced sum goes into the master's fp32 ``.grad``, and under
``no_sync`` every rank's local sum goes into an fp32 tensor of its own. ``model.zero_grad()``
walks ``param.grad`` only, so by itself it would not see either, and a later step would add
gradients the user had discarded. So where such a gradient is held elsewhere, a placeholder
is left in ``param.grad``: zeros of the parameter's shape expanded from one element (2
bytes), which refuse to be read (Note [placeholders refuse to be read]). Before the held
gradient is used or added to (the next backward reaching the parameter, the reduction, the
step), the placeholder is checked: still there and untouched,
the held gradient stands and the placeholder is removed; gone (``zero_grad(set_to_none=True)``)
or zeroed in place (``set_to_none=False``, its version counter moved), the held gradient is
dropped, as a zeroed ``.grad`` would have been; a new tensor there is a new local gradient.
shardopt's ``clip_grad_norm_`` wrapper (Note [clipping that bypasses the wrapper] in
:mod:`shardopt.clipping`) skips it.

Note [placeholders refuse to be read]
A placeholder used to read as zeros, so code that reads gradients per parameter (per-layer
norm logging, ``wandb.watch``, a custom clip, a finite check, torch's ``GradScaler.unscale_``)
silently saw 0 for exactly the parameters that hold the most (a split embedding: shape (512,
16), stride (0, 0), sum 0.0 on every rank). Now it is a :class:`HeldElsewhere` tensor whose
``__torch_function__`` lets through only what ``zero_grad`` does to a gradient (``zero_``,
``requires_grad_``, ``detach_``, ``torch._foreach_zero_``), what ``module.to()``/``.cpu()``/
``.half()`` do to every ``.grad`` (a Lightning teardown moves the model), and metadata (shape,
dtype, device, ``_version``, ``numel``...); every other operation raises a ``RuntimeError`` saying
where the gradient is (``OSS.grad_holder(param).grad``, this rank's rows) and how to get
per-parameter norms over every rank (:func:`shardopt.grad_norms`); torch's
``GradScaler.unscale_`` is told to use ``ShardedGradScaler``. Autograd never sees a
placeholder (ShardedDataParallel settles it before accumulating), and setting ``.grad`` to
``None`` is an attribute write on the parameter, so the training paths are untouched.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["HeldElsewhere", "is_placeholder", "leave_placeholder", "take_placeholder"]

# What zero_grad does to a gradient (torch.optim.Optimizer's and nn.Module's, set_to_none=False),
# what nn.Module._apply does to every .grad (module.cpu(), .to(), .half(), .to_empty(),
# .share_memory()), and reads of metadata: allowed on a placeholder (Note [placeholders refuse
# to be read]).
_ALLOWED = frozenset({
    torch.Tensor.zero_, torch.Tensor.requires_grad_, torch.Tensor.detach_, torch._foreach_zero_,
    torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.to, torch.Tensor.type, torch.Tensor.float, torch.Tensor.half,
    torch.Tensor.bfloat16, torch.Tensor.double, torch.Tensor.share_memory_, torch.Tensor.pin_memory, torch.empty_like,
    torch._has_compatible_shallow_copy_type,
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.element_size,
    torch.Tensor.is_contiguous, torch.Tensor.untyped_storage, torch.Tensor.data_ptr, torch.Tensor.storage_offset,
    torch.Tensor.__hash__,
})
_UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"


class HeldElsewhere(torch.Tensor):
    """The placeholder in ``param.grad`` for a gradient shardopt holds elsewhere: zeros that
    refuse to be read (Note [placeholders refuse to be read])."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _ALLOWED or getattr(func, "__name__", "") in ("__get__", "__set__"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(_refusal(func, _first_placeholder(args, kwargs)))

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's is untyped
        with torch._C.DisableTorchFunctionSubclass():
            shape, dtype = tuple(self.shape), self.dtype
        return f"HeldElsewhere(shape={shape}, dtype={dtype}: this gradient is held by shardopt.optim.OSS.grad_holder)"


def _first_placeholder(args: Any, kwargs: Any) -> HeldElsewhere | None:
    for value in [*args, *(kwargs or {}).values()]:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, HeldElsewhere):
                return item
    return None


def _refusal(func: Any, placeholder: HeldElsewhere | None) -> str:
    """The error for an operation on a placeholder (Note [placeholders refuse to be read])."""
    what = "a parameter's gradient"
    if placeholder is not None:
        with torch._C.DisableTorchFunctionSubclass():
            what = f"the gradient of a {tuple(placeholder.shape)} {placeholder.dtype} parameter"
    if getattr(func, "__name__", "") == _UNSCALE:
        return (f"torch.amp.GradScaler.unscale_ reached {what} that ShardedDataParallel holds outside param.grad "
                "(in an fp32 master or, for a parameter split across ranks, in its owners' rows): torch's scaler "
                "would unscale and inf-check only what this rank holds. Use shardopt.optim.ShardedGradScaler "
                "(same arguments), whose unscale_ and inf check cover every rank's share")
    qualname = str(getattr(func, "__qualname__", "") or getattr(func, "__name__", "") or repr(func))
    owner, _, short = qualname.rpartition(".")
    name = {"TensorBase": "Tensor.", "Tensor": "Tensor.", "_VariableFunctionsClass": "torch."}.get(owner, "") + short
    return (f"{name} on {what}: ShardedDataParallel holds this gradient outside param.grad (in an fp32 master or, "
            "for a parameter split across ranks, in the rows each owner keeps), and param.grad only stands in for "
            "it so that zero_grad() still reaches it. Read this rank's part with optimizer.grad_holder(param).grad "
            "(None where this rank owns none of it), get per-parameter norms over every rank with "
            "shardopt.grad_norms(model, optimizer) (call it on every rank), and clip with "
            "torch.nn.utils.clip_grad_norm_ or optimizer.clip_grad_norm; zero_grad() works as usual")

class _Left:
    """A parameter's placeholder, its version counter when it was left, and whether it stands
    now (left and not yet taken). A taken placeholder that nobody wrote to is left again the
    next time: ShardedDataParallel leaves one per owned parameter per backward pass, and
    making a new one each time was most of the host time of a bucket's hand-over."""

    __slots__ = ("fits", "placeholder", "standing", "version")

    def __init__(self, placeholder: torch.Tensor, param: torch.Tensor) -> None:
        self.placeholder = placeholder
        self.version = placeholder._version
        self.standing = True
        self.fits = (param.dtype, param.device, param.shape)


# id(param) -> _Left; an entry goes when its parameter dies (weakref.finalize). A plain dict: a
# WeakIdKeyDictionary lookup makes and compares weak references in Python, several microseconds
# per parameter per backward pass.
_placeholders: dict[int, _Left] = {}


def leave_placeholder(param: torch.Tensor) -> None:
    """Put a 2-byte zero placeholder in ``param.grad``: its gradient is held elsewhere
    (Note [placeholders for moved gradients])."""
    left = _placeholders.get(id(param))
    if (left is not None and left.placeholder._version == left.version
            and left.fits == (param.dtype, param.device, param.shape)):  # module.to() may have moved param since
        if not left.standing or param.grad is not left.placeholder:
            param.grad = left.placeholder  # the same zeros, unwritten: left again
            left.standing = True
        return  # one placeholder stands for everything held for the parameter
    zeros = torch.zeros((), dtype=param.dtype, device=param.device).expand_as(param)
    placeholder = torch.Tensor._make_subclass(HeldElsewhere, zeros)
    param.grad = placeholder
    if left is None:
        weakref.finalize(param, _placeholders.pop, id(param), None)
    _placeholders[id(param)] = _Left(placeholder, param)


def take_placeholder(param: torch.Tensor) -> bool:
    """Remove ``param``'s placeholder and say whether what is held for it still stands.

    Returns:
        ``True`` when no placeholder was left, or it is still in ``param.grad`` untouched;
        ``False`` when it was dropped, zeroed or replaced (the held gradient was discarded).
        A placeholder still in ``param.grad`` (even zeroed) is replaced by ``None``.
    """
    left = _placeholders.get(id(param))
    if left is None or not left.standing:
        return True
    left.standing = False
    if param.grad is left.placeholder:
        param.grad = None
        return left.placeholder._version == left.version
    return False


def is_placeholder(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` is a placeholder (Note [placeholders for moved gradients])."""
    left = _placeholders.get(id(param))
    return left is not None and left.standing and param.grad is left.placeholder
