"""Checks of saved state: checksums, and whether it fits a model and an optimizer.

Pure functions over state dicts and shapes, used by :mod:`shardopt.checkpoint` and
``OSS.load_state_dict`` before they change anything; internal, not a public API.

Note [checkpoint integrity]
Every record carries a CRC-32, computed when it is saved and verified when it is loaded: a
tensor's bytes, or the ``repr`` of a plain value (number, string, bool, None). A
consolidated file checks every model, optimizer and ``extra`` record (hyperparameters and
step counters included). A sharded folder checks its metadata file as a whole (which holds
the hyperparameters, non-tensor state and ``extra``) and, for OSS, every tensor it writes:
each optimizer entry is written whole by its owner and the replicated model tensors once,
so what a load reads is byte-identical to what was saved at any world size; each rank
checks what it read and the ranks agree before any of them changes anything.
``ShardedTensor`` and ``DTensor`` pieces (ZeRO-3, FSDP2) and DDP's plain state are resliced
at another world size, so they rely on dcp alone. CRC-32 (zlib) finds flipped bits and torn
writes at memory speed; it is not a defence against deliberate tampering.
A load first reads and checks everything (names, shapes, checksums, optimizer groups and
state shapes) and only then changes the model and the optimizer, so a failed load leaves
both as they were (a ZeRO-3 load reads into the live shards after dcp has checked every
size). Files written in formats ``/1`` (no checksums) and ``/2`` (tensor checksums only,
no group sizes) still load, with the checks their records allow.

Note [replicated optimizer state]
Under hybrid sharding the optimizer is an OSS over a shard group of S ranks and every one of
the R shard groups holds the same state, so R ranks hold each sharded-checkpoint entry. dcp
would write it once anyway (its default planner deduplicates a key held by several ranks,
keeping it on the rank whose plan is smallest so far, ``dedup_save_plans`` in torch 2.13),
but which copy it keeps depends on plan sizes, and the checksum recorded for the key would be
whichever rank's came last: replicas that had drifted apart would give a checkpoint that
mixes them, or one that fails its own checksum at load. So :func:`shardopt.checkpoint.save_sharded`
first gathers every rank's entry checksums (a few bytes per entry), :func:`assign_writers`
refuses, on every rank and before anything is written, replicas that differ, and names the
lowest rank holding each entry as its only writer: the shard group of rank 0 writes the
optimizer state, and dcp's balancing then leaves the model's replicated tensors mostly to
the other ranks. A consolidated save consolidates only in the shard group of rank 0 (the
other groups would gather the same state for nothing). A load needs no such care: every rank
reads the entries it owns under its own plan, at any shard size.

Note [foreign checkpoints]
A checkpoint of another model (another run's file, the wrong folder) shares few or none of
the model's names. Listing them as "missing" and "unexpected" and counting the shared ones
("only 0 of its 6 names ...") left the reader to work out what the file was. So when fewer
than half of the larger side's names are shared, :func:`check_model_state` says that the
checkpoint appears to be of another model, shows the first names on each side and the fix;
when every name differs only by a prefix ending in "." (a model saved inside DDP,
"module.", or torch.compile, "_orig_mod.", or loaded into one) it names the prefix and
where to load instead. A partial mismatch (a layer added or renamed) keeps the list of
missing and unexpected names.
"""

from __future__ import annotations

import pickle
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "MASTER_KEY",
    "STEPS_KEY",
    "assign_writers",
    "check_indexed_state",
    "check_model_state",
    "check_optimizer_entries",
    "check_optimizer_state",
    "check_state_dict_groups",
    "check_state_fits",
    "checksums",
    "entry_fits",
    "meta_crc",
    "shapes",
    "state_fits",
    "verify",
]

PLAIN_VALUES = (bool, int, float, complex, str, bytes, type(None))
"""Values whose ``repr`` is checksummed (exact for floats, the same in every process)."""

MASTER_KEY = "master"
"""The state entry under which OSS saves a parameter's master weight (Note [master weights]
in :mod:`shardopt.optim.masters`): a floating tensor of exactly the parameter's shape."""

STEPS_KEY = "oss_steps"
"""The entry of an OSS state dict beside ``state`` and ``param_groups`` (in a sharded folder: in its
``optim_entries``) that holds the ``step()`` calls the optimizer had taken, which ``delay_update_after``
counts (Note [saved step count] in :mod:`shardopt.optim.delayed_update`). Absent (older dicts, plain
torch optimizers' dicts): 0."""


def check_optimizer_entries(where: str, entries: Any) -> None:
    """Refuse a saved :data:`STEPS_KEY` in ``entries`` (a state dict, or a sharded folder's
    ``optim_entries``) that is no step count; an absent one (or ``entries=None``) is fine.

    Raises:
        ValueError: the value is not an int >= 0 (a bool is refused).
    """
    value = entries.get(STEPS_KEY, 0) if isinstance(entries, Mapping) else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}: the optimizer entry {STEPS_KEY!r} must be the step() calls taken, an int >= 0, "
                         f"got {value!r}; it was edited or not saved by OSS: load a state dict saved by OSS, or "
                         f"delete the {STEPS_KEY!r} entry to count the steps from 0. Nothing was loaded")


def _crc(tensor: torch.Tensor) -> int:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data.tobytes()) & 0xFFFFFFFF


def checksums(obj: Any, prefix: str = "", values: bool = False) -> dict[str, int]:
    """CRC-32 of every plain tensor inside ``obj`` (dicts, lists, tuples), keyed by path; with
    ``values``, of every plain value's ``repr`` too (exact for floats, the same in every process)."""
    out: dict[str, int] = {}
    if isinstance(obj, torch.Tensor):
        if type(obj) is torch.Tensor or isinstance(obj, nn.Parameter):
            out[prefix] = _crc(obj)
    elif values and isinstance(obj, PLAIN_VALUES):
        out[prefix] = zlib.crc32(repr(obj).encode()) & 0xFFFFFFFF
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            out.update(checksums(value, f"{prefix}/{key}", values))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(checksums(value, f"{prefix}/{i}", values))
    return out


def assign_writers(where: str, claims: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Which rank writes each record that several ranks hold (Note [replicated optimizer state]).

    Pure: every rank calls it with the same gathered ``claims`` and gets the same answer or
    the same error.

    Args:
        where: what is being saved, for the message.
        claims: for each rank, the checksum of every record it holds, by key.

    Returns:
        For every key, the lowest rank that holds it.

    Raises:
        ValueError: two ranks hold one key with different checksums (replicas that should
            be equal have diverged); nothing should be written then.
    """
    writers: dict[str, int] = {}
    for rank, sums in enumerate(claims):
        for key, crc in sums.items():
            first = writers.setdefault(key, rank)
            if claims[first][key] != crc:
                raise ValueError(
                    f"{where}: ranks {first} and {rank} both hold optimizer state {key!r} but it differs between "
                    "them, so the replicas of this shard have diverged (a step, a load or a manual change that ran "
                    "on one replica only); nothing was written: make every replica run the same steps (e.g. DDP or "
                    "ShardedDataParallel over the whole world), or reload the last checkpoint on every rank")
    return writers


def verify(where: str, saved: Mapping[str, int], loaded: Mapping[str, int]) -> None:
    """Compare the records read (``loaded``) with the checksums saved for them."""
    bad = [k for k, crc in saved.items() if k in loaded and loaded[k] != crc]
    if bad:
        raise ValueError(f"checkpoint {where} is corrupted: {len(bad)} record(s) fail their checksum, first "
                         f"{bad[0].lstrip('/')!r}; restore it from a backup or an earlier checkpoint. "
                         "Nothing was loaded")


def meta_crc(meta: Mapping[str, Any]) -> int:
    return zlib.crc32(pickle.dumps({k: v for k, v in meta.items() if k != "meta_crc"}, protocol=4)) & 0xFFFFFFFF


def shapes(state: Mapping[str, Any]) -> dict[str, torch.Size | None]:
    """The shape of every tensor of a flat state dict (``None`` for other values)."""
    return {k: v.shape if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def dtypes(state: Mapping[str, Any]) -> dict[str, torch.dtype | None]:
    """The dtype of every tensor of a flat state dict (``None`` for other values)."""
    return {k: v.dtype if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def check_model_state(where: str, expected: Mapping[str, torch.Size | None],
                      saved: Mapping[str, torch.Size | None],
                      expected_dtypes: Mapping[str, torch.dtype | None] | None = None,
                      saved_dtypes: Mapping[str, torch.dtype | None] | None = None,
                      strict: bool = True) -> None:
    """Names, shapes and dtypes saved against the model's own (``expected``), before any write.

    A saved dtype must cast to the model's without changing kind (``torch.can_cast``: a
    float into a float of any width, an int into a float; not a float into an int, nor a
    complex into a real). With ``strict=False`` missing and unexpected names are allowed
    (as ``nn.Module.load_state_dict(strict=False)``); shapes and dtypes are checked anyway.

    A checkpoint that shares few or none of the model's names gets its own message
    (Note [foreign checkpoints]).

    Raises:
        ValueError: names (with ``strict``), shapes or dtypes that do not fit.
    """
    common = [k for k in expected if k in saved]
    missing = [k for k in expected if k not in saved] if strict else []
    unexpected = [k for k in saved if k not in expected] if strict else []
    wrong = [(k, tuple(a), tuple(b)) for k, b in expected.items()
             if (a := saved.get(k)) is not None and b is not None and a != b]
    uncastable = [(k, src, dst) for k in common
                  if expected_dtypes is not None and saved_dtypes is not None
                  and (src := saved_dtypes.get(k)) is not None and (dst := expected_dtypes.get(k)) is not None
                  and not torch.can_cast(src, dst)]
    if missing and unexpected and 2 * len(common) < max(len(expected), len(saved)):
        raise ValueError(_another_model(where, list(expected), list(saved), len(common)))
    if missing or unexpected or wrong or uncastable:
        parts = ([f"missing {missing[:5]}"] if missing else []) + ([f"unexpected {unexpected[:5]}"] if unexpected else [])
        parts += [f"{k!r} has shape {a} in the checkpoint but {b} in the model" for k, a, b in wrong[:3]]
        parts += [f"{k!r} is {a} in the checkpoint but {b} in the model, which it cannot be cast to"
                  for k, a, b in uncastable[:3]]
        raise ValueError(f"checkpoint {where} does not fit this model ({'; '.join(parts)}); load it into the "
                         "model it was saved from (same architecture and configuration). Nothing was loaded")


def _added_prefix(short: list[str], long: list[str]) -> str | None:
    """The prefix ``p`` (ending in ".") with ``long`` exactly ``p + name`` for each of ``short``, if any."""
    if not short or len(short) != len(long):
        return None
    for name in short:
        if long[0].endswith("." + name):
            prefix = long[0][:-len(name)]
            if {prefix + k for k in short} == set(long):
                return prefix
    return None


def _first(names: list[str]) -> str:
    more = len(names) - 3
    return ", ".join(repr(k) for k in names[:3]) + (f" and {more} more" if more > 0 else "")


def _another_model(where: str, ours: list[str], theirs: list[str], common: int) -> str:
    """Few or none of the saved names are the model's (Note [foreign checkpoints])."""
    wrapped = _added_prefix(ours, theirs)
    if wrapped is not None:
        return (f"checkpoint {where} does not fit this model: its names are this model's with {wrapped!r} in front "
                f"(e.g. {theirs[0]!r} for {ours[0]!r}), so it was saved from this model inside a wrapper (DDP adds "
                "'module.', torch.compile '_orig_mod.'); load it into the same wrapper, or save the unwrapped model "
                "(e.g. ddp.module). Nothing was loaded")
    wrapper = _added_prefix(theirs, ours)
    if wrapper is not None:
        return (f"checkpoint {where} does not fit this model: this model's names are the checkpoint's with "
                f"{wrapper!r} in front (e.g. {ours[0]!r} for {theirs[0]!r}), so this model is inside a wrapper; load "
                "it into the module inside (e.g. ddp.module, or compiled._orig_mod). Nothing was loaded")
    seen = set(ours)
    only_theirs = [k for k in theirs if k not in seen]
    only_ours = [k for k in ours if k not in set(theirs)]
    matched = f"none of its {len(theirs)} names is" if common == 0 else f"only {common} of its {len(theirs)} names are"
    return (f"checkpoint {where} appears to be of another model: {matched} among this model's {len(ours)} (the "
            f"checkpoint's first names: {_first(only_theirs)}; this model's: {_first(only_ours)}). Load it into the "
            "model it was saved from (same architecture and configuration), or give this model a checkpoint saved "
            "from it. Nothing was loaded")


def check_optimizer_state(where: str, optimizer: torch.optim.Optimizer, osd: Any,
                           shapes: list[torch.Size] | Mapping[str, torch.Size]) -> None:
    """Groups, parameter counts and per-parameter state shapes, before anything is loaded.

    ``shapes`` are the parameters' full shapes, by index (state keyed by index) or by name.
    State shapes follow :func:`state_fits` (element-wise or factored).
    """
    groups = osd.get("param_groups") if isinstance(osd, Mapping) else None
    if not isinstance(groups, (list, tuple)) or not isinstance(osd.get("state"), Mapping):
        raise ValueError(f"checkpoint {where} holds no optimizer state dict ('state' and 'param_groups'); "
                         "pass optimizer=None to load the model only")
    check_optimizer_entries(f"checkpoint {where}", osd)
    ours = [len(g["params"]) for g in optimizer.param_groups]
    theirs = [len(g["params"]) for g in groups]
    if ours != theirs:
        raise ValueError(f"checkpoint {where} has optimizer groups of sizes {theirs} but the optimizer has {ours}; "
                         "build the optimizer with the same param groups as the one that was saved. Nothing was loaded")
    ids = [pid for g in groups for pid in g["params"]]
    position = {pid: i for i, pid in enumerate(ids)}
    for key, entry in osd["state"].items():
        if key not in position:
            raise ValueError(f"checkpoint {where}: optimizer state entry {key!r} is in no param group; "
                             "the file is inconsistent. Nothing was loaded")
        shape = shapes[key] if isinstance(shapes, Mapping) else shapes[position[key]]
        for name, value in entry.items():
            if not entry_fits(name, value, shape):
                raise ValueError(
                    f"checkpoint {where}: optimizer state {name!r} of parameter {key!r} has shape "
                    f"{_shape_of(value)} in the checkpoint but the parameter has {tuple(shape)}; "
                    f"{_rule(name)}: the optimizer state belongs to another model or parameter order: build "
                    "the optimizer over the same parameters in the same order. Nothing was loaded")


def state_fits(value: Any, param_shape: torch.Size) -> bool:
    """Whether one optimizer state value can belong to a parameter of ``param_shape``.

    Scalars and non-tensors always fit. A tensor must have the parameter's number of
    dimensions with every size equal to the parameter's or 1: element-wise state (momentum,
    Adam's moments) has the parameter's shape, and factored state (``Adafactor``'s row and
    column variances) keeps the parameter's dimensions with some of them 1.
    """
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return True
    return value.dim() == len(param_shape) and all(a in (b, 1) for a, b in zip(value.shape, param_shape, strict=True))


def entry_fits(name: str, value: Any, param_shape: torch.Size) -> bool:
    """:func:`state_fits`, except that a master weight (:data:`MASTER_KEY`) must be a floating
    tensor of exactly the parameter's shape."""
    if name == MASTER_KEY:
        return isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param_shape
    return state_fits(value, param_shape)


def _shape_of(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _rule(name: str) -> str:
    if name == MASTER_KEY:
        return "a master weight must be a floating tensor of exactly its parameter's shape"
    return "optimizer state must have the parameter's shape (or 1 in some dimensions)"


def check_state_dict_groups(state_dict: Any, sizes: Sequence[int]) -> tuple[list[dict[str, Any]], dict[Any, int]]:
    """Check that ``state_dict`` is a torch.optim state dict whose param groups have ``sizes``
    parameters each (an OSS's), and whose state entries all belong to a group.

    Returns:
        The saved param groups, and each saved parameter id's index in the optimizer's order.

    Raises:
        ValueError: not a torch.optim state dict, other group sizes, or an entry no group lists.
    """
    groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if (not isinstance(groups, list) or not isinstance(state_dict.get("state"), dict)
            or not all(isinstance(g, dict) and "params" in g for g in groups)):
        raise ValueError("state_dict must be a torch.optim state dict with 'state' and 'param_groups' "
                         "(each group with 'params'); pass optimizer.state_dict() output")
    check_optimizer_entries("state_dict", state_dict)
    ours, theirs = list(sizes), [len(g["params"]) for g in groups]
    if ours != theirs:
        raise ValueError(
            f"state_dict has parameter groups of sizes {theirs} ({sum(theirs)} parameters) but this OSS "
            f"has {ours} ({sum(ours)} parameters); load a state dict saved from the same model and param groups"
        )
    to_index = {pid: i for i, pid in enumerate(pid for g in groups for pid in g["params"])}
    unknown = [k for k in state_dict["state"] if k not in to_index]
    if unknown:
        raise ValueError(f"state_dict['state'] has entries {unknown[:5]} that no param group lists; "
                         "load a state dict saved from the same model and param groups")
    return groups, to_index


def check_state_fits(state: Mapping[Any, Any], to_index: Mapping[Any, int], params: tuple[torch.Tensor, ...]) -> None:
    """Refuse a ``torch.optim`` state (``state_dict["state"]``) whose entries do not fit their
    parameters (by :func:`state_fits`); ``to_index`` maps its keys to indices in ``params``."""
    for key, entry in state.items():
        if not isinstance(entry, Mapping):
            raise TypeError(f"state_dict['state'][{key!r}] is a {type(entry).__name__}, not a dict of state "
                             "values; pass optimizer.state_dict() output")
        shape = params[to_index[key]].shape
        for name, value in entry.items():
            if not entry_fits(name, value, shape):
                raise ValueError(
                    f"state_dict['state'][{key!r}][{name!r}] has shape {_shape_of(value)} but parameter "
                    f"{to_index[key]} has shape {tuple(shape)}; {_rule(name)}: load a state dict saved from the "
                    "same model and param groups (in the same order). Nothing was loaded"
                )


def _check_block_entry(where: str, head: str, name: str, value: torch.Tensor, shapes: list[torch.Size]) -> None:
    """A saved block ``"<index>@<start>-<stop>"``: its state must fit rows ``[start, stop)`` of the parameter."""
    index_text, rows = head.split("@")
    index, (start, stop) = int(index_text), map(int, rows.split("-"))
    if not index < len(shapes) or not 0 <= start < stop <= shapes[index][0]:
        raise ValueError(f"checkpoint {where}: optimizer state {name!r} is saved for rows [{start}, {stop}) of "
                         f"parameter {index}, which the optimizer does not have; the optimizer state belongs to "
                         "another model or parameter order. Nothing was loaded")
    block = torch.Size([stop - start, *shapes[index][1:]])
    if not entry_fits(name, value, block):
        raise ValueError(
            f"checkpoint {where}: optimizer state {name!r} of rows [{start}, {stop}) of parameter {index} has shape "
            f"{_shape_of(value)} in the checkpoint but those rows have {tuple(block)}; {_rule(name)}: the optimizer "
            "state belongs to another model or parameter order: build the optimizer over the same parameters in the "
            "same order. Nothing was loaded")


def check_indexed_state(where: str, optimizer: torch.optim.Optimizer, shapes: list[torch.Size],
                        meta: Mapping[str, Any], saved: Mapping[str, tuple[torch.Size, torch.dtype]]) -> None:
    """Optimizer groups and every saved state entry's shape against the parameters, for state
    saved by parameter index as ``"<index>.<name>"`` (OSS in a sharded folder).

    Args:
        where: the checkpoint, for messages.
        optimizer: the optimizer to load into (its groups' sizes are compared).
        shapes: the full shape of each of its parameters, by index.
        meta: the folder's metadata (``group_sizes``, ``optim_entries`` if saved; only ``param_groups`` in
            formats /1, /2).
        saved: every saved entry's shape and dtype (from dcp's metadata, so every rank
            reaches the same answer).

    Raises:
        ValueError: as :func:`check_optimizer_state`.
    """
    sizes = meta.get("group_sizes")
    if sizes is None:  # format /1 or /2: only the number of groups was saved
        if len(meta["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(f"checkpoint {where} has {len(meta['param_groups'])} optimizer param groups but the "
                             f"optimizer has {len(optimizer.param_groups)}; build it with the same groups. "
                             "Nothing was loaded")
        sizes = [len(g["params"]) for g in optimizer.param_groups]
    groups, start = [], 0
    for size in sizes:
        groups.append({"params": list(range(start, start + size))})
        start += size
    state: dict[int, dict[str, torch.Tensor]] = {}
    blocks: list[tuple[str, str, torch.Tensor]] = []
    for key, (shape, dtype) in sorted(saved.items(), key=lambda item: int(item[0].split(".", 1)[0].split("@")[0])):
        head, name = key.split(".", 1)
        if "@" in head:  # a block of a split parameter (Note [fragment keys] in shardopt.optim.sharded_entries)
            blocks.append((head, name, torch.empty(shape, dtype=dtype, device="meta")))
            continue
        state.setdefault(int(head), {})[name] = torch.empty(shape, dtype=dtype, device="meta")
    entries = meta.get("optim_entries") or {}  # absent in folders saved before it existed
    check_optimizer_state(where, optimizer, {"state": state, "param_groups": groups, **entries}, shapes)
    for head, name, value in blocks:
        _check_block_entry(where, head, name, value, shapes)
