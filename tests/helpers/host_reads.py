"""A host-read audit: which calls from shardopt's own code would block the host on a GPU.

On a CUDA tensor, ``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``nonzero``,
``torch.equal`` and ``t[i] = 3`` (a Python number into one element: a blocking host-to-device
copy, pytorch#186482) each wait until the GPU is idle. On the CPU none of them costs anything,
so a CPU-only CI would never notice one on a per-step path. :class:`HostReadAudit` is a
``TorchFunctionMode`` that classifies each tensor call by what it would do on a device and
records it when the code that made the call is a shardopt module, so torch's own reads
(Adam's step count, ``GradScaler``'s ``found_inf`` check) are not counted. Enter it around one
phase of a step (backward, step, clip, the scaler) on CPU ranks and assert the counts
(Note [host reads per step] in shardopt/nn/data_parallel/grad_buckets.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

import shardopt

_TORCH_DIR = os.path.dirname(torch.__file__)
_SHARDOPT_DIR = os.path.dirname(shardopt.__file__)
_THIS_FILE = os.path.abspath(__file__)

# Calls that always copy a device value to the host, by name (tensor methods and torch functions).
_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero", "equal",
          "masked_select"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (bool, int, float)) and not isinstance(value, torch.Tensor)


def _one_element_index(index: Any) -> bool:
    if isinstance(index, int):
        return True
    return isinstance(index, tuple) and bool(index) and all(isinstance(i, int) for i in index)


def _host_side_index(index: Any) -> bool:
    """A Python list (copied to the device) or a bool mask (``nonzero`` on the device)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool) for p in parts)


def would_sync(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """What the tensor method or torch function ``name`` called with ``args``/``kwargs`` would do
    to the host if its tensors were on a GPU.

    Returns:
        A short description of the blocking read, or ``None`` when the call is asynchronous.
    """
    if name in _READS:
        return name
    if name == "__setitem__" and len(args) == 3:
        _, index, value = args
        if _one_element_index(index) and _is_number(value):
            return "t[i] = number"
        if _host_side_index(index):
            return "t[list or mask] = ..."
    if name == "__getitem__" and len(args) == 2 and _host_side_index(args[1]):
        return "t[list or mask]"
    if name == "to" and kwargs.get("device", args[1] if len(args) > 1 else None) == "cpu":
        # Only the literal string: ``t.to(other.device)`` is a CPU device in a CPU run but the
        # same device as ``t`` on a GPU, which copies nothing.
        return "to('cpu')"
    return None


# torch's own Python wrappers between a caller and the C method (``Tensor.__bool__`` etc.).
_WRAPPER_FILES = {os.path.join(_TORCH_DIR, "_tensor.py"), os.path.join(_TORCH_DIR, "overrides.py"),
                  os.path.join(_TORCH_DIR, "functional.py")}


def _shardopt_caller(frame: FrameType | None) -> str | None:
    """``file:line`` of the code that made the call, if it is shardopt's (not torch's own code,
    e.g. the wrapped optimizer's step count, and not a test)."""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _THIS_FILE and path not in _WRAPPER_FILES:
            if path.startswith(_SHARDOPT_DIR):
                return f"{os.path.relpath(path, os.path.dirname(_SHARDOPT_DIR))}:{frame.f_lineno}"
            return None
        frame = frame.f_back
    return None


# (owner, attribute) pairs the audit wraps: every blocking read above, plus the two methods
# whose arguments decide (``__setitem__``, ``__getitem__``, ``to``).
_PATCHED: tuple[tuple[Any, str], ...] = (
    *((torch.Tensor, name) for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
                                        "numpy", "nonzero", "masked_select", "__setitem__", "__getitem__", "to")),
    *((torch, name) for name in ("nonzero", "equal", "masked_select")),
)


class HostReadAudit:
    """Records, as ``(what, file:line)``, every call from shardopt's code that would block the
    host on a GPU. Use as a context manager around one phase; read :attr:`hits`.

    How it works: it wraps the tensor methods and torch functions above for the duration of
    the ``with`` block, in every thread (a ``TorchFunctionMode`` would be simpler, but the
    autograd engine runs backward hooks without the caller's modes, and the hooks are where
    ZeRO-2 works).
    """

    def __init__(self) -> None:
        self.hits: list[tuple[str, str]] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str) -> Callable[..., Any]:
        original = getattr(owner, name)

        def audited(*args: Any, **kwargs: Any) -> Any:
            what = would_sync(name, args, kwargs)
            if what is not None:
                where = _shardopt_caller(sys._getframe(1))
                if where is not None:
                    self.hits.append((what, where))
            return original(*args, **kwargs)

        return audited

    def __enter__(self) -> HostReadAudit:
        for owner, name in _PATCHED:
            self._saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, self._wrap(owner, name))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, saved in reversed(self._saved):
            if saved is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
        self._saved.clear()


_MISSING = object()
