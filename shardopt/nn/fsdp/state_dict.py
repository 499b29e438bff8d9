"""Sharded model state of FSDP units as ``torch.distributed.checkpoint``-compatible structures.

Note [sharded state dict]
Each rank holds, for every original parameter, one contiguous range of the flattened
parameter (Note [flat parameter layout]). That is exactly a 1-D ``ShardedTensor`` of the
parameter's ``numel`` elements whose local shard is this rank's piece (no local shard
where the piece is empty), so :meth:`sharded_state_dict` returns one such tensor per
parameter, under the original name, and ``torch.distributed.checkpoint`` can save it with
every rank writing only its pieces. To load at another world size (or with another
wrapping), build the *new* model's sharded state dict, let ``dcp.load`` fill it in place
(it reads whichever saved ranges overlap each new piece), then
:meth:`load_sharded_state_dict`. Parameters of a NO_SHARD unit are plain 1-D tensors of
the same ``numel`` elements (so a folder loads across strategies), parameters outside any
unit keep their shapes, and those and the buffers are plain tensors that ``dcp``
deduplicates. Under HYBRID_SHARD each
replica group describes the same pieces (placed on its own global ranks) and ``dcp``
keeps one copy of each.

Note [state dict through a parent]
Trainers save ``lightning_module.state_dict()`` or ``model.state_dict()`` of a module that
*contains* the wrapper, so torch's recursion reaches the wrapper with a prefix. It then
answers like a direct call (full tensors, original names, under the prefix) instead of
its internal wrapper levels and 1-D shards, so such a file loads into the plain model. A
parent's ``load_state_dict`` likewise works: a pre-hook gathers full parameters and maps
the clean names to the wrapper levels, and a post-hook writes the loaded values back to
the shards. Both are collectives: every rank calls the parent's method.

Note [state dict of the wrapped module]
DDP users write ``raw_model = model.module`` and save ``raw_model.state_dict()``. Under
FSDP, ``model.module`` is the wrapped module, whose own parameters are this rank's rows
of the unit's shard between steps (Note [flat parameter layout]); torch's recursion would
return them as they are, shards under full names, without a word. So every wrapped module
carries state-dict hooks (:class:`WrappedStateDict`): called from outside FSDP, the
pre-hook gathers the unit's own parameters (``summon_full_params(recurse=False)``, nested
units answer through their wrappers as above), the post-hook replaces kept parameter
objects (``keep_vars=True``) by copies and releases the gather. The result is the full
state dict with the wrapped module's own names, and, like ``model.state_dict()``, a
collective: call it on every rank (``model.state_dict(rank0_only=True)`` returns it on
rank 0 only).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata, init_from_local_shards

from shardopt import comm
from shardopt.nn.fsdp.flat_param import ParamSlot
from shardopt.nn.fsdp.records import TrainingState
from shardopt.nn.fsdp.unit import Unit
from shardopt.state_checks import check_model_state, dtypes, shapes

__all__ = [
    "WRAPPED", "ParentLoad", "WrappedStateDict", "check_loadable", "clean_name", "load_sharded", "local_piece",
    "piece_tensor", "sharded_state", "under_prefix",
]

WRAPPED = "_fsdp_wrapped_module"
"""The attribute under which a wrapper holds its module (one level in raw parameter names)."""


def clean_name(name: str) -> str:
    """A parameter/buffer name without the wrapper levels FSDP inserted."""
    return name.replace(WRAPPED + ".", "")


def check_loadable(full: dict[str, Any], given: dict[str, Any], strict: bool) -> None:
    """Every name (with ``strict``), shape and dtype of a full state dict before the first
    write: ``nn.Module.load_state_dict`` copies what fits and raises afterwards, which would
    leave a half-loaded model.

    Raises:
        ValueError: ``given`` does not fit ``full`` (nothing was written).
    """
    full, given = ({clean_name(k): v for k, v in d.items()} for d in (full, given))
    check_model_state("(the state dict passed to load_state_dict)", shapes(full), shapes(given), dtypes(full),
                      dtypes(given), strict=strict)


def local_piece(value: ShardedTensor, param: torch.Tensor, what: str, fix: str) -> torch.Tensor:
    """This rank's 1-D piece of a sharded entry (empty where it holds none), which must have
    as many elements as ``param`` (this rank's piece of the parameter).

    Raises:
        ValueError: another number of elements (a load target of another layout); ``what``
            names the entry and ``fix`` says what to do.
    """
    local = value.local_shards()
    piece = local[0].tensor.reshape(-1) if local else torch.empty(0, dtype=value.dtype)
    if piece.numel() != param.numel():
        raise ValueError(f"{what} holds {piece.numel()} elements on this rank but its piece has {param.numel()}; {fix}")
    return piece


class ParentLoad:
    """The load-state-dict hooks of one wrapper (Note [state dict through a parent]).

    Args:
        unit: the wrapper's unit (its training state says whether an enclosing call
            already gathered the parameters).
        summon: enters the wrapper's ``summon_full_params(recurse=True, writeback=True)``.
    """

    def __init__(self, unit: Unit, summon: Callable[[], AbstractContextManager[None]]) -> None:
        self.unit, self.summon = unit, summon
        self.stack: ExitStack | None = None

    def pre(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A parent's ``load_state_dict`` reached the wrapper: gather full parameters (written
        back by :meth:`post`) and rename this subtree's clean keys to the raw ones."""
        if self.unit.training_state is not TrainingState.SUMMON_FULL_PARAMS:
            self.stack = ExitStack()
            self.stack.enter_context(self.summon())
        raw = [n for n, _ in nn.Module.named_parameters(module, remove_duplicate=False)]
        raw += [n for n, _ in nn.Module.named_buffers(module, remove_duplicate=False)]
        for name in raw:
            clean = clean_name(name)
            if clean != name and prefix + clean in state_dict and prefix + name not in state_dict:
                state_dict[prefix + name] = state_dict.pop(prefix + clean)

    def post(self, module: nn.Module, incompatible: Any) -> None:
        """After the wrapper's subtree is loaded: clean the reported names, write back."""
        incompatible.missing_keys[:] = [clean_name(k) for k in incompatible.missing_keys]
        incompatible.unexpected_keys[:] = [clean_name(k) for k in incompatible.unexpected_keys]
        if self.stack is not None:
            stack, self.stack = self.stack, None
            stack.close()


def under_prefix(full: dict[str, Any], args: tuple[Any, ...], destination: Any, prefix: str) -> Any:
    """A parent's ``state_dict`` recursion reached a wrapper: the same full, clean-named
    tensors ``full`` a direct call gives, under the parent's ``prefix`` (Note [state dict
    through a parent]); ``args`` is torch's old positional form ``(destination, prefix, keep_vars)``."""
    if args:
        destination = args[0]
        prefix = args[1] if len(args) > 1 else prefix
    dest = destination if destination is not None else OrderedDict()
    for name, value in full.items():
        dest[prefix + name] = value
    return dest


class Summoning(Protocol):
    """What :class:`WrappedStateDict` needs of its wrapper."""

    @property
    def unit(self) -> Unit: ...

    def summon_full_params(self, recurse: bool = ..., writeback: bool = ...) -> AbstractContextManager[None]: ...


class WrappedStateDict:
    """The state-dict hooks of one wrapped module (Note [state dict of the wrapped module]).

    Args:
        wrapper: a weak reference to the wrapper (the hooks stay on the module after
            shardopt's ``release()`` and must not keep the wrapper's shards alive).
    """

    def __init__(self, wrapper: Callable[[], Summoning | None]) -> None:
        self.wrapper = wrapper
        self.stack: ExitStack | None = None

    def _unit_of(self, module: nn.Module) -> Unit | None:
        wrapper = self.wrapper()
        unit = wrapper.unit if wrapper is not None else None
        if unit is None or unit.handle is None or unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
            return None  # released, nothing sharded here, or FSDP's own state_dict already gathered
        first = unit.handle.params[0]  # not the module's any more after shardopt's release()
        return unit if any(p is first for p in module.parameters()) else None

    def pre(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        """``module.state_dict()`` called from outside FSDP: gather the unit's own parameters."""
        wrapper = self.wrapper()
        if self.stack is None and wrapper is not None and self._unit_of(module) is not None:
            self.stack = ExitStack()
            self.stack.enter_context(wrapper.summon_full_params(recurse=False, writeback=False))

    def post(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        """Copy gathered parameters kept as objects (``keep_vars``) and release the gather."""
        if self.stack is None:
            return
        wrapper = self.wrapper()
        handle = wrapper.unit.handle if wrapper is not None else None
        own = {id(p) for p in handle.params} if handle is not None else set()
        for key, value in state_dict.items():
            if key.startswith(prefix) and id(value) in own:
                state_dict[key] = value.detach().clone()
        stack, self.stack = self.stack, None
        stack.close()


def _locate(units: list[Unit]) -> dict[int, Unit]:
    return {id(p): u for u in units if u.handle is not None for p in u.handle.params}


def _slots(units: list[Unit]) -> dict[int, ParamSlot]:
    return {
        id(p): slot for u in units if u.handle is not None for p, slot in zip(u.handle.params, u.handle.layout.slots, strict=True)
    }


def sharded_state(units: list[Unit], named_params: dict[str, nn.Parameter],
                  named_buffers: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The sharded state dict (Note [sharded state dict]).

    Args:
        units: the model's FSDP units (their parameters must be sharded, i.e. between steps).
        named_params: the model's parameters by original name.
        named_buffers: the model's buffers by original name.

    Returns:
        ``{name: ShardedTensor | Tensor}``; the sharded entries view the live shards.
    """
    where, slots = _locate(units), _slots(units)
    out: dict[str, Any] = OrderedDict()
    for name, param in named_params.items():
        unit = where.get(id(param))
        if unit is None or unit.handle is None:
            out[name] = param.detach()
            continue
        if unit.config.shard_size == 1:  # the whole parameter, 1-D like the sharded entries
            out[name] = param.detach().reshape(-1)
            continue
        out[name] = piece_tensor(param.detach(), slots[id(param)], unit.config.shard_group)
    for name, buf in named_buffers.items():
        out[name] = buf.detach()
    return out


def piece_tensor(piece: torch.Tensor, slot: ParamSlot, group: comm.ProcessGroup | None) -> ShardedTensor:
    """This rank's 1-D ``piece`` of a parameter of ``slot`` as a ``ShardedTensor`` over its
    ``numel`` elements (collective over ``group``). Also used for optimizer state pieces."""
    shards = []
    if slot.piece_numel:
        placement = f"rank:{comm.group_rank(None)}/{piece.device}"  # a global rank
        meta = ShardMetadata([slot.piece_begin], [slot.piece_numel], placement)
        shards.append(Shard(piece.reshape(-1), meta))
    return init_from_local_shards(shards, slot.numel, process_group=group)


def load_sharded(units: list[Unit], named_params: dict[str, nn.Parameter],
                 named_buffers: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    """Copy a sharded state dict (this model's layout, e.g. filled by ``dcp.load``) into the shards.

    Args:
        units: the model's FSDP units.
        named_params: the model's parameters by original name.
        named_buffers: the model's buffers by original name.
        state: ``{name: ShardedTensor | Tensor}`` covering every parameter and buffer.

    Raises:
        ValueError: names missing, or an entry whose pieces, shapes or dtypes do not fit
            (checked before anything is written).
    """
    missing = [n for n in list(named_params) + list(named_buffers) if n not in state]
    if missing:
        raise ValueError(
            f"the sharded state dict lacks {missing[:5]}; build it with this model's sharded_state_dict() "
            "and fill it with torch.distributed.checkpoint.load"
        )
    where = _locate(units)
    # Every piece is found and checked before the first write (a failed load changes nothing).
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, param in named_params.items():
        value, unit = state[name], where.get(id(param))
        if isinstance(value, ShardedTensor):
            copies.append((param.reshape(-1), local_piece(value, param, f"sharded entry {name!r}",
                                                          "use this model's own sharded_state_dict() as the load target")))
        elif unit is not None and unit.handle is not None:
            copies.append((param.reshape(-1), value.reshape(-1)))
        else:
            copies.append((param, value))
    copies += [(buf, state[name]) for name, buf in named_buffers.items()]
    bad = [(tuple(dst.shape), tuple(src.shape), src.dtype, dst.dtype) for dst, src in copies
           if dst.shape != src.shape or not torch.can_cast(src.dtype, dst.dtype)]
    if bad:
        raise ValueError(f"the sharded state dict does not fit this model (e.g. a piece of shape {bad[0][1]} and "
                         f"dtype {bad[0][2]} for a target of shape {bad[0][0]} and dtype {bad[0][3]}); build it with "
                         "this model's sharded_state_dict() and fill it with torch.distributed.checkpoint.load. "
                         "Nothing was loaded")
    for unit in units:
        if unit.handle is not None:
            unit.handle.settle()  # no upload still reads an offloaded shard (Note [offloaded shards])
    with torch.no_grad():
        for dst, src in copies:
            dst.copy_(src)
