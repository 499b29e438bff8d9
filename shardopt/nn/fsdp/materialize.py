"""Meta-device materialisation for ``FullyShardedDataParallel``: a module built on the meta
device gets real storage (``param_init_fn`` or each submodule's ``reset_parameters()``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["materialize"]


def materialize(module: nn.Module, param_init_fn: Callable[[nn.Module], None] | None, device: torch.device) -> None:
    """Materialise a module built on the meta device (warn when ``param_init_fn`` is unused).

    Without ``param_init_fn`` the module is moved with ``to_empty`` to ``device`` (see
    :func:`shardopt.comm.default_device`) and every submodule's ``reset_parameters()`` runs, in module order. Parameters
    shared by several modules stay shared (the first registration's tensor is kept).

    Raises:
        ValueError: meta tensors remain afterwards, or (without ``param_init_fn``) a meta
            tensor belongs only to modules without a ``reset_parameters()`` to initialise it
            (Note [meta tensors nothing initialises]).
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
        _refuse_uninitialised(module)
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


def _refuse_uninitialised(module: nn.Module) -> None:
    """Refuse meta tensors that ``to_empty`` alone would leave holding arbitrary memory.

    Note [meta tensors nothing initialises]
    ``to_empty`` allocates storage without writing it; only a module's own
    ``reset_parameters()`` then gives that module's tensors values. A tensor registered
    directly on a module that has none (an ``nn.Parameter`` of a custom module, a buffer such
    as a positional encoding, ``nn.MultiheadAttention.in_proj_weight``, whose initialiser is
    the private ``_reset_parameters``) kept whatever the allocator returned, and training
    started from garbage or NaN without a word. A tensor tied to a module that does have
    ``reset_parameters()`` is initialised by that module and is accepted.

    Raises:
        ValueError: naming every such tensor (up to eight), its module's class, and the fix.
    """
    def own(sub: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for n, t in [*sub._parameters.items(), *sub._buffers.items()] if t is not None]

    resettable = [sub for sub in module.modules() if callable(getattr(sub, "reset_parameters", None))]
    covered = {id(t) for sub in resettable for _, t in own(sub)}
    bare: list[str] = []
    classes: list[str] = []
    for prefix, sub in module.named_modules():
        for name, tensor in own(sub):
            if tensor.is_meta and id(tensor) not in covered:
                covered.add(id(tensor))  # a tensor tied between two such modules is named once
                bare.append(f"{prefix}.{name}" if prefix else name)
                if type(sub).__name__ not in classes:
                    classes.append(type(sub).__name__)
    if bare:
        shown = bare if len(bare) <= 8 else [*bare[:8], f"... ({len(bare)} in all)"]
        raise ValueError(
            f"these tensors are on the meta device in modules without reset_parameters(): {shown} "
            f"(in {', '.join(classes)}); without param_init_fn, FullyShardedDataParallel materialises with "
            "to_empty(), which would leave them holding arbitrary memory (Note [meta tensors nothing initialises]). "
            "Pass param_init_fn=fn that materialises and initialises them (fn gets the whole module), or give "
            f"{', '.join(classes)} a reset_parameters() that initialises its own parameters and buffers"
        )

