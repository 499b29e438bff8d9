"""Checkpoints of the integrations: ``checkpoint="full"`` or ``"sharded"``, and the
converter from a sharded folder to one file.

Note [sharded trainer checkpoints]
A full checkpoint gathers the whole model and the whole optimizer state on rank 0 (for a
7B model with fp32 masters and Adam that is 84 GB of host memory on one rank). With
``checkpoint="sharded"`` the Lightning strategies and the ``ShardedTrainer`` write a folder
through :func:`shardopt.checkpoint.save_sharded` instead: every rank writes what it holds
(OSS: the state of the parameters it owns; ZeRO-3: its flat shards and their state), and the
folder loads at any world size (:func:`shardopt.checkpoint.load_sharded` reshards). What the
framework adds to a checkpoint (epoch, step, loops, callbacks, schedulers, scaler) travels
in the folder's ``extra`` as pickled bytes under ``"trainer_state"``, so the folder is still
swapped in atomically as one. The parameters' full shapes go under ``"param_shapes"``: a
ZeRO-3 folder stores each parameter flattened, and :func:`convert_sharded` needs the shapes
to hand ``from_pretrained`` real weights.
"""

from __future__ import annotations

import enum
import io
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardopt.checkpoint import load_sharded, read_extra, save_sharded
from shardopt.files import remove_path, replacing, temp_path, tidy

__all__ = ["CheckpointKind", "convert_sharded", "load_trainer_checkpoint", "parse_checkpoint_kind",
           "save_trainer_checkpoint"]


class CheckpointKind(enum.Enum):
    """How an integration writes checkpoints (Note [sharded trainer checkpoints])."""

    FULL = "full"
    SHARDED = "sharded"


def parse_checkpoint_kind(value: Any, owner: str) -> CheckpointKind:
    """``"full"``/``"sharded"`` (or the enum) as a :class:`CheckpointKind`.

    Raises:
        ValueError: any other value (named with ``owner``, the argument's owner).
    """
    try:
        return CheckpointKind(value.value if isinstance(value, CheckpointKind) else value)
    except ValueError:
        raise ValueError(f"{owner}(checkpoint={value!r}): checkpoint must be 'full' (one file, gathered on rank 0) "
                         "or 'sharded' (a folder every rank writes its shard to)") from None


def save_trainer_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                            trainer_state: Mapping[str, Any], param_shapes: Mapping[str, torch.Size]) -> None:
    """Write a sharded checkpoint folder with the framework's own state (a collective).

    Args:
        path: the folder.
        model: what :func:`~shardopt.checkpoint.save_sharded` takes: the plain module under
            an OSS, or the ZeRO-3 root.
        optimizer: the OSS, or the plain optimizer over the ZeRO-3 shards.
        trainer_state: the framework's checkpoint without weights and optimizer state.
        param_shapes: each parameter's full shape, by name.
    """
    buffer = io.BytesIO()
    torch.save(dict(trainer_state), buffer)
    extra = {"trainer_state": buffer.getvalue(), "param_shapes": {k: list(v) for k, v in param_shapes.items()}}
    save_sharded(path, model, optimizer, extra=extra)


def load_trainer_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load a folder written by :func:`save_trainer_checkpoint` into ``model`` and
    ``optimizer`` (at any world size; a collective) and return the framework's state.

    Raises:
        FileNotFoundError: ``path`` is not a sharded checkpoint folder.
        ValueError: the folder was not written by an integration (no trainer state), or
            does not fit the model or optimizer (see ``load_sharded``).
    """
    extra = load_sharded(path, model, optimizer)
    if "trainer_state" not in extra:
        raise ValueError(f"the sharded checkpoint at {path!r} holds no trainer state (it was written by "
                         "save_sharded directly); load it with shardopt.checkpoint.load_sharded")
    state: dict[str, Any] = torch.load(io.BytesIO(extra["trainer_state"]), map_location="cpu", weights_only=False)
    return state


def _strip(prefix: str, flat: Mapping[str, Any]) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)}


def convert_sharded(path: str, out: str) -> list[str]:
    """Turn a sharded checkpoint folder into one file that needs neither shardopt nor ranks.

    How it works: ``torch.distributed.checkpoint``'s own converter reads every shard into
    one process (no process group); the model's entries become full tensors, reshaped to
    the shapes the integration recorded (ZeRO-3 stores parameters flattened). ``out`` is
    replaced atomically (Note [atomic writes] in :mod:`shardopt.files`) and its name
    decides the format:

    * ``*.safetensors``: the model's weights only, as ``safetensors`` writes them with
      ``{"format": "pt"}`` metadata; name it ``model.safetensors`` next to a model's
      ``config.json`` and ``from_pretrained`` loads it (tied weights are stored once each
      name, equal values);
    * ``*.bin``: the weights as a plain ``torch.save`` state dict (``pytorch_model.bin``);
    * anything else: ``{"state_dict": weights, "optimizer_entries": ..., "extra": ...}``
      via ``torch.save``: every tensor the folder holds.

    Args:
        path: the folder written by ``save_sharded`` (or an integration's ``"sharded"``).
        out: the file to write.

    Returns:
        The names of the weights written.

    Raises:
        FileNotFoundError: ``path`` is not a sharded checkpoint folder.
        ValueError: ``out`` ends in ``.safetensors`` but the ``safetensors`` package is
            not installed.
    """
    extra = read_extra(path) if os.path.isdir(path) else None
    if extra is None:
        raise FileNotFoundError(f"no sharded checkpoint at {path!r}: pass the folder a sharded save wrote")
    shapes = {k: torch.Size(v) for k, v in (extra.get("param_shapes") or {}).items()}
    # The scratch file and out's own temporary file are named after this process, so a
    # convert killed midway leaves nothing the next one cannot tell from a live one (Note
    # [leftovers of killed saves] in shardopt.files).
    tidy(os.path.dirname(os.path.abspath(out)))
    scratch = temp_path(out + ".shardopt-convert")
    try:
        dcp_to_torch_save(path, scratch)
        flat: dict[str, Any] = torch.load(scratch, map_location="cpu", weights_only=False)
    finally:
        remove_path(scratch)
    model_state = flat.get("model", _strip("model.", flat))
    weights = {k: (v.reshape(shapes[k]) if k in shapes and v.shape != shapes[k] else v).contiguous()
               for k, v in model_state.items() if isinstance(v, torch.Tensor)}
    if out.endswith(".safetensors"):
        try:
            from safetensors.torch import (
                save_file,  # optional dependency, comes with transformers
            )
        except ImportError:
            raise ValueError(f"cannot write {out!r}: the safetensors package is not installed; pip install "
                             "safetensors, or write a .bin / .pt file") from None
        with replacing(out) as tmp:
            save_file({k: v.clone() for k, v in weights.items()}, tmp, metadata={"format": "pt"})
    elif out.endswith(".bin"):
        with replacing(out) as tmp:
            torch.save(weights, tmp)
    else:
        optim = flat.get("optim", _strip("optim.", flat))
        with replacing(out) as tmp:
            torch.save({"state_dict": weights, "optimizer_entries": optim,
                        "extra": {k: v for k, v in extra.items() if k != "trainer_state"}}, tmp)
    return sorted(weights)
