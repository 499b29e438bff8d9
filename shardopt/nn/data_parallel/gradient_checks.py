"""Gradients ShardedDataParallel's buckets cannot reduce, refused with an error naming the fix
(checks shared with FullyShardedDataParallel live in :mod:`shardopt.nn.module_checks`).

Each check sees the same program on every rank, so every rank raises the same error at the
same point instead of one rank leaving a collective the others wait in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["check_accumulated", "check_grads_are_leaves"]


def check_accumulated(param: nn.Parameter, name_of: Callable[[torch.Tensor], str]) -> None:
    """Raise on a gradient just accumulated into ``param`` that the buckets cannot reduce.

    Args:
        param: the parameter autograd accumulated into.
        name_of: the parameter's name in the module, for the message.

    Raises:
        ValueError: the backward pass had ``create_graph=True``.
        TypeError: the gradient is not dense.
    """
    if torch.is_grad_enabled():  # the engine enables grad mode only for create_graph=True
        raise ValueError(
            f"backward(create_graph=True) reached parameter {name_of(param)!r}: "
            "ShardedDataParallel cannot reduce a gradient that carries a graph (the reduction is "
            "not differentiable). For a gradient penalty take torch.autograd.grad(loss, inputs, "
            "create_graph=True), add the penalty to the loss and call backward() without create_graph"
        )
    grad = param.grad
    if grad is not None and grad.layout != torch.strided:
        raise TypeError(
            f"parameter {name_of(param)!r} got a {grad.layout} gradient: ShardedDataParallel "
            "reduces dense gradients only; make the operation producing it dense "
            "(e.g. nn.Embedding(sparse=False), F.embedding(..., sparse=False))"
        )


def check_grads_are_leaves(module: nn.Module, name_of: Callable[[torch.Tensor], str]) -> None:
    """Raise on a ``.grad`` that carries a graph, before a training forward.

    Args:
        module: the wrapped module.
        name_of: a parameter's name in the module, for the message.

    Raises:
        RuntimeError: a parameter's gradient requires grad.
    """
    for p in module.parameters():
        if p.grad is not None and p.grad.requires_grad:
            raise RuntimeError(
                f"parameter {name_of(p)!r} holds a gradient that requires grad (left by "
                "backward(create_graph=True) or autograd.grad into .grad); ShardedDataParallel reduces plain "
                "gradients only: call optimizer.zero_grad(set_to_none=True) or detach the gradient first"
            )
