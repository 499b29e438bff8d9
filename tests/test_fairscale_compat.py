"""Drop-in compatibility: every parameter of fairscale's public constructors and methods
exists in shardopt's with the same name, position and default ("we add, never rename")."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest

from shardopt.nn.data_parallel import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.optim.grad_scaler import ShardedGradScaler

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    fairscale_optim = pytest.importorskip("fairscale.optim")
    fairscale_dp = pytest.importorskip("fairscale.nn.data_parallel")
    fairscale_scaler = pytest.importorskip("fairscale.optim.grad_scaler")

PAIRS: list[tuple[Any, Any, list[str]]] = [
    (fairscale_optim.OSS, OSS, ["__init__", "step", "clip_grad_norm", "consolidate_state_dict", "state_dict",
                                "load_state_dict", "add_param_group", "refresh_trainable", "partition_parameters",
                                "zero_grad"]),
    (fairscale_dp.ShardedDataParallel, ShardedDataParallel,
     ["__init__", "forward", "no_sync", "zero_grad", "reduce", "refresh_trainable", "sync_buffers", "to"]),
    (fairscale_scaler.ShardedGradScaler, ShardedGradScaler,
     ["__init__", "scale", "unscale_", "step", "update", "state_dict", "load_state_dict"]),
]


@pytest.mark.parametrize("theirs,ours,methods", PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_fairscale_signatures_are_a_prefix_of_ours(theirs: Any, ours: Any, methods: list[str]) -> None:
    for name in methods:
        their_params = list(inspect.signature(getattr(theirs, name)).parameters.values())
        our_params = list(inspect.signature(getattr(ours, name)).parameters.values())
        positional = [p for p in their_params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        for i, param in enumerate(positional):
            assert i < len(our_params), f"{ours.__name__}.{name} lacks fairscale's parameter {param.name!r}"
            mine = our_params[i]
            assert mine.name == param.name, f"{ours.__name__}.{name}: position {i} is {mine.name!r}, fairscale {param.name!r}"
            # A default where fairscale has none is an addition; a changed default is not.
            assert param.default is param.empty or mine.default == param.default, (
                f"{ours.__name__}.{name}({param.name}=...): default {mine.default!r}, fairscale {param.default!r}"
            )
        if any(p.kind is p.VAR_KEYWORD for p in their_params):
            assert any(p.kind is p.VAR_KEYWORD for p in our_params), f"{ours.__name__}.{name} lacks **kwargs"
