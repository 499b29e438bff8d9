"""A checkpoint of another model is named as such, with the first names on each side and the
fix; a model saved inside (or loaded into) a wrapper names the prefix; a partial mismatch
keeps its list of missing and unexpected names (Note [foreign checkpoints] in
shardopt.state_checks). Each load path that checks names is covered: consolidated files,
sharded folders, and (in tests/test_failed_load_intact.py) FullyShardedDataParallel's
``load_state_dict``.
"""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from shardopt import checkpoint
from tests.helpers.data import seeded_mlp

Save = Callable[[str, nn.Module], None]
Load = Callable[[str, nn.Module], object]

PATHS: dict[str, tuple[str, Save, Load]] = {
    "consolidated": ("ck.pt", lambda path, model: checkpoint.save_consolidated(path, model, None),
                     lambda path, model: checkpoint.load_consolidated(path, model)),
    "sharded": ("ck", lambda path, model: checkpoint.save_sharded(path, model, None),
                lambda path, model: checkpoint.load_sharded(path, model)),
}


class _Other(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.decoder = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)


class _Wrapper(nn.Module):  # names its inner model "module.", as DDP does
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def _refused(tmp_path: Path, kind: str, saved: nn.Module, target: nn.Module) -> str:
    """Save ``saved``, load into ``target``: the message; ``target`` must be unchanged."""
    name, save, load = PATHS[kind]
    path = str(tmp_path / name)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp's note that it runs without a process group
        save(path, saved)
        with pytest.raises(ValueError) as info:
            load(path, target)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    message = str(info.value)
    assert message.startswith(f"checkpoint {path!r} ") and message.endswith("Nothing was loaded"), message
    return message


@pytest.mark.parametrize("kind", list(PATHS))
def test_a_checkpoint_of_another_model_is_named_as_such_with_the_first_names_on_each_side(tmp_path: Path,
                                                                                        kind: str) -> None:
    message = _refused(tmp_path, kind, _Other(), seeded_mlp())
    assert "appears to be of another model: none of its 6 names is among this model's 6 (the checkpoint's first " \
           "names: 'encoder.weight', 'encoder.bias', 'decoder.weight' and 3 more; this model's: '0.weight', " \
           "'0.bias', '2.weight' and 3 more). Load it into the model it was saved from (same architecture and " \
           "configuration), or give this model a checkpoint saved from it" in message, message
    assert "missing" not in message and "only 0 of" not in message, message


@pytest.mark.parametrize("kind", list(PATHS))
def test_a_checkpoint_sharing_few_names_is_named_as_another_model(tmp_path: Path, kind: str) -> None:
    # Only the first layer's 2 names are shared, out of 6 on each side.
    saved = nn.Sequential(OrderedDict([("0", nn.Linear(8, 16)), ("5", nn.Linear(16, 4)), ("6", nn.Linear(4, 4))]))
    message = _refused(tmp_path, kind, saved, seeded_mlp())
    assert "appears to be of another model: only 2 of its 6 names are among this model's 6 (the checkpoint's " \
           "first names: '5.weight', '5.bias', '6.weight' and 1 more; this model's: '2.weight', '2.bias', " \
           "'4.weight' and 1 more)" in message, message


@pytest.mark.parametrize("kind", list(PATHS))
def test_a_model_saved_inside_a_wrapper_or_loaded_into_one_names_the_prefix(tmp_path: Path, kind: str) -> None:
    message = _refused(tmp_path, kind, _Wrapper(seeded_mlp()), seeded_mlp())
    assert "does not fit this model: its names are this model's with 'module.' in front (e.g. 'module.0.weight' " \
           "for '0.weight'), so it was saved from this model inside a wrapper" in message, message
    assert "load it into the same wrapper, or save the unwrapped model (e.g. ddp.module)" in message, message
    message = _refused(tmp_path, kind, seeded_mlp(), _Wrapper(seeded_mlp()))
    assert "this model's names are the checkpoint's with 'module.' in front (e.g. 'module.0.weight' for " \
           "'0.weight'), so this model is inside a wrapper; load it into the module inside" in message, message


@pytest.mark.parametrize("kind", list(PATHS))
def test_a_partial_mismatch_keeps_the_list_of_missing_and_unexpected_names(tmp_path: Path, kind: str) -> None:
    saved = seeded_mlp()
    saved.add_module("head", nn.Linear(4, 2))  # one layer added: 6 of 8 names shared
    message = _refused(tmp_path, kind, saved, seeded_mlp())
    assert re.search(r"does not fit this model \(unexpected \['head.weight', 'head.bias'\]\); load it into the "
                     r"model it was saved from", message), message
    assert "another model" not in message, message
    message = _refused(tmp_path, kind, seeded_mlp(), saved)
    assert "does not fit this model (missing ['head.weight', 'head.bias'])" in message, message
