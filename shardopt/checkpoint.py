"""Checkpoints of a model and its (sharded) optimizer: consolidated files and sharded folders.

Consolidated (:func:`save_consolidated` / :func:`load_consolidated`): one file holding the
model's ``state_dict``, a plain ``torch.optim`` optimizer state dict (an :class:`~shardopt.
optim.OSS` is consolidated onto rank 0 first) and a small ``extra`` dict (step counter,
scaler state, ...). It loads at any world size and without shardopt. Rank 0 writes it to a
temporary file next to the target, flushes it to disk and renames it over the target with
``os.replace``, so a crash leaves either the old checkpoint or the new one, never half of one.

Sharded (:func:`save_sharded` / :func:`load_sharded`): a folder written by
``torch.distributed.checkpoint`` (``dcp.save``) in which every rank writes only what it
holds. See Note [sharded optimizer layout] for how optimizer state is keyed.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from shardopt import comm
from shardopt.optim import OSS

__all__ = ["load_consolidated", "load_sharded", "save_consolidated", "save_sharded"]

logger = logging.getLogger(__name__)

CONSOLIDATED_FORMAT = "shardopt.consolidated/1"
SHARDED_FORMAT = "shardopt.sharded/1"
_META_FILE = "shardopt_meta.pt"

# Note [sharded optimizer layout]
# An OSS rank holds the state of the parameters it owns. Its entries are saved under
# "optim.<global parameter index>.<state name>", so the folder holds every entry exactly
# once and a load at another world size works: each rank asks for the indices it owns under
# the new partition. Any other optimizer (a plain torch.optim over a DDP model, or one over a
# rank's shards of a ZeRO-3 model) is saved per rank under "optim.rank<r>.<index>.<name>";
# such a folder loads only at the world size that wrote it, which load_sharded checks.
# Non-tensor state values and param-group hyperparameters go in a small metadata file that
# rank 0 writes next to dcp's files.


def _rank() -> int:
    return comm.group_rank(None) if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return comm.group_size(None) if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        comm.barrier(None)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not every platform lets a directory be opened; the rename is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_torch_save(obj: Any, path: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(directory)


def save_consolidated(
    path: str, module: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any] | None = None
) -> None:
    """Write one checkpoint file holding the full model and optimizer state. Call on every rank.

    Args:
        path: the file to write (its folder is created).
        module: the model *without* its data-parallel wrapper (e.g. ``ddp.module``); its
            ``state_dict`` must be full on rank 0.
        optimizer: an :class:`OSS` (consolidated onto rank 0 here, a collective) or a plain
            ``torch.optim`` optimizer whose state is the same on every rank; or ``None``.
        extra: small picklable values saved alongside (step, scaler state, config).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module (the unwrapped model), got {type(module).__name__}")
    optim_state: dict[str, Any] | None = None
    if isinstance(optimizer, OSS):
        optimizer.consolidate_state_dict(recipient_rank=0)
        if _rank() == 0:
            optim_state = optimizer.state_dict()
    elif optimizer is not None:
        optim_state = optimizer.state_dict()
    if _rank() == 0:
        _atomic_torch_save(
            {"format": CONSOLIDATED_FORMAT, "model": module.state_dict(), "optimizer": optim_state,
             "extra": dict(extra or {})},
            path,
        )
        logger.info("wrote consolidated checkpoint %s", path)
    _barrier()


def load_consolidated(
    path: str, module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a file written by :func:`save_consolidated` into ``module`` and ``optimizer``.

    Every rank reads the file; an :class:`OSS` keeps the state of the parameters it owns
    under the current world size, whatever the world size that saved it.

    Args:
        path: the checkpoint file.
        module: the unwrapped model to load into.
        optimizer: the optimizer to load into, or ``None`` to skip optimizer state.

    Returns:
        The ``extra`` dict that was saved.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a shardopt consolidated checkpoint.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {path!r}; save one first with save_consolidated")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or blob.get("format") != CONSOLIDATED_FORMAT:
        raise ValueError(f"{path!r} is not a shardopt consolidated checkpoint (expected format "
                         f"{CONSOLIDATED_FORMAT!r}); was it written by save_sharded? use load_sharded")
    module.load_state_dict(blob["model"])
    if optimizer is not None and blob["optimizer"] is not None:
        optimizer.load_state_dict(blob["optimizer"])
    return dict(blob["extra"])


def _groups_hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _optim_entries(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's optimizer state split into tensors (for dcp) and other values (for the meta file)."""
    tensors: dict[str, torch.Tensor] = {}
    others: dict[str, Any] = {}
    if isinstance(optimizer, OSS):
        index = {p: i for i, p in enumerate(optimizer.params)}
        prefix = ""
        state: Mapping[Any, Any] = optimizer.optim.state
    else:
        index = {p: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        prefix = f"rank{_rank()}."
        state = optimizer.state
    for param, entry in state.items():
        for name, value in entry.items():
            key = f"{prefix}{index[param]}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            else:
                others[key] = value
    return tensors, others


def save_sharded(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any] | None = None
) -> None:
    """Write a sharded checkpoint folder with ``torch.distributed.checkpoint``. Call on every rank.

    How it works: the model's ``state_dict()`` (full tensors are written once, DTensor
    shards by their owners) and this rank's optimizer entries (Note [sharded optimizer
    layout]) go to ``dcp.save`` in ``<path>.tmp``; non-tensor values from every rank, the
    param-group hyperparameters and ``extra`` go to a metadata file; then rank 0 moves the
    finished folder to ``path``. A crash mid-save leaves the previous ``path`` untouched.

    Args:
        path: the folder to write (replaced when it exists; must be on a file system all
            ranks see).
        model: the model whose ``state_dict()`` to save (wrapped or not, as long as loading
            uses the same object kind).
        optimizer: the optimizer, or ``None``.
        extra: small picklable values saved alongside.
    """
    path = os.path.abspath(path)
    staging = path + ".tmp"
    if _rank() == 0 and os.path.exists(staging):
        shutil.rmtree(staging)
    _barrier()
    tensors, others = _optim_entries(optimizer) if optimizer is not None else ({}, {})
    dcp.save({"model": model.state_dict(), "optim": tensors}, checkpoint_id=staging)
    gathered = comm.all_gather_object(others, None) if _world() > 1 else [others]
    if _rank() == 0:
        meta = {
            "format": SHARDED_FORMAT, "world_size": _world(),
            "optim_kind": "oss" if isinstance(optimizer, OSS) else ("per_rank" if optimizer is not None else None),
            "param_groups": _groups_hyper(optimizer) if optimizer is not None else None,
            "optim_values": {k: v for part in gathered for k, v in part.items()},
            "extra": dict(extra or {}),
        }
        _atomic_torch_save(meta, os.path.join(staging, _META_FILE))
        if os.path.exists(path):
            old = path + ".old"
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(path, old)
            os.replace(staging, path)
            shutil.rmtree(old)
        else:
            os.replace(staging, path)
        _fsync_dir(os.path.dirname(path))
        logger.info("wrote sharded checkpoint %s", path)
    _barrier()


def load_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a folder written by :func:`save_sharded`. Call on every rank.

    Args:
        path: the checkpoint folder.
        model: the model to load into (same kind as at save time).
        optimizer: the optimizer to load into, or ``None`` to skip optimizer state.

    Returns:
        The ``extra`` dict that was saved.

    Raises:
        FileNotFoundError: ``path`` is not a sharded checkpoint folder.
        ValueError: per-rank optimizer state saved at another world size, or a different
            optimizer kind than the one given.
    """
    path = os.path.abspath(path)
    meta_path = os.path.join(path, _META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"no sharded checkpoint at {path!r} (missing {_META_FILE}); save one first "
                                "with save_sharded")
    meta = torch.load(meta_path, map_location="cpu", weights_only=True)
    model_state = model.state_dict()
    state: dict[str, Any] = {"model": model_state}
    kind = meta["optim_kind"]
    if optimizer is not None and kind is not None:
        ours = "oss" if isinstance(optimizer, OSS) else "per_rank"
        if ours != kind:
            raise ValueError(f"the checkpoint at {path!r} holds {kind!r} optimizer state but the optimizer given "
                             f"is {type(optimizer).__name__} ({ours!r}); load with the same kind of optimizer")
        if kind == "per_rank" and meta["world_size"] != _world():
            raise ValueError(f"the checkpoint at {path!r} was saved by {meta['world_size']} ranks with per-rank "
                             f"optimizer state and cannot be loaded by {_world()}; resume at world size "
                             f"{meta['world_size']} or save with OSS, whose state reshards")
        state["optim"] = _optim_template(path, optimizer)
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(model_state)
    if optimizer is not None and kind is not None:
        _restore_optimizer(optimizer, state["optim"], meta)
    return dict(meta["extra"])


def _owned_indices(optimizer: torch.optim.Optimizer) -> tuple[str, list[torch.Tensor], list[int]]:
    if isinstance(optimizer, OSS):
        params = list(optimizer.params)
        owned = [i for i in range(len(params)) if optimizer.owns(i) and optimizer.partition.sizes[i] > 0]
        return "", params, owned
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return f"rank{_rank()}.", params, list(range(len(params)))


def _optim_template(path: str, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Empty tensors for the optimizer entries this rank must read, shaped from dcp's metadata."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    prefix, params, owned = _owned_indices(optimizer)
    wanted = {f"optim.{prefix}{i}." for i in owned}
    template: dict[str, torch.Tensor] = {}
    for key, item in metadata.items():
        if not key.startswith("optim.") or not isinstance(item, TensorStorageMetadata):
            continue
        head = key[: key.index(".", len(f"optim.{prefix}")) + 1]
        if head in wanted:
            index = int(head[len(f"optim.{prefix}"):-1])
            template[key[len("optim."):]] = torch.empty(
                item.size, dtype=item.properties.dtype).to(params[index].device)
    return template


def _restore_optimizer(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    prefix, params, owned = _owned_indices(optimizer)
    entries: dict[int, dict[str, Any]] = {i: {} for i in owned}
    values = {**meta["optim_values"], **tensors}
    for key, value in values.items():
        if not key.startswith(prefix):
            continue
        index_text, name = key[len(prefix):].split(".", 1)
        if int(index_text) in entries:
            entries[int(index_text)][name] = value
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        group.update(saved)
    target = optimizer.optim if isinstance(optimizer, OSS) else optimizer
    target.state.clear()
    for index, entry in entries.items():
        if entry:
            target.state[params[index]] = entry
    if isinstance(optimizer, OSS):
        optimizer.state = optimizer.optim.state  # type: ignore[assignment]
        for group, shard_group in zip(optimizer.param_groups, optimizer.optim.param_groups):
            shard_group.update({k: v for k, v in group.items() if k != "params"})
