"""Optimizer state of FSDP models: consolidate to a plain full state dict, re-shard it, or
describe it sharded for ``torch.distributed.checkpoint``.

An optimizer built on ``FullyShardedDataParallel(...).parameters()`` sees this rank's rows
of the original parameters (Note [flat parameter layout]), so its per-parameter state tensors
(``exp_avg``, ``momentum_buffer``, ...) are pieces too. Consolidation gathers each piece into
the parameter's full shape and keys everything by original parameter name; the result
has no trace of the world size and can be re-sharded for any world size, strategy or
wrapping of the same model.

Note [sharded optimizer state dict]
A full optimizer state does not fit on one rank at the sizes ZeRO-3 is for, so
:func:`sharded_optim_state_dict` describes it the way ``sharded_state`` describes the
parameters (Note [sharded state dict] in ``state_dict``): every state tensor that is this
rank's piece of a parameter becomes a 1-D ``ShardedTensor`` over the parameter's ``numel``
elements, keyed ``state.<parameter name>.<state key>``; scalars (``step``) and the param
groups (hyperparameters, parameter names, one tuple) are replicated values that ``dcp``
writes once.
``dcp.save`` then has every rank write only its pieces. To load at any world size or
wrapping, build the new model's and optimizer's own sharded optimizer state dict as the
target (a fresh optimizer's state is first created by one step with zero gradients and a
learning rate of 0, as torch's ``torch.distributed.checkpoint.state_dict`` does), let
``dcp.load`` fill it in place, and pass it to :func:`load_sharded_optim_state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from shardopt import comm
from shardopt.nn.fsdp.flat_param import ParamSlot
from shardopt.nn.fsdp.state_dict import local_piece, piece_tensor
from shardopt.nn.fsdp.unit import Unit

__all__ = [
    "full_optim_state_dict",
    "load_sharded_optim_state_dict",
    "shard_full_optim_state_dict",
    "sharded_optim_state_dict",
]


def _locate(units: list[Unit]) -> dict[int, tuple[Unit, ParamSlot]]:
    where: dict[int, tuple[Unit, ParamSlot]] = {}
    for unit in units:
        if unit.handle is not None:
            for p, slot in zip(unit.handle.params, unit.handle.layout.slots, strict=True):
                where[id(p)] = (unit, slot)
    return where


def _is_piece(value: Any, slot: ParamSlot) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == slot.local_shape


def _gather_piece(unit: Unit, slot: ParamSlot, piece: torch.Tensor) -> torch.Tensor:
    """The full-shaped tensor of every rank's ``piece``, on ``piece``'s device; gathered on
    the unit's compute device (an offloaded piece is on the host, Note [offloaded shards])."""
    handle = unit.handle
    assert handle is not None
    layout = handle.layout
    shard = torch.zeros(layout.shard_numel, dtype=piece.dtype, device=handle.device)
    handle.local_of(shard, slot).copy_(piece)
    if unit.config.shard_size == 1:
        packed = shard
    else:
        packed = torch.empty(layout.padded_numel, dtype=piece.dtype, device=handle.device)
        comm.all_gather_into(packed, shard, unit.config.shard_group, label="shardopt::fsdp::optim_state").wait()
    # The parameter's rows, strided across the rank-major buffer (Note [flat parameter layout]).
    return layout.rows_in(packed, slot).reshape(-1)[: slot.numel].reshape(slot.shape).to(piece.device, copy=True)


def full_optim_state_dict(
    units: list[Unit], named_params: dict[str, nn.Parameter], optim: torch.optim.Optimizer, rank0_only: bool
) -> dict[str, Any]:
    """Gather a sharded optimizer's state into full-shaped tensors keyed by parameter name.

    Collective: every rank of the model's groups must call it.

    Args:
        units: the model's FSDP units.
        named_params: the model's parameters by original name.
        optim: an optimizer over (some of) those parameters.
        rank0_only: return the result on global rank 0 only (others get ``{}``).

    Returns:
        ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``.

    Raises:
        ValueError: the optimizer holds a parameter that is not the model's, or ranks hold
            different state keys (e.g. one rank stepped and another did not).
    """
    names = {id(p): n for n, p in named_params.items()}
    where = _locate(units)
    osd = optim.state_dict()
    ordered = [p for group in optim.param_groups for p in group["params"]]
    for p in ordered:
        if id(p) not in names:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the model's "
                "parameters; build the optimizer on the FullyShardedDataParallel model's parameters()"
            )
    keys = [sorted(osd["state"].get(i, {}).keys()) for i in range(len(ordered))]
    if comm.group_size(None) > 1 and len({repr(k) for k in comm.all_gather_object(keys, None)}) != 1:
        raise ValueError(
            "ranks hold different optimizer state keys; consolidate after the same number of optimizer "
            "steps on every rank"
        )
    state: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(ordered):
        entry: dict[str, Any] = {}
        for key, value in osd["state"].get(i, {}).items():
            located = where.get(id(p))
            if located is not None and _is_piece(value, located[1]):
                entry[key] = _gather_piece(located[0], located[1], value)
            else:
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
        if entry:
            state[names[id(p)]] = entry
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
        for group in optim.param_groups
    ]
    if rank0_only and comm.group_rank(None) != 0:
        return {}
    return {"state": state, "param_groups": groups}


def shard_full_optim_state_dict(
    full_osd: dict[str, Any], units: list[Unit], named_params: dict[str, nn.Parameter], optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """Cut a consolidated optimizer state dict to this rank's pieces, for ``optim.load_state_dict``.

    Local (no communication): every rank passes the full dict.

    Args:
        full_osd: from :func:`full_optim_state_dict` (any world size or strategy).
        units: this model's FSDP units.
        named_params: this model's parameters by original name.
        optim: the optimizer that will load the result, built on this model's parameters
            with the same grouping as the one that was consolidated.

    Returns:
        A state dict in ``torch.optim`` format (integer parameter ids).

    A plain ``torch.optim`` state dict (e.g. saved from DDP, keyed by index) is mapped to
    ``optim``'s parameters by position, as ``Optimizer.load_state_dict`` would map it.

    Raises:
        ValueError: the dict is not a full optimizer state dict, or its groups or names do
            not match ``optim`` (for an index-keyed dict: group sizes or shapes at a position).
    """
    if not isinstance(full_osd, dict) or "state" not in full_osd or "param_groups" not in full_osd:
        raise ValueError(
            "full_osd must be the dict returned by full_optim_state_dict (with 'state' and 'param_groups'); "
            "on ranks other than 0 with rank0_only=True it is empty, so broadcast or load it on every rank"
        )
    names = {id(p): n for n, p in named_params.items()}
    where = _locate(units)
    if _index_keyed(full_osd):
        full_osd = _keyed_by_name(full_osd, optim, names, where)
    if len(full_osd["param_groups"]) != len(optim.param_groups):
        raise ValueError(
            f"full_osd has {len(full_osd['param_groups'])} param groups but optim has {len(optim.param_groups)}; "
            "build the optimizer with the same grouping as the one that was consolidated"
        )
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for saved_group, group in zip(full_osd["param_groups"], optim.param_groups, strict=False):
        ids = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None or name not in saved_group["params"]:
                raise ValueError(
                    f"parameter {name!r} of the optimizer is not in the matching param group of full_osd "
                    f"({saved_group['params'][:5]}...); build the optimizer over the same parameters"
                )
            entry = {}
            for key, value in full_osd["state"].get(name, {}).items():
                located = where.get(id(p))
                if located is not None and isinstance(value, torch.Tensor) and value.shape == located[1].shape \
                        and value.dim() > 0:
                    slot = located[1]
                    value = value.reshape(-1)[slot.piece_begin : slot.piece_begin + slot.piece_numel]
                    value = value.view(slot.local_shape)
                entry[key] = value.clone().to(p.device) if isinstance(value, torch.Tensor) else value
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def _index_keyed(osd: dict[str, Any]) -> bool:
    return any(isinstance(i, int) for g in osd["param_groups"] for i in g.get("params", ()))


def _keyed_by_name(osd: dict[str, Any], optim: torch.optim.Optimizer, names: dict[int, str],
                   where: dict[int, tuple[Unit, ParamSlot]]) -> dict[str, Any]:
    """A plain ``torch.optim`` state dict (parameters keyed by index) keyed by this model's
    parameter names instead, mapping by position: the i-th saved parameter of each group is
    the i-th parameter of ``optim``'s matching group, as ``Optimizer.load_state_dict`` maps it.

    Raises:
        ValueError: the group sizes differ, or a saved state tensor's shape is not its
            parameter's full shape (the parameters are in another order).
    """
    fix = ("build the optimizer over the parameters in the order and grouping of the one that was saved "
           "(e.g. the same param groups over model.parameters()), or save with "
           "FullyShardedDataParallel.full_optim_state_dict (keyed by name)")
    saved_sizes = [len(g["params"]) for g in osd["param_groups"]]
    sizes = [len(g["params"]) for g in optim.param_groups]
    if saved_sizes != sizes:
        raise ValueError(
            f"full_osd is a plain torch.optim state dict (parameters keyed by index), mapped to this optimizer's "
            f"parameters by position, but its param groups hold {saved_sizes} parameters and optim's hold {sizes}; {fix}"
        )
    mapping: dict[int, str] = {}
    for saved, group in zip(osd["param_groups"], optim.param_groups, strict=False):
        for index, p in zip(saved["params"], group["params"], strict=False):
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the model's "
                    "parameters; build the optimizer on the FullyShardedDataParallel model's parameters()"
                )
            mapping[index] = names[id(p)]
            located = where.get(id(p))
            full_shape = located[1].shape if located is not None else p.shape
            for key, value in osd["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != full_shape:
                    raise ValueError(
                        f"full_osd is a plain torch.optim state dict (parameters keyed by index): its state "
                        f"{key!r} of parameter {index} has shape {tuple(value.shape)}, but the parameter at that "
                        f"position, {names[id(p)]!r}, has shape {tuple(full_shape)}; {fix}"
                    )
    return {
        "state": {mapping[i]: v for i, v in osd["state"].items() if i in mapping},
        "param_groups": [{**g, "params": [mapping[i] for i in g["params"]]} for g in osd["param_groups"]],
    }


def _names_in_order(named_params: dict[str, nn.Parameter], optim: torch.optim.Optimizer) -> list[str]:
    names = {id(p): n for n, p in named_params.items()}
    ordered = []
    for group in optim.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the model's "
                    "parameters; build the optimizer on the FullyShardedDataParallel model's parameters()"
                )
            ordered.append(names[id(p)])
    return ordered


def _init_state(optim: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state without changing a parameter: one step with zero
    gradients and every learning rate 0 (Note [sharded optimizer state dict])."""
    if optim.state:
        return
    params = [p for group in optim.param_groups for p in group["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise ValueError(
            "the optimizer has no state yet but its parameters hold gradients; call optimizer.zero_grad() "
            "before building the sharded optimizer state dict to load into"
        )
    saved = []
    for group in optim.param_groups:
        lr = group.get("lr")
        saved.append(lr)
        if lr is not None:
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, saved, strict=False):
            if lr is not None:
                group["lr"] = lr
        for p in params:
            p.grad = None


def sharded_optim_state_dict(
    units: list[Unit], named_params: dict[str, nn.Parameter], optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer state as ``ShardedTensor`` pieces keyed by parameter name (Note [sharded
    optimizer state dict]). Collective over the model's ranks (ShardedTensor construction).

    Args:
        units: the model's FSDP units.
        named_params: the model's parameters by original name.
        optim: an optimizer over (some of) those parameters; a fresh one gets its state first.

    Returns:
        ``{"state": {name: {key: ShardedTensor | value}}, "param_groups": ({..., "params": [names]}, ...)}``;
        the sharded entries view the live optimizer state.

    Raises:
        ValueError: the optimizer holds a foreign parameter, or a fresh optimizer's
            parameters hold gradients.
    """
    ordered = _names_in_order(named_params, optim)
    _init_state(optim)
    where = _locate(units)
    state: dict[str, dict[str, Any]] = {}
    for name in ordered:
        p = named_params[name]
        located = where.get(id(p))
        entry: dict[str, Any] = {}
        for key, value in optim.state.get(p, {}).items():
            if located is not None and _is_piece(value, located[1]):
                if located[0].config.shard_size > 1:
                    entry[key] = piece_tensor(value, located[1], located[0].config.shard_group)
                else:  # the whole parameter, 1-D like the sharded entries (a view dcp.load fills)
                    entry[key] = value.reshape(-1)
            else:
                entry[key] = value
        state[name] = entry
    groups = []
    start = 0
    for group in optim.param_groups:
        count = len(group["params"])
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ordered[start:start + count]})
        start += count
    # A tuple is one value for dcp under every key-flattening version it reads, so the keys
    # do not change when a rank holds no piece of some parameter (Note [sharded optimizer
    # state dict]).
    return {"state": state, "param_groups": tuple(groups)}


def load_sharded_optim_state_dict(
    units: list[Unit], named_params: dict[str, nn.Parameter], optim: torch.optim.Optimizer, osd: dict[str, Any]
) -> None:
    """Load a sharded optimizer state dict in this model's layout (one that ``dcp.load``
    filled, built by :func:`sharded_optim_state_dict` on this model and ``optim``).

    Raises:
        ValueError: not such a dict, its groups or names do not match ``optim``, or a
            sharded entry's piece does not match this rank's.
    """
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise ValueError(
            "osd must be the dict returned by sharded_optim_state_dict (with 'state' and 'param_groups'), "
            "filled by torch.distributed.checkpoint.load"
        )
    ordered = _names_in_order(named_params, optim)
    saved_names = [n for g in osd["param_groups"] for n in g["params"]]
    if saved_names != ordered or len(osd["param_groups"]) != len(optim.param_groups):
        raise ValueError(
            "the sharded optimizer state dict's param groups do not list this optimizer's parameters in its "
            "order; build the load target with this model's sharded_optim_state_dict(optim)"
        )
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(ordered):
        p = named_params[name]
        entry: dict[str, Any] = {}
        for key, value in osd["state"].get(name, {}).items():
            if isinstance(value, ShardedTensor):
                value = local_piece(value, p, f"sharded optimizer entry {name!r}/{key!r}",
                                    "build the load target with this model's sharded_optim_state_dict(optim)")
            if isinstance(value, torch.Tensor) and value.dim() == 1 and p.dim() != 1 and value.numel() == p.numel():
                value = value.reshape(p.shape)  # this rank's rows (Note [flat parameter layout])
            entry[key] = value.clone().to(p.device) if isinstance(value, torch.Tensor) else value
        if entry:
            state[index] = entry
    groups, start = [], 0
    for saved in osd["param_groups"]:
        count = len(saved["params"])
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(start, start + count))})
        start += count
    optim.load_state_dict({"state": state, "param_groups": groups})
