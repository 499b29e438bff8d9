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
import pickle
import shutil
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardopt import comm
from shardopt.optim import OSS

__all__ = ["load_consolidated", "load_sharded", "read_extra", "save_consolidated", "save_sharded"]

logger = logging.getLogger(__name__)

CONSOLIDATED_FORMAT = "shardopt.consolidated/1"
SHARDED_FORMAT = "shardopt.sharded/1"
_META_FILE = "shardopt_meta.pt"

# Note [sharded optimizer layout]
# An OSS rank holds the state of the parameters it owns. Its entries are saved under
# "optim.<global parameter index>.<state name>", so the folder holds every entry exactly
# once and a load at another world size works: each rank asks dcp for the indices it owns
# under the new partition, shaped from the folder's metadata. Non-tensor state values and
# the param-group hyperparameters go in a small metadata file that rank 0 writes next to
# dcp's files. Any other optimizer (a plain torch.optim over a DDP model, or one over the
# DTensor shards of an FSDP2 model) goes through torch's own
# torch.distributed.checkpoint.state_dict.get_state_dict / set_state_dict, which key state
# by parameter name and let dcp deduplicate replicated tensors and reshard DTensors.

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
        module: the model *without* its data-parallel wrapper (e.g. ``ddp.module``), or a
            ZeRO-3 ``FullyShardedDataParallel`` (whose ``state_dict`` is full); its
            ``state_dict`` must be full on rank 0.
        optimizer: an :class:`OSS` (consolidated onto rank 0 here, a collective), an
            optimizer over a ZeRO-3 wrapper's shards (gathered through the wrapper), a plain
            ``torch.optim`` optimizer whose state is the same on every rank; or ``None``.
        extra: small picklable values saved alongside (step, scaler state, config).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module (the unwrapped model), got {type(module).__name__}")
    model_state = module.state_dict()  # on every rank: a collective for a ZeRO-3 wrapper
    gather_optim = _full_optim_state_fn(module)
    optim_state: dict[str, Any] | None = None
    if isinstance(optimizer, OSS):
        optimizer.consolidate_state_dict(recipient_rank=0)
        if _rank() == 0:
            optim_state = optimizer.state_dict()
    elif optimizer is not None and gather_optim is not None:
        optim_state = gather_optim(module, optimizer)
    elif optimizer is not None:
        optim_state = optimizer.state_dict()
    if _rank() == 0:
        _atomic_torch_save(
            {"format": CONSOLIDATED_FORMAT, "model": model_state, "optimizer": optim_state,
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
        shard = getattr(type(module), "shard_full_optim_state_dict", None)
        optimizer.load_state_dict(shard(blob["optimizer"], module, optimizer) if shard is not None
                                  else blob["optimizer"])
    return dict(blob["extra"])


def read_extra(path: str) -> dict[str, Any] | None:
    """The ``extra`` dict of a checkpoint (file or folder) without loading any state, or ``None``.

    Lets a caller check that a checkpoint belongs to its model before loading it.

    Args:
        path: a consolidated checkpoint file or a sharded checkpoint folder.

    Returns:
        The saved ``extra``, or ``None`` when ``path`` holds no shardopt checkpoint.
    """
    if os.path.isdir(path):
        meta_path = os.path.join(path, _META_FILE)
        if not os.path.isfile(meta_path):
            return None
        return dict(torch.load(meta_path, map_location="cpu", weights_only=True)["extra"])
    if not os.path.isfile(path):
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError):
        return None  # not a torch.save file at all
    if not isinstance(blob, dict) or blob.get("format") != CONSOLIDATED_FORMAT:
        return None
    return dict(blob["extra"])


def _full_optim_state_fn(module: nn.Module) -> Any:
    """The wrapper's ``full_optim_state_dict(model, optim)`` when it shards parameters (ZeRO-3), else ``None``.

    (A ZeRO-3 wrapper's optimizer holds pieces of flat shards, so only the wrapper knows how
    to gather them into full-shaped state keyed by parameter name.)
    """
    return getattr(type(module), "full_optim_state_dict", None)


def _groups_hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _oss_entries(optimizer: OSS) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's OSS state split into tensors (for dcp) and other values (for the meta file)."""
    tensors: dict[str, torch.Tensor] = {}
    others: dict[str, Any] = {}
    index = {p: i for i, p in enumerate(optimizer.params)}
    for param, entry in optimizer.optim.state.items():
        for name, value in entry.items():
            key = f"{index[param]}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            else:
                others[key] = value
    return tensors, others


def save_sharded(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any] | None = None
) -> None:
    """Write a sharded checkpoint folder with ``torch.distributed.checkpoint``. Call on every rank.

    How it works: the model's state and the optimizer's (Note [sharded optimizer layout])
    go to ``dcp.save`` in ``<path>.tmp``, where every rank writes only what it holds and
    replicated tensors are written once; non-tensor values, hyperparameters and ``extra``
    go to a metadata file; then rank 0 moves the finished folder to ``path``. A crash
    mid-save leaves the previous ``path`` untouched.

    Args:
        path: the folder to write (replaced when it exists; must be on a file system all
            ranks see).
        model: the model (wrapped or not; load with the same kind of object).
        optimizer: an :class:`OSS`, any other ``torch.optim`` optimizer, or ``None``.
        extra: small picklable values saved alongside.
    """
    if _full_optim_state_fn(model) is not None:
        raise TypeError(f"save_sharded does not support {type(model).__name__} (flat-shard ZeRO-3) yet: its "
                        "shards are not DTensors, so dcp cannot place them; use save_consolidated(path, model, "
                        "optimizer), which gathers full state through the wrapper")
    path = os.path.abspath(path)
    staging = path + ".tmp"
    if _rank() == 0 and os.path.exists(staging):
        shutil.rmtree(staging)
    _barrier()
    others: dict[str, Any] = {}
    if isinstance(optimizer, OSS):
        tensors, others = _oss_entries(optimizer)
        state: dict[str, Any] = {"model": model.state_dict(), "optim": tensors}
    elif optimizer is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
    else:
        state = {"model": get_model_state_dict(model)}
    dcp.save(state, checkpoint_id=staging)
    gathered = comm.all_gather_object(others, None) if _world() > 1 else [others]
    if _rank() == 0:
        meta = {
            "format": SHARDED_FORMAT, "world_size": _world(),
            "optim_kind": "oss" if isinstance(optimizer, OSS) else ("torch" if optimizer is not None else None),
            "param_groups": _groups_hyper(optimizer) if isinstance(optimizer, OSS) else None,
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
    """Load a folder written by :func:`save_sharded`, at any world size. Call on every rank.

    Args:
        path: the checkpoint folder.
        model: the model to load into (same kind of object as at save time).
        optimizer: the optimizer to load into, or ``None`` to skip optimizer state.

    Returns:
        The ``extra`` dict that was saved.

    Raises:
        FileNotFoundError: ``path`` is not a sharded checkpoint folder.
        ValueError: the folder holds another kind of optimizer state than ``optimizer``.
    """
    path = os.path.abspath(path)
    meta_path = os.path.join(path, _META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"no sharded checkpoint at {path!r} (missing {_META_FILE}); save one first "
                                "with save_sharded")
    meta = torch.load(meta_path, map_location="cpu", weights_only=True)
    kind = meta["optim_kind"]
    if optimizer is not None and kind is not None:
        ours = "oss" if isinstance(optimizer, OSS) else "torch"
        if ours != kind:
            raise ValueError(f"the checkpoint at {path!r} holds {kind!r} optimizer state but the optimizer given "
                             f"is a {type(optimizer).__name__} ({ours!r}); load with the kind of optimizer that "
                             "saved it, or pass optimizer=None to load the model only")
    if isinstance(optimizer, OSS) and kind == "oss":
        model_state = model.state_dict()
        state: dict[str, Any] = {"model": model_state, "optim": _oss_template(path, optimizer)}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(model_state)
        _restore_oss(optimizer, state["optim"], meta)
    elif optimizer is not None and kind == "torch":
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        model_state = get_model_state_dict(model)
        dcp.load({"model": model_state}, checkpoint_id=path)
        set_model_state_dict(model, model_state)
    return dict(meta["extra"])


def _oss_template(path: str, optimizer: OSS) -> dict[str, torch.Tensor]:
    """Empty tensors for the entries this rank owns under the current partition, shaped from dcp's metadata."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    params = optimizer.params
    owned = {i for i in range(len(params)) if optimizer.owns(i) and optimizer.partition.sizes[i] > 0}
    template: dict[str, torch.Tensor] = {}
    for key, item in metadata.items():
        if not key.startswith("optim.") or not isinstance(item, TensorStorageMetadata):
            continue
        index_text, _ = key[len("optim."):].split(".", 1)
        if int(index_text) in owned:
            template[key[len("optim."):]] = torch.empty(item.size, dtype=item.properties.dtype).to(
                params[int(index_text)].device)
    return template


def _restore_oss(optimizer: OSS, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Rebuild the owned shard's state as a plain state dict and load it through OSS's public API."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in {**meta["optim_values"], **tensors}.items():
        index_text, name = key.split(".", 1)
        index = int(index_text)
        if optimizer.owns(index) and optimizer.partition.sizes[index] > 0:
            state.setdefault(index, {})[name] = value
    groups, start = [], 0
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
