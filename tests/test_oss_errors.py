"""Every OSS error message, triggered: each says what is wrong and what to do, and none hangs."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim import SGD, Adam

from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)


def test_optimizer_instance_instead_of_class_is_a_type_error() -> None:
    model = seeded_mlp()
    with pytest.raises(TypeError, match=r"optim must be a torch.optim.Optimizer subclass .* got an instance of SGD; pass the class"):
        OSS(model.parameters(), optim=SGD(model.parameters(), lr=0.1), lr=0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got 'adam'"):
        OSS(model.parameters(), optim="adam")  # type: ignore[arg-type]


def test_no_process_group_says_how_to_initialise() -> None:
    assert not dist.is_initialized()  # the pytest process never initialises one
    with pytest.raises(RuntimeError, match=r"OSS needs torch.distributed to be initialised: call "
                       r"torch.distributed.init_process_group.*world_size=1"):
        OSS(seeded_mlp().parameters(), optim=SGD, lr=0.1)


def _capture(fn: Any) -> str:
    """Run ``fn`` and return the ValueError's message ('' when nothing was raised)."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def _mismatches(rank: int, world_size: int) -> dict[str, str]:
    """Each case builds OSS with a rank-dependent parameter list; every rank must raise."""
    out = {}
    params = list(seeded_mlp().parameters())
    odd = rank == world_size - 1
    out["order"] = _capture(lambda: OSS(params[::-1] if odd else params, optim=SGD, lr=0.1))
    other = list(seeded_mlp(width=24 if odd else 16).parameters())
    out["shape"] = _capture(lambda: OSS(other, optim=SGD, lr=0.1))
    out["count"] = _capture(lambda: OSS(params[:-1] if odd else params, optim=SGD, lr=0.1))
    out["dtype"] = _capture(lambda: OSS([p.detach().double().requires_grad_() if odd else p for p in params], optim=SGD, lr=0.1))
    opt = OSS(params[:2], optim=SGD, lr=0.1)
    out["add_param_group"] = _capture(lambda: opt.add_param_group({"params": params[2:3] if odd else params[3:4]}))
    out["groups_after_failed_add"] = str(len(opt.param_groups))  # rolled back
    opt = OSS(params, optim=SGD, lr=0.1)
    params[0].requires_grad_(not odd)  # frozen on one rank only
    out["refresh_trainable"] = _capture(opt.refresh_trainable)
    params[0].requires_grad_(True)
    bent = nn.Parameter(torch.randn(6, 4).t()) if odd else nn.Parameter(torch.randn(4, 6))
    out["contiguous_one_rank"] = _capture(lambda: OSS([bent], optim=SGD, lr=0.1))
    bent_everywhere = nn.Parameter(torch.randn(6, 4).t())
    out["contiguous_all_ranks"] = _capture(lambda: OSS([bent_everywhere], optim=SGD, lr=0.1))
    return out


def test_parameter_lists_that_differ_across_ranks_are_named_at_construction() -> None:
    for world_size in (2, 3):
        results = run_ranks(_mismatches, world_size, timeout_s=30)  # a hang would be a RankTimeout
        last = world_size - 1
        for r in results:  # every rank raised the same message, none hung
            assert r == results[0]
        msg = results[0]
        prefix = "OSS was given different parameter lists on different ranks: "
        fix = "every rank must pass the same parameters in the same order"
        for key in ("order", "shape", "count", "dtype", "add_param_group", "refresh_trainable", "contiguous_one_rank"):
            assert msg[key].startswith(prefix) and fix in msg[key], (key, msg[key])
        assert re.search(rf"parameter 0 is .*\(0, \(16, 8\), 'torch.float32'.* on rank 0 but \(0, \(4,\), .* on rank {last}",
                         msg["order"]), msg["order"]
        assert re.search(rf"parameter 0 is .*\(16, 8\).* on rank 0 but .*\(24, 8\).* on rank {last}", msg["shape"])
        assert f"rank 0 has 6 parameters, rank {last} has 5" in msg["count"]
        assert "'torch.float32'" in msg["dtype"] and "'torch.float64'" in msg["dtype"]
        assert re.search(rf"parameter 2 is .*=\(1, \(32,\), .* on rank 0 but \(1, \(32, 16\), .* on rank {last}",
                         msg["add_param_group"]), msg["add_param_group"]
        assert re.search(r"parameter 0 .* True, True\) on rank 0 but .* False, True\) on rank", msg["refresh_trainable"])
        assert msg["groups_after_failed_add"] == "1"
        assert "contiguous" in msg["contiguous_one_rank"]
        assert msg["contiguous_all_ranks"].startswith("OSS needs contiguous parameters; parameter 0 (shape (4, 6)")
        assert "param.data = param.data.contiguous()" in msg["contiguous_all_ranks"]


def _misuse(rank: int, world_size: int) -> dict[str, str]:
    out: dict[str, str] = {}
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=Adam, lr=1e-3)
    try:
        opt.state_dict()
    except RuntimeError as e:
        out["before_consolidation"] = str(e)
    out["recipient_too_big"] = _capture(lambda: opt.consolidate_state_dict(recipient_rank=world_size))
    out["recipient_negative"] = _capture(lambda: opt.consolidate_state_dict(recipient_rank=-2))
    two_groups = {"state": {}, "param_groups": [{"params": [0, 1, 2], "lr": 1.0}, {"params": [3, 4], "lr": 1.0}]}
    out["param_count"] = _capture(lambda: opt.load_state_dict(two_groups))
    stray = {"state": {7: {}}, "param_groups": [{"params": list(range(6)), "lr": 1.0}]}
    out["stray_state"] = _capture(lambda: opt.load_state_dict(stray))
    out["not_a_state_dict"] = _capture(lambda: opt.load_state_dict({"weights": []}))
    # Still usable afterwards: nothing was half-done and no collective is pending.
    opt.consolidate_state_dict(recipient_rank=0)
    out["usable"] = "yes"
    return out


def test_misuse_of_state_dict_api_names_the_fix() -> None:
    for r in run_ranks(_misuse, 2, timeout_s=30):
        assert r["usable"] == "yes"
        assert "OSS.state_dict() has no consolidated state: call optimizer.consolidate_state_dict(recipient_rank)" \
            in r["before_consolidation"]
        assert "recipient_rank must be -1 (all ranks) or a rank in [0, 2), got 2" in r["recipient_too_big"]
        assert "got -2" in r["recipient_negative"]
        assert r["param_count"] == (
            "state_dict has parameter groups of sizes [3, 2] (5 parameters) but this OSS has [6] (6 parameters); "
            "load a state dict saved from the same model and param groups"
        )
        assert "state_dict['state'] has entries [7] that no param group lists" in r["stray_state"]
        assert "state_dict must be a torch.optim state dict with 'state' and 'param_groups'" in r["not_a_state_dict"]
