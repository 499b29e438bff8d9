"""Ranks that disagree on what shapes the collectives are refused at construction on every
rank, naming the first difference (Note [agree before the first collective] in shardopt.agreement); arguments that
would silently ruin training are refused; torch's clip_grad_norm_ over sharded gradients
warns while a wrapper lives, and torch's own function is back once the last one is closed or
collected (Note [clipping that bypasses the wrapper] in shardopt.clipping)."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from shardopt.nn import FullyShardedDataParallel as FSDP
from shardopt.nn import ShardedDataParallel
from shardopt.nn.fsdp import ShardingStrategy
from shardopt.optim import OSS
from shardopt.optim.grad_scaler import ShardedGradScaler
from shardopt.testing import run_ranks
from tests.helpers.data import rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)


def _message(fn: Callable[[], Any], kind: type[BaseException] = ValueError) -> str:
    try:
        fn()
    except kind as exc:
        return str(exc)
    return "no error"


class _Swapped(nn.Module):
    """Two layers of the same shapes, registered in an order that depends on the rank."""

    def __init__(self, swap: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        first, second = nn.Linear(4, 4), nn.Linear(4, 4)
        if swap:
            self.b, self.a = second, first
        else:
            self.a, self.b = first, second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _disagreements(rank: int, world_size: int) -> dict[str, str]:
    odd = rank == 1
    m: dict[str, str] = {}
    model = seeded_mlp()
    m["oss_fp16"] = _message(lambda: OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, broadcast_fp16=odd))
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    m["sdp_bucket"] = _message(lambda: ShardedDataParallel(model, opt, reduce_buffer_size=100 if odd else 200))
    m["sdp_dtype"] = _message(lambda: ShardedDataParallel(model, opt, reduce_dtype=torch.bfloat16 if odd else None))
    m["fsdp_order"] = _message(lambda: FSDP(_Swapped(swap=odd)))
    m["fsdp_strategy"] = _message(lambda: FSDP(seeded_mlp(), sharding_strategy=(
        ShardingStrategy.SHARD_GRAD_OP if odd else ShardingStrategy.FULL_SHARD)))
    meta = seeded_mlp().to("meta")
    m["oss_meta"] = _message(lambda: OSS(meta.parameters(), optim=torch.optim.SGD, lr=0.1))
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 4))
    m["fsdp_sparse"] = _message(lambda: FSDP(sparse), TypeError)
    # the group still works after every refusal: nothing was left half-issued
    fine = FSDP(seeded_mlp())
    fine(rank_batch(rank, 0)).sum().backward()
    m["still_works"] = "yes"
    return m


EXPECTED = {
    "oss_fp16": "OSS was built differently on different ranks: broadcast_fp16 is False on rank 0 but True on rank 1",
    "sdp_bucket": "reduce_buffer_size is 200 on rank 0 but 100 on rank 1",
    "sdp_dtype": "reduce dtype is {} on rank 0 but {'torch.float32': 'torch.bfloat16'} on rank 1",
    "fsdp_order": "parameters (name, shape, dtype) in registration order is [('a.weight'",
    "fsdp_strategy": "sharding_strategy is 'FULL_SHARD' on rank 0 but 'SHARD_GRAD_OP' on rank 1",
    "oss_meta": "OSS got meta-device parameters: call module.to_empty",
    "fsdp_sparse": "has sparse=True: FullyShardedDataParallel reduces dense gradients only",
    "still_works": "yes",
}


def test_ranks_that_disagree_are_refused_at_construction_naming_the_difference() -> None:
    for messages in run_ranks(_disagreements, 2, timeout_s=60):
        for key, fragment in EXPECTED.items():
            assert fragment in messages[key], (key, messages[key])


def _clip_warnings(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("sdp", "fsdp"):
        models = [seeded_mlp(), seeded_mlp()]
        if kind == "sdp":
            opts = [OSS(m.parameters(), optim=torch.optim.SGD, lr=0.1) for m in models]
            wrapped: list[nn.Module] = [ShardedDataParallel(m, o) for m, o in zip(models, opts)]
            own = lambda: opts[0].clip_grad_norm(1.0)  # noqa: E731
        else:
            wrapped = [FSDP(m) for m in models]
            own = lambda: wrapped[0].clip_grad_norm_(1.0)  # type: ignore[operator]  # noqa: E731
        for w in wrapped:
            w(rank_batch(rank, 0)).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            totals = [float(own()), float(torch.nn.utils.clip_grad_norm_(wrapped[1].parameters(), 1.0))]
            out[f"{kind}/warnings"] = [str(w.message) for w in caught]
        out[f"{kind}/totals"] = totals
    return out


def test_torch_clip_over_sharded_gradients_equals_the_wrappers_own_methods_without_a_warning() -> None:
    for out in run_ranks(_clip_warnings, 2, timeout_s=60):
        for kind in ("sdp", "fsdp"):
            assert out[f"{kind}/warnings"] == [], out
            first, second = out[f"{kind}/totals"]
            assert first == second and first > 1.0, out  # the global norm, and it clips


def _clip_restored(rank: int, world_size: int) -> dict[str, bool]:
    torch_fn = torch.nn.utils.clip_grad.clip_grad_norm_
    cell = torch_fn.__closure__[0]  # type: ignore[index]  # Note [clipping that bypasses the wrapper]
    torch_inner = cell.cell_contents

    def is_torch() -> bool:
        return (torch.nn.utils.clip_grad_norm_ is torch_fn and torch.nn.utils.clip_grad.clip_grad_norm_ is torch_fn
                and cell.cell_contents is torch_inner)

    out = {"torch before": is_torch()}
    models = [seeded_mlp(), seeded_mlp()]
    opts = [OSS(m.parameters(), optim=torch.optim.SGD, lr=0.1) for m in models]
    first, second = (ShardedDataParallel(m, o) for m, o in zip(models, opts, strict=True))
    out["torch with two wrappers"] = is_torch()
    first.close()
    out["torch with one wrapper left"] = is_torch()
    second.close()
    out["torch after the last close"] = is_torch()
    fsdp = FSDP(seeded_mlp())
    fsdp(rank_batch(rank, 0)).sum().backward()
    out["torch with an FSDP"] = is_torch()
    del fsdp
    gc.collect()
    out["torch after the FSDP is collected"] = is_torch()

    def someone_elses(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch_fn(*args, **kwargs)

    fsdp = FSDP(seeded_mlp())
    cell.cell_contents = someone_elses
    del fsdp
    gc.collect()
    out["a later replacement kept"] = cell.cell_contents is someone_elses
    out["the names are torch's"] = torch.nn.utils.clip_grad_norm_ is torch_fn
    cell.cell_contents = torch_inner
    return out


def test_torch_clip_is_restored_when_the_last_sharded_wrapper_is_closed_or_collected() -> None:
    expected = {
        "torch before": True, "torch with two wrappers": False, "torch with one wrapper left": False,
        "torch after the last close": True, "torch with an FSDP": False, "torch after the FSDP is collected": True,
        "a later replacement kept": True, "the names are torch's": True,
    }
    for out in run_ranks(_clip_restored, 2, timeout_s=60):
        assert out == expected


@pytest.mark.parametrize("kwargs, kind, fragment", [
    ({"init_scale": 0.0}, ValueError, "init_scale must be > 0, got 0.0"),
    ({"init_scale": "big"}, TypeError, "init_scale must be a real number, got str 'big'"),
    ({"init_scale": float("inf")}, ValueError, "init_scale must be finite"),
    ({"growth_factor": 1.0}, ValueError, "growth_factor must be > 1"),
    ({"backoff_factor": 1.5}, ValueError, "backoff_factor must be in (0, 1)"),
    ({"growth_interval": 0}, ValueError, "growth_interval must be an int >= 1"),
])
def test_scaler_arguments_that_would_ruin_training_are_refused(kwargs: dict[str, Any], kind: type[Exception],
                                                               fragment: str) -> None:
    with pytest.raises(kind, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ShardedGradScaler(device="cpu", **kwargs)
