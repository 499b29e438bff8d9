"""Which gradients shardopt has sharded, and ``torch.nn.utils.clip_grad_norm_`` over them.

Note [clipping that bypasses the wrapper]
Under ShardedDataParallel each rank holds only the gradients it owns, under
FullyShardedDataParallel only its pieces of them, and under an OSS with master weights the
owners' gradients move to fp32 masters before the step (Note [master gradients] in
shardopt.optim.masters). torch's ``clip_grad_norm_`` over ``model.parameters()`` (what DDP
scripts and trainers call) would take each rank's *local* norm and clip every rank by a
different, too small factor: 7.2e-3 off DDP after 41 steps of a GPT under ZeRO-2, 8.3e-3
under ZeRO-3. So each wrapper registers its parameters here (held weakly, in its order),
and while one lives torch's function clips them by the global norm:

* parameters of a ShardedDataParallel or an OSS (any subset, any order, plain parameters
  mixed in): the global norm summed in the order passed, bit for bit torch's on the same
  gradients (Note [sharded norm in torch's order] in shardopt.optim.grad_norm); a plain
  parameter counts with this rank's own gradient, as torch would count it;
* parameters of a wrapper registered without a clip of its own (FullyShardedDataParallel):
  all of them and nothing else, clipped by its ``clip_grad_norm_``; a part is refused;
* parameters of two wrappers in one call are refused; no registered parameter: torch's
  own function, untouched.

The redirection is made in the one place every reference reaches: torch's public
``clip_grad_norm_`` is a ``no_grad`` wrapper around the real function, held in a closure
cell, and shardopt swaps that cell's content. So a ``from torch.nn.utils import
clip_grad_norm_`` made before the wrapper was built, and ``torch.nn.utils.clip_grad_norm``
(deprecated, calls it), are covered too. If a torch release changes that wrapper, the module
attributes ``torch.nn.utils.clip_grad_norm_`` and ``torch.nn.utils.clip_grad.clip_grad_norm_``
are replaced instead, and a reference bound earlier keeps torch's local clip.
``torch.nn.utils.get_total_norm`` and ``clip_grads_with_norm_`` are not redirected. When no
live wrapper is left (closed or collected), torch's function is put back, unless something
else replaced shardopt's meanwhile.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler

__all__ = [
    "ClipArgs",
    "ClipFn",
    "Registration",
    "in_wrapper_order",
    "refuse_torch_grad_scaler",
    "refuse_torch_scaler_read",
    "register_sharded",
    "sharded_by",
    "sharded_by_another",
    "torch_grad_scaler_refused",
    "torch_scaler_asks",
    "unregister",
]


@dataclass(frozen=True)
class ClipArgs:
    """What ``torch.nn.utils.clip_grad_norm_`` was asked, besides the parameters."""

    max_norm: float
    """The largest allowed total norm."""
    norm_type: float = 2.0
    """The p of the p-norm; ``inf`` for the max norm."""
    error_if_nonfinite: bool = False
    """Raise (on every rank) when the total norm is nan or inf, as torch does."""
    foreach: bool | None = None
    """torch's ``foreach``: ``False`` takes each norm with ``linalg.vector_norm``."""


ClipFn = Callable[[Any, list[torch.Tensor], ClipArgs], torch.Tensor]
"""A wrapper's clip: ``clip(wrapper, parameters passed, args) -> total norm``, a collective."""


@dataclass(frozen=True)
class Registration:
    """A parameter's registration: who shards its gradient."""

    wrapper: object
    """The live wrapper that shards it."""
    position: int
    """Its place in the wrapper's registration (the module's order for ShardedDataParallel)."""
    method: str
    """The wrapper's own clip, for messages (e.g. ``"OSS.clip_grad_norm"``)."""
    clip: ClipFn | None
    """How torch's clip is carried out over the wrapper's parameters (``None``: whole, by
    the wrapper's ``clip_grad_norm_``)."""


@dataclass(frozen=True)
class _Entry:
    param: weakref.ref[torch.Tensor]
    wrapper: weakref.ref[object]
    position: int
    method: str
    clip: ClipFn | None


_sharded: dict[int, _Entry] = {}  # by id(param); an entry counts only while both refs live
_live: weakref.WeakSet[object] = weakref.WeakSet()
_installed: _Redirect | None = None


def register_sharded(wrapper: object, params: Iterable[torch.Tensor], method: str, clip: ClipFn | None = None) -> None:
    """Mark ``params`` as holding gradients sharded by ``wrapper`` (Note [clipping that bypasses the wrapper]).

    A later registration of a parameter replaces an earlier one (ShardedDataParallel's
    replaces its OSS's).

    Args:
        wrapper: the live wrapper (held weakly: once it is collected its parameters stop counting).
        params: the wrapper's parameters, in the order a clip of all of them sums.
        method: the wrapper's own clip, for messages (e.g. ``"OSS.clip_grad_norm"``).
        clip: how torch's clip is carried out over them; ``None``: only all of them, by
            ``wrapper.clip_grad_norm_(max_norm, norm_type)``.
    """
    # Live first, then install: a garbage collection while the entries are made can finalize an
    # earlier wrapper, whose finalizer restores torch's function unless a live wrapper is seen;
    # with this one not yet in _live it was restored under a registered wrapper, and torch's
    # clip_grad_norm_ went on clipping by each rank's local norm (measured: 0.49 off DDP's norm).
    if wrapper not in _live:
        _live.add(wrapper)
        weakref.finalize(wrapper, _restore_when_unused)
    _install()
    owner = weakref.ref(wrapper)
    for position, p in enumerate(params):
        key = id(p)
        _sharded[key] = _Entry(weakref.ref(p, functools.partial(_collected, key)), owner, position, method, clip)


def unregister(wrapper: object, params: Iterable[torch.Tensor]) -> None:
    """Forget ``wrapper`` and its ``params`` (it was closed); put torch's function back if it was the last."""
    for p in params:
        entry = _sharded.get(id(p))
        if entry is not None and entry.param() is p and entry.wrapper() is wrapper:
            del _sharded[id(p)]
    _live.discard(wrapper)
    _restore_when_unused()


def sharded_by(param: torch.Tensor) -> Registration | None:
    """Who shards ``param``'s gradient, or ``None`` when no live wrapper does."""
    entry = _sharded.get(id(param))
    if entry is None or entry.param() is not param:
        return None
    wrapper = entry.wrapper()
    if wrapper is None:
        return None
    return Registration(wrapper, entry.position, entry.method, entry.clip)


def sharded_by_another(params: Iterable[torch.Tensor], wrapper: object) -> bool:
    """Whether a live wrapper other than ``wrapper`` shards the gradient of one of ``params``."""
    return any(r is not None and r.wrapper is not wrapper for r in map(sharded_by, params))


def in_wrapper_order(params: Iterable[torch.Tensor], wrapper: object) -> list[torch.Tensor]:
    """``params`` in the order another live wrapper registered them (the module's order under
    ShardedDataParallel), those it does not shard after them in the order given."""
    given = list(params)
    found = [sharded_by(p) for p in given]
    place = [(0, r.position) if r is not None and r.wrapper is not wrapper else (1, i) for i, r in enumerate(found)]
    return [given[i] for i in sorted(range(len(given)), key=place.__getitem__)]


def torch_scaler_asks(frame: types.FrameType) -> bool:
    """Whether ``frame`` (the caller of a property) is torch's own ``GradScaler.step``, the one
    reader OSS raises ``_step_supports_amp_scaling`` for (Note [torch's GradScaler on sharded
    gradients] in ``shardopt.optim.grad_scaler``)."""
    return frame.f_code is GradScaler.step.__code__


def refuse_torch_grad_scaler(optimizer: object, rank: int) -> None:
    """Raise if torch's ``GradScaler`` is stepping ``optimizer`` through its
    ``_step_supports_amp_scaling`` protocol (it set ``found_inf``), on every rank alike
    (Note [torch's GradScaler on sharded gradients] in ``shardopt.optim.grad_scaler``).

    Raises:
        RuntimeError: naming ``ShardedGradScaler``.
    """
    if getattr(optimizer, "found_inf", None) is None:
        return
    for name in ("found_inf", "grad_scale"):  # torch deletes them only after a step that returns
        optimizer.__dict__.pop(name, None)
    raise torch_grad_scaler_refused(rank)


def check_step(optimizer: object, params: Iterable[torch.Tensor], rank: int) -> None:
    """Before ``optimizer`` (an OSS) steps: :func:`refuse_torch_grad_scaler`, then the check of
    the wrapper that shards ``params`` (ShardedDataParallel's ``check_optimizer_step``: no
    step inside an unfinished ``no_replicate_sync`` window, Note [hybrid reduction] in
    ``shardopt.nn.data_parallel.replicas``). Local: no collective.

    Raises:
        RuntimeError: either refuses.
    """
    refuse_torch_grad_scaler(optimizer, rank)
    for registration in map(sharded_by, params):
        if registration is not None and registration.wrapper is not optimizer:
            check = getattr(registration.wrapper, "check_optimizer_step", None)
            if check is not None:
                check()
            return


def refuse_torch_scaler_read(frame: types.FrameType, params: Iterable[torch.Tensor], wrapper: object, rank: int) -> bool:
    """``_step_supports_amp_scaling`` of an OSS: raise (:func:`torch_grad_scaler_refused`) when
    ``frame`` is torch's ``GradScaler.step`` and a ShardedDataParallel shards ``params``, else
    ``False`` (Note [torch's GradScaler on sharded gradients] in ``shardopt.optim.grad_scaler``)."""
    if torch_scaler_asks(frame) and sharded_by_another(params, wrapper):
        raise torch_grad_scaler_refused(rank)
    return False


def torch_grad_scaler_refused(rank: int) -> RuntimeError:
    """The error for torch's ``GradScaler`` stepping an OSS under ShardedDataParallel."""
    return RuntimeError(
        f"[rank {rank}] torch.amp.GradScaler cannot step an OSS under ShardedDataParallel: each rank holds and "
        "checks only its own gradients for inf/nan, so one rank would skip the step alone and hang the others; "
        "use shardopt.optim.ShardedGradScaler (same arguments), which agrees on inf/nan across ranks"
    )


def _collected(key: int, ref: weakref.ref[torch.Tensor]) -> None:
    entry = _sharded.get(key)
    if entry is not None and entry.param is ref:  # not a newer parameter that reused the id
        del _sharded[key]


# ------------------------------------------------------------------ torch's function


def _clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                     foreach: bool | None = None) -> torch.Tensor:
    """torch's ``clip_grad_norm_``, by the global norm over sharded gradients (Note [clipping that bypasses the wrapper])."""
    assert _installed is not None, "shardopt's clip_grad_norm_ ran while not installed"
    is_generator = isinstance(parameters, types.GeneratorType)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    found = [(p, sharded_by(p)) for p in params]
    registrations = {id(r.wrapper): r for _, r in found if r is not None}
    if not registrations:
        again = (p for p in params) if is_generator else params  # torch warns about an empty generator
        return _installed.torch_fn(again, max_norm, norm_type, error_if_nonfinite, foreach)
    if len(registrations) > 1:
        names = sorted({f"{type(r.wrapper).__name__} (clipped by {r.method})" for r in registrations.values()})
        raise ValueError(
            f"torch.nn.utils.clip_grad_norm_ was given parameters of {len(registrations)} shardopt wrappers "
            f"({', '.join(names)}); one call combines one model's gradients: clip each model's parameters in "
            "its own call"
        )
    reg = next(iter(registrations.values()))
    args = ClipArgs(float(max_norm), float(norm_type), error_if_nonfinite, foreach)
    if reg.clip is not None:
        return reg.clip(reg.wrapper, params, args)
    return _clip_whole(reg, [p for p, r in found if r is None], {id(p) for p, r in found if r is not None}, args)


def _clip_whole(reg: Registration, plain: list[torch.Tensor], passed: set[int], args: ClipArgs) -> torch.Tensor:
    """Clip a wrapper that clips only all of its parameters (FullyShardedDataParallel)."""
    count = sum(1 for e in list(_sharded.values()) if e.wrapper() is reg.wrapper and e.param() is not None)
    name = type(reg.wrapper).__name__
    if plain or len(passed) != count:
        raise ValueError(
            f"torch.nn.utils.clip_grad_norm_ was given {len(passed)} of the {count} parameters of a {name}"
            + (f" and {len(plain)} parameter(s) outside it" if plain else "")
            + f": its gradients are sharded as flat pieces, so only all of them together can be clipped: pass "
            f"model.parameters() of the {name} (all of them, nothing else), or call {reg.method}(max_norm)"
        )
    total: torch.Tensor = getattr(reg.wrapper, "clip_grad_norm_")(args.max_norm, args.norm_type)  # noqa: B009 - typed object
    if args.error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"The total norm of order {args.norm_type} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped (the gradients were clipped by it already). Set `error_if_nonfinite=False` to scale them "
            "anyway without this error"
        )
    return total


@dataclass
class _Redirect:
    """How torch's function was redirected, to undo it."""

    torch_fn: Callable[..., torch.Tensor]
    """torch's function as it was (the undecorated one when ``cell`` is set)."""
    cell: Any = None
    """The closure cell of torch's ``no_grad`` wrapper, or ``None`` when attributes were replaced."""
    replacement: Callable[..., torch.Tensor] | None = None
    """What was put in the module attributes (no cell)."""


def _torch_cell(public: Any) -> Any:
    """The closure cell of torch's ``no_grad`` wrapper that holds the real ``clip_grad_norm_``, if
    the wrapper is the one known (``_no_grad_wrapper`` closing over ``func``)."""
    code = getattr(public, "__code__", None)
    closure = getattr(public, "__closure__", None)
    if code is None or closure is None or tuple(code.co_freevars) != ("func",):
        return None
    cell = closure[0]
    inner = cell.cell_contents
    return cell if callable(inner) and getattr(inner, "__name__", "") == "clip_grad_norm_" else None


def _install() -> None:
    global _installed
    if _installed is not None:
        return
    public = torch.nn.utils.clip_grad.clip_grad_norm_
    cell = _torch_cell(public)
    if cell is not None:
        _installed = _Redirect(cell.cell_contents, cell=cell)
        cell.cell_contents = _clip_grad_norm_
        return
    replacement = functools.wraps(public)(torch.no_grad()(_clip_grad_norm_))
    _installed = _Redirect(public, replacement=replacement)
    torch.nn.utils.clip_grad.clip_grad_norm_ = replacement  # type: ignore[assignment]
    torch.nn.utils.clip_grad_norm_ = replacement  # type: ignore[assignment]


def _restore_when_unused() -> None:
    global _installed
    if _installed is None or any(True for _ in _live):  # a WeakSet yields only live wrappers
        return
    done, _installed = _installed, None
    if done.cell is not None:
        if done.cell.cell_contents is _clip_grad_norm_:  # leave a later replacement by someone else alone
            done.cell.cell_contents = done.torch_fn
        return
    if torch.nn.utils.clip_grad.clip_grad_norm_ is done.replacement:
        torch.nn.utils.clip_grad.clip_grad_norm_ = done.torch_fn  # type: ignore[assignment]
    if torch.nn.utils.clip_grad_norm_ is done.replacement:
        torch.nn.utils.clip_grad_norm_ = done.torch_fn  # type: ignore[assignment]
