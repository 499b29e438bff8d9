"""Auto-wrap policies and the rules for which unit owns which parameter.

A policy is any callable ``policy(module, qualified_name, unwrapped_numel) -> bool`` that says
whether ``module`` becomes its own FSDP unit; ``unwrapped_numel`` counts the parameters under
``module`` not already claimed by a unit below it. Three ready-made frozen policies cover the
usual cases: :class:`SizePolicy`, :class:`ModuleClassPolicy` and :class:`NameGlobPolicy`.

Note [shared parameters]
A parameter registered on several modules (tied embedding and output head) must be gathered
whenever any of them runs. It is therefore owned by the *lowest common ancestor* unit of all
the modules that register it: auto-wrapping gives a candidate unit only the parameters whose
every registration lies inside it, and the enclosing unit (whose parameters stay gathered
through the whole of its forward and backward, which contains its children's) takes the
rest. When units are nested by hand this cannot be arranged after the fact, so a parameter
already owned by a unit and also registered outside it is an error that names both places.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "AutoWrapPolicy",
    "ModuleClassPolicy",
    "NameGlobPolicy",
    "SizePolicy",
    "auto_wrap",
    "claim_params",
    "registrations",
]

AutoWrapPolicy = Callable[[nn.Module, str, int], bool]

# id(parameter) -> (weak reference to it, the unit that owns it); the entry is dropped when
# the parameter dies. Keyed by id because tensors compare elementwise, not by identity.
_OWNER: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}


def _set_owner(param: torch.Tensor, unit: Any) -> None:
    key = id(param)
    _OWNER[key] = (weakref.ref(param, lambda _ref: _OWNER.pop(key, None)), unit)


@dataclass(frozen=True)
class SizePolicy:
    """Wrap a module when its not-yet-wrapped parameters reach ``min_num_params`` elements.

    Attributes:
        min_num_params: the threshold, in elements.
    """

    min_num_params: int = 10**8

    def __call__(self, module: nn.Module, name: str, unwrapped_numel: int) -> bool:
        """Return whether ``module`` should be a unit."""
        return unwrapped_numel >= self.min_num_params


def _values(given: Any, single: tuple[type, ...]) -> tuple[Any, ...]:
    """``given`` as a tuple: one value of a ``single`` type (or not iterable) alone, else its items."""
    if isinstance(given, single) or not isinstance(given, Iterable):
        return (given,)
    return tuple(given)


@dataclass(frozen=True, init=False)
class ModuleClassPolicy:
    """Wrap every module that is an instance of one of ``classes`` (e.g. a transformer block).

    Takes what torch's ``ModuleWrapPolicy`` takes: ``ModuleClassPolicy({Block})``,
    ``ModuleClassPolicy((Block, nn.Embedding))`` or ``ModuleClassPolicy(Block)``.

    Args:
        classes: one ``nn.Module`` subclass or any iterable of them (set, list, tuple).

    Attributes:
        classes: the module classes to wrap, as a tuple sorted by qualified name (a set's
            order differs between processes).

    Raises:
        TypeError: an element is not an ``nn.Module`` subclass (an instance, a class name
            as a string), named with the fix.
        ValueError: ``classes`` is empty (nothing would be wrapped).
    """

    classes: tuple[type[nn.Module], ...]

    def __init__(self, classes: type[nn.Module] | Iterable[type[nn.Module]]) -> None:
        items = _values(classes, (type, str))
        for c in items:
            if not (isinstance(c, type) and issubclass(c, nn.Module)):
                what = (f"an instance of {type(c).__name__}" if isinstance(c, nn.Module)
                        else f"the string {c!r} (a name, not the class)" if isinstance(c, str) else repr(c))
                raise TypeError(
                    f"ModuleClassPolicy takes nn.Module subclasses, got {what}; pass the classes themselves, e.g. "
                    "ModuleClassPolicy({Block}) or ModuleClassPolicy((Block, nn.Embedding))"
                )
        if not items:
            raise ValueError("ModuleClassPolicy got no classes, so it would wrap nothing (the model would be one "
                             "unit); pass the block class, e.g. ModuleClassPolicy({Block}), or auto_wrap_policy=None")
        ordered = sorted(set(items), key=lambda c: (c.__module__, c.__qualname__))
        object.__setattr__(self, "classes", tuple(ordered))

    def __call__(self, module: nn.Module, name: str, unwrapped_numel: int) -> bool:
        """Return whether ``module`` should be a unit."""
        return isinstance(module, self.classes)


@dataclass(frozen=True, init=False)
class NameGlobPolicy:
    """Wrap modules whose qualified name (without wrapper prefixes) matches a glob.

    Args:
        patterns: one ``fnmatch`` pattern such as ``"blocks.*"`` or any iterable of them
            (a single string is one pattern, not its characters).

    Attributes:
        patterns: the patterns, as a tuple.

    Raises:
        TypeError: a pattern is not a string.
    """

    patterns: tuple[str, ...]

    def __init__(self, patterns: str | Iterable[str]) -> None:
        items = _values(patterns, (str,))
        bad = [p for p in items if not isinstance(p, str)]
        if bad:
            raise TypeError(f"NameGlobPolicy takes fnmatch patterns as strings, got {bad[0]!r}; pass e.g. "
                            "NameGlobPolicy(('blocks.*', 'ln_f'))")
        object.__setattr__(self, "patterns", items)

    def __call__(self, module: nn.Module, name: str, unwrapped_numel: int) -> bool:
        """Return whether ``module`` should be a unit."""
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns)


def registrations(module: nn.Module) -> dict[int, list[str]]:
    """For every parameter under ``module``, the qualified names of the modules registering it.

    Args:
        module: the module tree (before wrapping).

    Returns:
        ``id(param) -> [module names]``; more than one name means a shared parameter.
    """
    out: dict[int, list[str]] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for param in mod._parameters.values():
            if param is not None:
                out.setdefault(id(param), []).append(mod_name)
    return out


def owner_of(param: torch.Tensor) -> Any:
    """The unit that owns ``param``, or ``None``."""
    entry = _OWNER.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def _walk(module: nn.Module, prefix: str, is_unit: Callable[[nn.Module], bool], skip: set[int],
          stack: tuple[nn.Module, ...]) -> Iterator[tuple[str, nn.Module, tuple[nn.Module, ...]]]:
    if id(module) in skip:
        return
    yield prefix, module, stack
    for child_name, child in module.named_children():
        inner = (*stack, child) if is_unit(child) else stack
        yield from _walk(child, f"{prefix}.{child_name}" if prefix else child_name, is_unit, skip, inner)


def claim_params(
    module: nn.Module,
    owner_unit: Any,
    is_unit: Callable[[nn.Module], bool],
    unit_of: Callable[[nn.Module], Any],
    excluded: set[int],
    ignored: set[int],
) -> list[nn.Parameter]:
    """Take ownership of the parameters under ``module`` that no unit below it owns.

    Args:
        module: the module being wrapped.
        owner_unit: the new unit (recorded as the owner; its ``name`` is used in messages).
        is_unit: tells a nested FSDP wrapper from a plain module.
        unit_of: maps a nested wrapper to the unit its parameters are owned by.
        excluded: ids of parameters left to an enclosing unit (Note [shared parameters]).
        ignored: ids of modules whose parameters FSDP must not manage.

    Returns:
        The parameters, deduplicated, in module-tree order.

    Raises:
        ValueError: a parameter owned by a nested unit is also registered outside it.
    """
    claimed: list[nn.Parameter] = []
    seen: set[int] = set()
    for mod_name, mod, stack in _walk(module, "", is_unit, ignored, ()):
        inside = [unit_of(u) for u in stack]
        for pname, param in mod._parameters.items():
            if param is None or id(param) in seen:
                continue
            full = f"{mod_name}.{pname}" if mod_name else pname
            owner = owner_of(param)
            if owner is not None:
                if not any(owner is u for u in inside):
                    raise ValueError(
                        f"parameter {full!r} is owned by FullyShardedDataParallel unit "
                        f"{getattr(owner, 'name', owner)!r} but is also "
                        f"used by module {mod_name or type(module).__name__!r} outside that unit; wrap every module "
                        "that uses a shared parameter in one unit, or wrap with auto_wrap_policy, which puts shared "
                        "parameters in the lowest unit enclosing all their users"
                    )
                continue
            if id(param) in excluded:
                continue
            seen.add(id(param))
            claimed.append(param)
    for param in claimed:
        _set_owner(param, owner_unit)
    return claimed


def auto_wrap(
    module: nn.Module,
    prefix: str,
    policy: AutoWrapPolicy,
    regs: dict[int, list[str]],
    ignored: set[int],
    is_unit: Callable[[nn.Module], bool],
    make_unit: Callable[[nn.Module, str, set[int]], nn.Module],
) -> None:
    """Wrap, bottom-up, every submodule ``policy`` selects (the root is wrapped by the caller).

    Submodules already wrapped by hand are left as they are, so the two ways of nesting
    combine; ignored modules are not entered; containers without a forward (``ModuleList``,
    ``ModuleDict``) are never wrapped themselves, only their children.

    Args:
        module: the module whose children to consider.
        prefix: ``module``'s qualified name plus ``"."`` (``""`` at the top).
        policy: decides which submodules become units.
        regs: :func:`registrations` of the top module, computed before any wrapping.
        ignored: ids of modules FSDP must not manage.
        is_unit: tells an FSDP wrapper from a plain module.
        make_unit: ``make_unit(child, qualified_name, excluded_param_ids)`` wraps ``child``.
    """
    for child_name, child in list(module.named_children()):
        if is_unit(child) or id(child) in ignored:
            continue
        qual = f"{prefix}{child_name}"
        auto_wrap(child, qual + ".", policy, regs, ignored, is_unit, make_unit)
        unwrapped = sum(p.numel() for p in child.parameters() if owner_of(p) is None)
        if not isinstance(child, (nn.ModuleList, nn.ModuleDict)) and policy(child, qual, unwrapped):
            # Note [shared parameters]: leave parameters also used outside to an enclosing unit.
            excluded = {pid for pid, users in regs.items()
                        if any(u != qual and not u.startswith(qual + ".") for u in users)}
            setattr(module, child_name, make_unit(child, qual, excluded))
