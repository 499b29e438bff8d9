"""Meta-device materialisation for ``FullyShardedDataParallel``: a module built on the meta
device gets real storage (``param_init_fn`` or each submodule's ``reset_parameters()``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn


__all__ = ["check_sparse", "materialize"]


def materialize(module: nn.Module, param_init_fn: Callable[[nn.Module], None] | None, device: torch.device) -> None:
    """Materialise a module built on the meta device (warn when ``param_init_fn`` is unused).

    Without ``param_init_fn`` the module is moved with ``to_empty`` to ``device`` (see
    :func:`shardopt.comm.default_device`) and every submodule's ``reset_parameters()`` runs, in module order. Parameters
    shared by several modules stay shared (the first registration's tensor is kept).

    Raises:
        ValueError: meta tensors remain afterwards.
    """
    tensors = list(module.parameters()) + list(module.buffers())
    if not any(t.is_meta for t in tensors):
        if param_init_fn is not None:
            warnings.warn(
                "param_init_fn is ignored: the module has no parameters or buffers on the meta device",
                UserWarning,
                stacklevel=3,
            )
        return
    # to_empty() makes a new tensor per registration, which would untie shared parameters.
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((sub, name))
    tied = [where for where in places.values() if len(where) > 1]

    def retie() -> None:
        for (first, first_name), *rest in tied:
            for sub, name in rest:
                sub._parameters[name] = first._parameters[first_name]

    if param_init_fn is not None:
        param_init_fn(module)
        retie()
    else:
        module.to_empty(device=device)
        retie()
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(
            f"after meta-device initialisation these tensors are still on the meta device: {left[:5]}; "
            "param_init_fn must materialise every parameter and buffer (e.g. module.to_empty(device=...) then "
            "initialise), or give each submodule a reset_parameters()"
        )


def check_sparse(module: nn.Module) -> None:
    """Refuse modules whose trainable parameters would get sparse gradients (they cannot be
    flattened into a unit's gradient buffer).

    Raises:
        TypeError: names the module and the fix.
    """
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            raise TypeError(
                f"module {name or type(sub).__name__!r} ({type(sub).__name__}) has sparse=True: "
                "FullyShardedDataParallel reduces dense gradients only; build it with sparse=False "
                "(and a dense optimizer such as torch.optim.Adam instead of SparseAdam)"
            )

