"""Framework-independent pieces of the integrations: an optimizer a framework built becomes
an :class:`~shardopt.optim.OSS`, and a ZeRO-3 model becomes a plain module again.

Frameworks (Lightning's ``configure_optimizers``, Hugging Face's ``create_optimizer``) hand
over a plain ``torch.optim`` optimizer, often with LR schedulers already bound to it.
:func:`to_oss` rebuilds it as OSS with the same class, param groups, hyperparameters and
state; :func:`rebind_scheduler` points a scheduler (and the schedulers it chains) at the
new optimizer. :func:`release` gives a framework back the plain module after ZeRO-3 training.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import weakref
from typing import Any

from torch import nn
from torch.optim import Optimizer

from shardopt.nn import FullyShardedDataParallel
from shardopt.optim import OSS

__all__ = ["rebind_scheduler", "release", "to_oss", "wrap_units_first"]

# Optimizers whose step cannot run on a shard of the parameters.
_REFUSED: dict[str, str] = {
    "LBFGS": "its line search re-evaluates the loss and reads every parameter's gradient on every rank",
    "SparseAdam": "it steps sparse gradients, which shardopt does not reduce",
    "ZeroRedundancyOptimizer": "it already shards the optimizer state (ZeRO-1)",
}

_MISSING = object()
# What oss_kwargs may name: OSS's own arguments (the rest of OSS's keywords go to the wrapped optimizer,
# whose hyperparameters to_oss takes from the optimizer it rebuilds).
_OSS_ARGUMENTS = frozenset(inspect.signature(OSS.__init__).parameters) - {"self", "params", "optim", "defaults"}


def _constructor_kwargs(cls: type[Optimizer], defaults: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``defaults`` that ``cls(params, **kwargs)`` accepts.

    Some classes store derived settings in ``defaults`` that their constructor does not take
    (``AdamW`` keeps ``decoupled_weight_decay=True``); those are left to the class and
    compared after construction.
    """
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def to_oss(optimizer: Optimizer, group: Any | None = None, **oss_kwargs: Any) -> OSS:
    """Rebuild ``optimizer`` as an :class:`~shardopt.optim.OSS` over the same parameters.

    How it works: the OSS wraps ``type(optimizer)`` with its ``defaults`` and a copy of each
    param group (every hyperparameter, including keys a scheduler added such as
    ``initial_lr``); existing state (momentum, Adam moments) is loaded through the plain
    state dict OSS accepts. An ``OSS`` is returned unchanged. Collective: call on every
    rank with the same parameters.

    Args:
        optimizer: a ``torch.optim.Optimizer`` instance (not yet stepped, or with state).
        group: the process group for the OSS (default: the world).
        **oss_kwargs: further ``OSS`` arguments (``broadcast_fp16``).

    Returns:
        The OSS; ``optimizer`` itself is left as it was.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or ``oss_kwargs`` names
            something that is not an ``OSS`` argument.
        ValueError: the optimizer cannot step a shard (LBFGS, SparseAdam, an already
            sharded optimizer), its class cannot be rebuilt from its ``defaults``, or a
            rebuilt hyperparameter differs.
    """
    if isinstance(optimizer, OSS):
        return optimizer
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"expected a torch.optim.Optimizer to shard, got {type(optimizer).__name__}; return a torch.optim "
            "optimizer (e.g. torch.optim.AdamW(self.parameters(), lr=...)) and shardopt rebuilds it as OSS"
        )
    cls = type(optimizer)
    why = next((reason for name, reason in _REFUSED.items() if any(c.__name__ == name for c in cls.__mro__)), None)
    if why is not None:
        raise ValueError(f"cannot shard a {cls.__name__} with OSS: {why}; use another optimizer "
                         "(e.g. torch.optim.AdamW) or train without shardopt's ZeRO-1/2")
    unknown = sorted(set(oss_kwargs) - _OSS_ARGUMENTS)
    if unknown:
        hints = {k: difflib.get_close_matches(k, _OSS_ARGUMENTS, n=1) for k in unknown}
        meant = "".join(f" ({k!r}: did you mean {m[0]!r}?)" for k, m in hints.items() if m)
        raise TypeError(
            f"oss_kwargs {unknown} are not OSS arguments{meant}; OSS takes {sorted(_OSS_ARGUMENTS)}. Set the "
            f"optimizer's own hyperparameters on the torch optimizer you return (e.g. torch.optim.AdamW(..., lr=...))"
        )
    groups = [{**g, "params": list(g["params"])} for g in optimizer.param_groups]
    kwargs = _constructor_kwargs(cls, optimizer.defaults)
    try:
        oss = OSS(groups, optim=cls, group=group, **oss_kwargs, **kwargs)
    except TypeError as e:
        raise ValueError(
            f"cannot rebuild {cls.__name__} as OSS(params, optim={cls.__name__}, **defaults): {e}. Its constructor "
            f"must accept the keys of optimizer.defaults ({sorted(optimizer.defaults)}); build the OSS yourself "
            "(OSS(params, optim=..., ...)) and return it instead"
        ) from e
    differ = sorted(k for k, v in optimizer.defaults.items() if oss.defaults.get(k, _MISSING) != v)
    if differ:
        raise ValueError(
            f"rebuilding {cls.__name__} changed its defaults {differ} "
            f"({ {k: optimizer.defaults[k] for k in differ} } -> { {k: oss.defaults.get(k) for k in differ} }): "
            "its constructor does not take them back; build the OSS yourself and return it instead"
        )
    if any(optimizer.state.values()):
        oss.load_state_dict(optimizer.state_dict())
    return oss


def _track_step_called(optimizer: Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's LR schedulers do when they are built.

    A scheduler checks the mark on its first ``step()``; without it torch warns that the
    optimizer's step was overridden after the scheduler was created.
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    func = optimizer.step.__func__  # type: ignore[attr-defined]
    ref = weakref.ref(optimizer)

    @functools.wraps(func)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, type(opt))(*args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]


def rebind_scheduler(scheduler: Any, old: Optimizer, new: Optimizer) -> None:
    """Point ``scheduler`` (and the schedulers it chains) from ``old`` to ``new``.

    The scheduler's own state (``last_epoch``, ``base_lrs``, ...) is kept; ``new`` must have
    the same param groups as ``old`` (what :func:`to_oss` returns). A scheduler bound to
    another optimizer is left alone.

    Args:
        scheduler: a ``torch.optim.lr_scheduler`` scheduler (``SequentialLR`` and
            ``ChainedScheduler`` included) or any object with an ``optimizer`` attribute.
        old: the optimizer it was built with.
        new: its replacement.

    Raises:
        ValueError: the scheduler has no ``optimizer`` attribute to rebind.
    """
    if not hasattr(scheduler, "optimizer"):
        raise ValueError(
            f"cannot rebind LR scheduler {type(scheduler).__name__} to the sharded optimizer: it has no "
            "'optimizer' attribute; use a torch.optim.lr_scheduler scheduler"
        )
    for child in getattr(scheduler, "_schedulers", ()):
        rebind_scheduler(child, old, new)
    if scheduler.optimizer is old:
        scheduler.optimizer = new
        _track_step_called(new)
        if getattr(old, "_opt_called", False):
            new._opt_called = True  # type: ignore[attr-defined]


def release(root: FullyShardedDataParallel) -> nn.Module:
    """Turn a FullyShardedDataParallel tree back into its plain module, with full parameters.

    How it works: ``root.state_dict()`` gathers every parameter in full on every rank; the
    nested units are replaced by their modules; each parameter is replaced by a new
    ``nn.Parameter`` holding its full value (shared parameters stay shared). New objects,
    because FSDP remembers the parameters it owns and would refuse to wrap them again.
    Collective over the model's ranks.

    Args:
        root: the outermost wrapper.

    Returns:
        ``root.module``, a plain module.
    """
    full = root.state_dict()
    plain = root.module
    for parent in list(plain.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, FullyShardedDataParallel):
                setattr(parent, name, child.module)
    replaced: dict[int, nn.Parameter] = {}
    for prefix, module in plain.named_modules(remove_duplicate=False):
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            key = f"{prefix}.{name}" if prefix else name
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(full[key], requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]
    return plain


def _unwrapped_numel(module: nn.Module) -> int:
    """Parameters of ``module`` outside the units already built inside it."""
    if isinstance(module, FullyShardedDataParallel):
        return 0
    own = sum(p.numel() for p in module.parameters(recurse=False))
    return own + sum(_unwrapped_numel(child) for child in module.children())


def wrap_units_first(model: nn.Module, options: dict[str, Any]) -> dict[str, Any]:
    """Wrap the submodules ``auto_wrap_policy`` selects, innermost first, each on its own
    (so each is materialised from the meta device and sharded before the next), and
    return the options for the root (without the policy: its units exist). Collective
    (each unit built is one), like FullyShardedDataParallel itself.

    Args:
        model: the module (partly on the meta device) about to be wrapped.
        options: the FullyShardedDataParallel arguments; ``auto_wrap_policy`` selects.

    Returns:
        ``options`` without ``auto_wrap_policy`` (unchanged when there is none).

    FullyShardedDataParallel materialises the whole module it is given before applying
    its policy, which would hold the full model on every rank (Note [ZeRO-3 without the
    full model]); wrapping the units first is the manual nesting it supports.
    """
    policy = options.get("auto_wrap_policy")
    if policy is None:
        return options
    unit_options = {k: v for k, v in options.items() if k != "auto_wrap_policy"}

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            qualified = f"{prefix}.{name}" if prefix else name
            if isinstance(child, FullyShardedDataParallel):
                continue
            visit(child, qualified)
            if policy(child, qualified, _unwrapped_numel(child)):
                setattr(parent, name, FullyShardedDataParallel(child, **unit_options))

    visit(model, "")
    return unit_options
