"""Checkpoints of a model and its (sharded) optimizer: consolidated files and sharded folders.

Consolidated (:func:`save_consolidated` / :func:`load_consolidated`): one file holding the
model's full ``state_dict``, a plain ``torch.optim`` optimizer state dict (consolidated onto
rank 0 first when the optimizer or the model is sharded) and a small ``extra`` dict (step
counter, scaler state, ...). It loads at any world size and without shardopt. Rank 0 writes
it atomically (Note [atomic writes] in :mod:`shardopt.files`); what a killed save leaves is
removed by the next save or load in its folder (Note [leftovers of killed saves] there).

Sharded (:func:`save_sharded` / :func:`load_sharded`): a folder written by
``torch.distributed.checkpoint`` (``dcp.save``) in which every rank writes only what it
holds. See Note [sharded optimizer layout].

This module knows no optimizer or wrapper class: each provides its own encoding through the
small protocols :class:`ShardedOptimizer` (OSS: its state keyed by parameter index) and
:class:`ShardedModel` (FSDP: model and optimizer state as ``ShardedTensor`` pieces and full,
name-keyed optimizer state). Anything else goes through torch's own
``torch.distributed.checkpoint.state_dict`` helpers.

Note [checkpoint integrity] in :mod:`shardopt.state_checks` says what the checksums cover
and in what order a load checks and then changes things.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from shardopt import comm, failures
from shardopt.failures import CollectiveError
from shardopt.files import (SHARDED_MARKER, atomic_write, check_writable, is_temp_name, old_path, remove_path,
                            staging_path, swap_in, tidy)
from shardopt.state_checks import (MASTER_KEY, assign_writers, check_indexed_state, check_model_state,
                                   check_optimizer_state, checksums, dtypes, meta_crc, shapes, verify)

__all__ = [
    "ShardedModel",
    "ShardedOptimizer",
    "check_writable",
    "load_consolidated",
    "load_sharded",
    "read_extra",
    "save_consolidated",
    "save_sharded",
]

logger = logging.getLogger(__name__)

CONSOLIDATED_FORMAT = "shardopt.consolidated/3"
SHARDED_FORMAT = "shardopt.sharded/3"
_OLD_FORMATS = {"shardopt.consolidated/1", "shardopt.sharded/1", "shardopt.consolidated/2", "shardopt.sharded/2"}
_META_FILE = SHARDED_MARKER

# Note [sharded optimizer layout]
# An OSS rank holds the state of the parameters it owns, frozen ones included. Its entries are saved under
# "optim.<global parameter index>.<state name>", so the folder holds every entry exactly once and a load at another
# world size works: each rank asks dcp for the indices it owns under the new partition, shaped from the folder's
# metadata. Non-tensor state values, the param-group hyperparameters and OSS's step count ("optim_entries", absent in
# older folders: Note [saved step count] in shardopt.optim.delayed_update) go in a small metadata file that rank 0
# writes next to dcp's files. A ZeRO-3 FullyShardedDataParallel describes its parameters and its optimizer's state as
# ShardedTensor pieces keyed by parameter name (Note [sharded optimizer state dict] in
# shardopt.nn.fsdp.optim_state_dict). Any other optimizer (a plain torch.optim over a DDP model, or one over the
# DTensor shards of an FSDP2 model) goes through torch's get_state_dict / set_state_dict, which key state by parameter
# name and let dcp deduplicate replicated tensors and reshard DTensors.


@runtime_checkable
class ShardedOptimizer(Protocol):
    """An optimizer whose ranks each hold part of the state (OSS).

    ``group`` is the process group the state is sharded over (``None``: the world); under
    hybrid sharding it is the shard group and the other shard groups hold equal copies
    (Note [replicated optimizer state] in :mod:`shardopt.state_checks`).
    """

    group: comm.ProcessGroup | None

    @property
    def params(self) -> tuple[torch.Tensor, ...]: ...

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None: ...

    def finish_update(self) -> None: ...

    def sharded_state_entries(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]: ...

    def state_dict_entries(self) -> dict[str, Any]: ...

    def sharded_state_template(self, saved: Mapping[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]: ...

    def load_sharded_state_entries(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any],
                                   param_groups: list[dict[str, Any]], entries: Mapping[str, Any] | None = None) -> None: ...


@runtime_checkable
class ShardedModel(Protocol):
    """A model wrapper that shards parameters (ZeRO-3) and so owns its optimizer's layout."""

    def sharded_state_dict(self) -> dict[str, Any]: ...

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    @staticmethod
    def full_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                              rank0_only: bool = True) -> dict[str, Any]: ...

    @staticmethod
    def shard_full_optim_state_dict(full_osd: dict[str, Any], model: nn.Module,
                                    optim: torch.optim.Optimizer) -> dict[str, Any]: ...

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]: ...

    @staticmethod
    def load_sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                      osd: dict[str, Any]) -> None: ...


@contextmanager
def _named_failures(label: str, reading: str | None = None) -> Iterator[None]:
    """dcp's own collectives: a peer that failed or died is named like in shardopt's own
    (Note [failure board] in :mod:`shardopt.failures`). While ``reading`` a folder, a step
    that failed on some rank (dcp raises that on every rank) is a damaged or foreign folder:
    a ``ValueError`` naming it (``CheckpointException`` is no ``Exception``)."""
    try:
        yield
    except (RuntimeError, CheckpointException) as exc:
        if reading is not None and isinstance(exc, CheckpointException) and exc.failures:
            rank, (cause, _) = min(exc.failures.items(), key=lambda item: item[0])
            text = (str(cause).strip().splitlines() or [""])[0]
            raise ValueError(f"checkpoint {reading!r} cannot be read: rank {rank} failed with "
                             f"{type(cause).__name__}: {text}; the folder is damaged or holds another model: "
                             "restore it from a backup or an earlier checkpoint") from exc
        if isinstance(exc, CollectiveError) or not (dist.is_available() and dist.is_initialized()):
            raise
        raise failures.collective_error(label, exc) from exc


def _rank() -> int:
    return comm.group_rank(None) if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return comm.group_size(None) if dist.is_available() and dist.is_initialized() else 1


def _members(group: comm.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group`` (``None``: the world), in group-rank order; not a collective."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return list(range(_world()))
    return dist.get_process_group_ranks(group)


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        comm.barrier(None)


# ---------------------------------------------------------------------- consolidated


def save_consolidated(
    path: str, module: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any] | None = None,
    master_weights: bool = False,
) -> None:
    """Write one checkpoint file holding the full model and optimizer state. Call on every rank.

    Args:
        path: the file to write (its folder is created).
        module: the model *without* its data-parallel wrapper (e.g. ``ddp.module``), or a
            ZeRO-3 ``FullyShardedDataParallel`` (whose ``state_dict`` is full); its
            ``state_dict`` must be full on rank 0.
        optimizer: a :class:`ShardedOptimizer` (OSS, consolidated onto rank 0 here, a
            collective), an optimizer over a :class:`ShardedModel`'s shards (gathered
            through the wrapper), a plain ``torch.optim`` optimizer whose state is the same
            on every rank; or ``None``.
        extra: small picklable values saved alongside (step, scaler state, config).
        master_weights: save the model's parameters from the optimizer's master weights
            (``OSS(master_dtype=torch.float32)``) instead of their low-precision values: an
            fp32 model, e.g. to export. Loading it back rounds them into the parameters, so
            a resume stays exact. The optimizer state holds the masters either way.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        ValueError: ``path`` is a folder or cannot be written (see :func:`check_writable`),
            or ``master_weights`` with an optimizer that keeps no master weights.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module (the unwrapped model), got {type(module).__name__}")
    if master_weights and not (isinstance(optimizer, ShardedOptimizer) and getattr(optimizer, "master_dtype", None)):
        raise ValueError(f"save_consolidated(master_weights=True) needs an OSS with master_dtype set, got "
                         f"{type(optimizer).__name__}; build OSS(..., master_dtype=torch.float32), or pass "
                         "master_weights=False to save the parameters as they are")
    check_writable(path, sharded=False)
    _tidy(path)
    if isinstance(optimizer, ShardedOptimizer):  # on every rank, before the model is read (Note [delayed update])
        optimizer.finish_update()
    model_state = module.state_dict()  # on every rank: a collective for a ZeRO-3 wrapper
    optim_state: dict[str, Any] | None = None
    if isinstance(optimizer, ShardedOptimizer):
        members = _members(optimizer.group)
        if 0 in members:  # only the shard group of rank 0 (Note [replicated optimizer state])
            optimizer.consolidate_state_dict(recipient_rank=members.index(0))
        if _rank() == 0:
            optim_state = optimizer.state_dict()
    elif optimizer is not None and isinstance(module, ShardedModel):
        optim_state = type(module).full_optim_state_dict(module, optimizer)
    elif optimizer is not None:
        optim_state = optimizer.state_dict()
    if _rank() == 0 and master_weights and optim_state is not None:
        assert isinstance(optimizer, ShardedOptimizer)
        model_state = _with_master_weights(model_state, module, optimizer.params, optim_state["state"])
    if _rank() == 0:
        extra_state = dict(extra or {})
        blob = {"format": CONSOLIDATED_FORMAT, "model": model_state, "optimizer": optim_state,
                "extra": extra_state,
                "checksums": {"model": checksums(model_state, values=True),
                              "optimizer": checksums(optim_state, values=True),
                              "extra": checksums(extra_state, values=True)}}
        atomic_write(path, lambda f: torch.save(blob, f))
        logger.info("wrote consolidated checkpoint %s", path)
    _barrier()


def _with_master_weights(model_state: dict[str, Any], module: nn.Module, params: tuple[torch.Tensor, ...],
                         state: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """``model_state`` with each parameter that has a master weight in ``state`` (keyed by
    index in ``params``) replaced by it, under every name of the parameter (tied ones too)."""
    names: dict[torch.Tensor, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    out = dict(model_state)
    for index, entry in state.items():
        if MASTER_KEY in entry:
            out.update({name: entry[MASTER_KEY] for name in names.get(params[index], []) if name in out})
    return out


def _tidy(path: str) -> None:
    """At the start of every save and load, on rank 0 (which alone writes temporary files and
    staging folders): Note [leftovers of killed saves] in shardopt.files."""
    if _rank() == 0:
        tidy(os.path.dirname(os.path.abspath(path)))


def _read_consolidated(path: str) -> dict[str, Any]:
    if is_temp_name(path):
        raise ValueError(f"{path!r} is the temporary file of an unfinished save, not a checkpoint; load the file "
                         "named without the leading '.' and the '.tmp-...' suffix")
    _tidy(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {path!r}; save one first with save_consolidated")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged file fails inside the unpickler in many ways
        raise ValueError(f"checkpoint {path!r} cannot be read ({type(exc).__name__}: {exc}); it is corrupted or "
                         "not a checkpoint: restore it from a backup or an earlier checkpoint") from exc
    if not isinstance(blob, dict) or blob.get("format") not in (CONSOLIDATED_FORMAT, *_OLD_FORMATS):
        raise ValueError(f"{path!r} is not a shardopt consolidated checkpoint (expected format "
                         f"{CONSOLIDATED_FORMAT!r}); was it written by save_sharded? use load_sharded")
    sums = blob.get("checksums")
    for part in ("model", "optimizer", "extra"):
        if sums is not None and part in sums:
            verify(repr(path), sums[part], checksums(blob[part], values=True))
    return blob


def load_consolidated(
    path: str, module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a file written by :func:`save_consolidated` into ``module`` and ``optimizer``.

    Every rank reads the file; a :class:`ShardedOptimizer` keeps the state of the
    parameters it owns under the current world size, whatever the world size that saved
    it. Everything is checked before anything changes (Note [checkpoint integrity] in shardopt.state_checks):
    checksums, parameter names and shapes, optimizer group sizes and state shapes. Files
    of the older formats ``/1`` (no checksums) and ``/2`` load too.

    Args:
        path: the checkpoint file.
        module: the unwrapped model (or a ZeRO-3 wrapper) to load into.
        optimizer: the optimizer to load into, or ``None`` to skip optimizer state.

    Returns:
        The ``extra`` dict that was saved.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a shardopt consolidated checkpoint, corrupted, or it does not fit
            the model or the optimizer (nothing is loaded then).
    """
    blob = _read_consolidated(path)
    expected = module.state_dict() if isinstance(module, ShardedModel) else module.state_dict(keep_vars=True)
    check_model_state(repr(path), shapes(expected), shapes(blob["model"]), dtypes(expected), dtypes(blob["model"]))
    osd = blob["optimizer"] if optimizer is not None else None
    if osd is not None:
        assert optimizer is not None
        if isinstance(module, ShardedModel):  # full state keyed by parameter name
            check_optimizer_state(repr(path), optimizer, osd, {k: v.shape for k, v in expected.items()})
        else:
            params = list(optimizer.params) if isinstance(optimizer, ShardedOptimizer) else [
                p for g in optimizer.param_groups for p in g["params"]]
            check_optimizer_state(repr(path), optimizer, osd, [p.shape for p in params])
    module.load_state_dict(blob["model"])
    if osd is not None:
        assert optimizer is not None
        if isinstance(module, ShardedModel):
            osd = type(module).shard_full_optim_state_dict(osd, module, optimizer)
        optimizer.load_state_dict(osd)
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
    except Exception:  # noqa: BLE001 - not a torch.save file at all, or a damaged one: not a checkpoint
        return None
    if not isinstance(blob, dict) or blob.get("format") not in (CONSOLIDATED_FORMAT, *_OLD_FORMATS):
        return None
    return dict(blob["extra"])


# ---------------------------------------------------------------------- sharded


def _encode(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    """(optimizer kind, the state for dcp, non-tensor values for the metadata file)."""
    if isinstance(model, ShardedModel):
        state: dict[str, Any] = {"model": model.sharded_state_dict()}
        if optimizer is not None:
            state["optim"] = type(model).sharded_optim_state_dict(model, optimizer)
        return ("zero3" if optimizer is not None else None), state, {}
    if isinstance(optimizer, ShardedOptimizer):  # entries first: they finish a delayed update (Note [delayed update])
        tensors, values = optimizer.sharded_state_entries()
        return "oss", {"model": model.state_dict(), "optim": tensors}, values
    if optimizer is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        return "torch", {"model": model_state, "optim": optim_state}, {}
    return None, {"model": get_model_state_dict(model)}, {}


# Note [a CPU save touches no GPU]
# torch.distributed.checkpoint's file writer stages tensors through a CUDA stream whenever CUDA
# is available, whatever their device, so a CPU job beside a GPU made a CUDA context in every
# rank at its first sharded save. CPU-only state is written with no GPU copy-ahead
# (FileSystemWriter(per_thread_copy_ahead=0)), which takes torch's serial CPU path.


def _writer(folder: str, state: Any) -> dcp.FileSystemWriter | None:
    """The writer for ``state`` (Note [a CPU save touches no GPU]); ``None``: torch's default."""
    stack, on_gpu = [state], False
    while stack and not on_gpu:
        item = stack.pop()
        on_gpu = isinstance(item, torch.Tensor) and item.device.type != "cpu"
        stack.extend(item.values() if isinstance(item, Mapping) else item if isinstance(item, (list, tuple)) else ())
    return None if on_gpu else dcp.FileSystemWriter(folder, per_thread_copy_ahead=0)


def save_sharded(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Any] | None = None
) -> None:
    """Write a sharded checkpoint folder with ``torch.distributed.checkpoint``. Call on every rank.

    How it works: the model's state and the optimizer's (Note [sharded optimizer layout];
    OSS includes the parked state of frozen parameters) go to ``dcp.save`` in a hidden
    staging folder next to ``path``, where every rank writes only what it holds and
    replicated tensors are written once; non-tensor values, hyperparameters, group sizes,
    checksums (Note [checkpoint integrity] in shardopt.state_checks) and ``extra`` go to a metadata file; then rank 0
    swaps the finished folder in (Note [sharded save staging] in shardopt.files). A failed or killed save
    leaves the previous ``path`` untouched; the staging folder of a killed one is removed by
    the next save or load in that folder once its writer is gone, or named in a warning
    where that cannot be checked (Note [leftovers of killed saves] in shardopt.files).

    Args:
        path: the folder to write (replaced when it is a shardopt checkpoint; must be on a
            file system all ranks see).
        model: the model (wrapped or not; load with the same kind of object).
        optimizer: an OSS, an optimizer over a ZeRO-3 wrapper, any other ``torch.optim``
            optimizer, or ``None``.
        extra: small picklable values saved alongside.

    Raises:
        ValueError: ``path`` is a file or a non-empty folder that is not a shardopt
            checkpoint (it is left untouched), or cannot be written (:func:`check_writable`).
    """
    path = os.path.abspath(path)
    check_writable(path, sharded=True)
    _tidy(path)
    # Named after rank 0's process (Note [sharded save staging] in shardopt.files); handing
    # the name over also keeps the other ranks from writing before rank 0 has tidied.
    staging = staging_path(path) if _rank() == 0 else ""
    staging = comm.broadcast_object(staging, 0, None) if _world() > 1 else staging
    kind, state, values = _encode(model, optimizer)
    try:
        sums = checksums(state.get("optim") if kind == "oss" else None, "/optim")
        gathered = comm.all_gather_object((values, sums), None) if _world() > 1 else [(values, sums)]
        # Replicas (hybrid sharding) hold the same entries: one writer each (Note [replicated optimizer state]).
        writers = assign_writers(f"save_sharded({path!r})", [{**s, **checksums(v, "/values", values=True)}
                                                              for v, s in gathered])
        if kind == "oss":
            state["optim"] = {k: v for k, v in state["optim"].items() if writers[f"/optim/{k}"] == _rank()}
        with _named_failures("shardopt::checkpoint::save"):
            dcp.save(state, checkpoint_id=staging, storage_writer=_writer(staging, state))
        if _rank() == 0:
            gathered[0][1].update(checksums(state["model"], "/model") if kind == "oss" else {})
            oss = optimizer if kind == "oss" and isinstance(optimizer, ShardedOptimizer) else None
            groups = None if oss is None else [{k: v for k, v in g.items() if k != "params"} for g in oss.param_groups]
            meta = {
                "format": SHARDED_FORMAT, "world_size": _world(), "optim_kind": kind, "param_groups": groups,
                "group_sizes": None if oss is None else [len(g["params"]) for g in oss.param_groups],
                "optim_entries": None if oss is None else oss.state_dict_entries(),  # Note [sharded optimizer layout]
                "optim_values": {k: v for part, _ in gathered for k, v in part.items()},
                "checksums": {k: v for _, part in gathered for k, v in part.items()},
                "extra": dict(extra or {}),
            }
            meta["meta_crc"] = meta_crc(meta)
            atomic_write(os.path.join(staging, _META_FILE), lambda f: torch.save(meta, f))
            swap_in(staging, path, old_path(path))
            logger.info("wrote sharded checkpoint %s", path)
    except BaseException:
        if _rank() == 0:
            remove_path(staging)
        raise
    _barrier()


def _read_meta(path: str) -> dict[str, Any]:
    meta_path = os.path.join(path, _META_FILE)
    if not os.path.isfile(meta_path):
        old = old_path(path)
        if not os.path.exists(path) and os.path.isfile(os.path.join(old, _META_FILE)):
            raise FileNotFoundError(f"no sharded checkpoint at {path!r}: a save was killed while replacing it and "
                                    f"the previous checkpoint is in {old!r}; rename that folder to {path!r}")
        raise FileNotFoundError(f"no sharded checkpoint at {path!r} (missing {_META_FILE}); save one first "
                                "with save_sharded")
    try:
        meta = torch.load(meta_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"checkpoint {path!r}: {_META_FILE} cannot be read ({type(exc).__name__}); it is "
                         "corrupted: restore the folder from a backup or an earlier checkpoint") from exc
    if not isinstance(meta, dict) or meta.get("format") not in (SHARDED_FORMAT, *_OLD_FORMATS):
        raise ValueError(f"{path!r} is not a shardopt sharded checkpoint (format "
                         f"{meta.get('format') if isinstance(meta, dict) else None!r})")
    if "meta_crc" in meta and meta["meta_crc"] != meta_crc(meta):
        raise ValueError(f"checkpoint {path!r} is corrupted: {_META_FILE} fails its checksum; restore the folder "
                         "from a backup or an earlier checkpoint")
    return dict(meta)


def _clone(obj: Any) -> Any:
    """A deep copy of the plain tensors (so dcp fills a copy, not the live model)."""
    if isinstance(obj, torch.Tensor) and (type(obj) is torch.Tensor or isinstance(obj, nn.Parameter)):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


def _saved_tensors(path: str, prefix: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of every tensor the folder holds under ``prefix`` (dcp's metadata)."""
    items = dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
    return {key[len(prefix):]: (item.size, item.properties.dtype) for key, item in items
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)}


def _check_model_tensors(path: str, state: Mapping[str, Any]) -> None:
    """The model's tensor names, full shapes and dtypes against the folder's, before dcp reads."""
    expected = {k: v.size() for k, v in state.items() if isinstance(v, torch.Tensor)}
    found = _saved_tensors(path, "model.")
    saved: dict[str, torch.Size | None] = {k: size for k, (size, _) in found.items()}
    saved_dtypes: dict[str, torch.dtype | None] = {k: dtype for k, (_, dtype) in found.items()}
    check_model_state(repr(path), expected, saved, dtypes(state), saved_dtypes)


def _agree(check: Callable[[], None]) -> None:
    """Run this rank's part of a check; if it failed on any rank, raise on every rank, so
    that no rank loads while another refuses."""
    error = None
    try:
        check()
    except ValueError as exc:
        error = str(exc)
    errors = comm.all_gather_object(error, None) if _world() > 1 else [error]
    failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    if failed:
        rank, text = failed[0]
        raise ValueError(text + (f" (found by rank {rank})" if _world() > 1 else ""))


def load_sharded(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a folder written by :func:`save_sharded`, at any world size. Call on every rank.

    How it works: the model's tensor names and shapes, the optimizer's groups and the shape of every saved OSS
    state entry are checked against the folder's metadata first; then dcp reads into copies, every rank verifies
    the checksums of what it read and the ranks agree; only then do the model and the optimizer change (Note
    [checkpoint integrity]). OSS state, parked state of frozen parameters included, goes to whichever rank owns
    each parameter now. Folders of the older formats ``/1`` (no checksums) and ``/2`` (no group sizes) load too.

    Args:
        path: the checkpoint folder.
        model: the model to load into (same kind of object as at save time).
        optimizer: the optimizer to load into, or ``None`` to skip optimizer state.

    Returns:
        The ``extra`` dict that was saved.

    Raises:
        FileNotFoundError: ``path`` is not a sharded checkpoint folder.
        ValueError: the folder holds another kind of optimizer state than ``optimizer``, is
            corrupted or cannot be read, or does not fit the model or the optimizer
            (nothing is loaded then).
    """
    path = os.path.abspath(path)
    _tidy(path)
    meta = _read_meta(path)
    kind = meta["optim_kind"]
    if optimizer is not None and kind is not None:
        ours = ("zero3" if isinstance(model, ShardedModel) else
                "oss" if isinstance(optimizer, ShardedOptimizer) else "torch")
        if ours != kind:
            raise ValueError(f"the checkpoint at {path!r} holds {kind!r} optimizer state but the optimizer given "
                             f"is a {type(optimizer).__name__} ({ours!r}); load with the kind of optimizer that "
                             "saved it, or pass optimizer=None to load the model only")
    with_optim = optimizer is not None and kind is not None
    sums = meta.get("checksums") or {}
    if isinstance(model, ShardedModel):
        state: dict[str, Any] = {"model": model.sharded_state_dict()}
        _check_model_tensors(path, state["model"])
        if with_optim:
            state["optim"] = type(model).sharded_optim_state_dict(model, optimizer)  # type: ignore[arg-type]
        with _named_failures("shardopt::checkpoint::load", reading=path):
            dcp.load(state, checkpoint_id=path)
        model.load_sharded_state_dict(state["model"])
        if with_optim:
            type(model).load_sharded_optim_state_dict(model, optimizer, state["optim"])  # type: ignore[arg-type]
    elif with_optim and kind == "oss":
        assert isinstance(optimizer, ShardedOptimizer)
        state = {"model": _clone(model.state_dict())}
        _check_model_tensors(path, state["model"])
        saved = _saved_tensors(path, "optim.")
        check_indexed_state(repr(path), optimizer, [p.shape for p in optimizer.params], meta, saved)
        _agree(lambda: state.__setitem__("optim", optimizer.sharded_state_template(saved)))  # a gap: refused everywhere
        with _named_failures("shardopt::checkpoint::load", reading=path):
            dcp.load(state, checkpoint_id=path)
        _agree(lambda: verify(repr(path), sums, {**checksums(state["model"], "/model"),
                                                  **checksums(state["optim"], "/optim")}))
        model.load_state_dict(state["model"])
        optimizer.load_sharded_state_entries(state["optim"], meta["optim_values"], meta["param_groups"],
                                             meta.get("optim_entries"))
    elif with_optim:
        assert optimizer is not None
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": _clone(model_state), "optim": _clone(optim_state)}
        _check_model_tensors(path, state["model"])
        with _named_failures("shardopt::checkpoint::load", reading=path):
            dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        state = {"model": _clone(get_model_state_dict(model))}
        _check_model_tensors(path, state["model"])
        with _named_failures("shardopt::checkpoint::load", reading=path):
            dcp.load(state, checkpoint_id=path)
        if kind == "oss":
            verify(repr(path), {k: v for k, v in sums.items() if k.startswith("/model")},
                    checksums(state["model"], "/model"))
        set_model_state_dict(model, state["model"])
    return dict(meta["extra"])
