"""Autograd plumbing of ``FullyShardedDataParallel``: finding output tensors to hook, and
the identity function whose backward is a unit's post-backward (Note [hook order])."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["PostBackward", "has_opaque", "tensors_in"]


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``: containers, dicts, named tuples and dataclass outputs."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name))


def has_opaque(obj: Any) -> bool:
    """Whether ``obj`` holds something :func:`tensors_in` cannot look into (a custom object
    that may hide tensors), as opposed to tensors, containers and plain Python values."""
    if obj is None or isinstance(obj, (torch.Tensor, bool, int, float, complex, str, bytes)):
        return False
    if isinstance(obj, dict):
        return any(has_opaque(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_opaque(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return any(has_opaque(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return True


class PostBackward(torch.autograd.Function):
    """Identity on a forward's inputs whose backward calls ``on_backward`` (the unit's
    post-backward) once the gradients of all those inputs are computed."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.on_backward = on_backward
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.on_backward()
        return (None, *grads)
