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
        assert "OSS.state_dict() has no consolidated state (consolidate_state_dict() was never called on this " \
            "optimizer): call optimizer.consolidate_state_dict(recipient_rank)" \
            in r["before_consolidation"]
        assert "recipient_rank must be -1 (all ranks) or a rank in [0, 2), got 2" in r["recipient_too_big"]
        assert "got -2" in r["recipient_negative"]
        assert r["param_count"] == (
            "state_dict has parameter groups of sizes [3, 2] (5 parameters) but this OSS has [6] (6 parameters); "
            "load a state dict saved from the same model and param groups"
        )
        assert "state_dict['state'] has entries [7] that no param group lists" in r["stray_state"]
        assert "state_dict must be a torch.optim state dict with 'state' and 'param_groups'" in r["not_a_state_dict"]


def _caller_in(module: str, inner: Any = None) -> Any:
    """A function defined as if in ``module`` that calls ``inner(opt)`` (default: ``opt.state_dict()``),
    so the stack looks as when that module calls (Note [naming the integration in the state_dict error])."""
    namespace: dict[str, Any] = {"__name__": module, "inner": inner or (lambda opt: opt.state_dict())}
    exec("def call(opt):\n    return inner(opt)\n", namespace)
    return namespace["call"]


def _message(fn: Any) -> str:
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return ""


def _missing_state(rank: int, world_size: int) -> dict[str, str]:
    out: dict[str, str] = {}
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=Adam, lr=1e-3)
    out["never"] = _message(opt.state_dict)
    for module in ("transformers.trainer", "lightning.pytorch.strategies.strategy", "accelerate.accelerator"):
        out[module] = _message(lambda m=module: _caller_in(m)(opt))
    ours = _caller_in("shardopt.integrations.accelerate", _caller_in("accelerate.accelerator"))
    out["shardopt integration"] = _message(lambda: ours(opt))
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    out["never, then a step"] = _message(opt.state_dict)
    opt.consolidate_state_dict(recipient_rank=0)
    out["elsewhere"] = _message(opt.state_dict) if rank == 1 else "on the recipient"
    out["elsewhere via accelerate"] = _message(lambda: _caller_in("accelerate.accelerator")(opt)) if rank == 1 else ""
    opt.consolidate_state_dict(recipient_rank=-1)
    saved = opt.state_dict()
    opt.step()
    out["stepped"] = _message(opt.state_dict)
    opt.consolidate_state_dict(recipient_rank=-1)
    opt.load_state_dict(saved)
    out["loaded"] = _message(opt.state_dict)
    opt.consolidate_state_dict(recipient_rank=-1)
    next(model.parameters()).requires_grad_(False)
    opt.refresh_trainable()
    out["repartitioned"] = _message(opt.state_dict)
    return out


def test_state_dict_without_a_consolidation_says_why_and_names_the_integration_of_the_framework_that_called() -> None:
    for rank, r in enumerate(run_ranks(_missing_state, 2, timeout_s=60)):
        generic = ": call optimizer.consolidate_state_dict(recipient_rank) on every rank first (after the last step)"
        assert r["never"] == (f"[rank {rank}] OSS.state_dict() has no consolidated state (consolidate_state_dict() "
                              f"was never called on this optimizer){generic}, then state_dict() on the recipient, or "
                              "state_dict(all_ranks=True) on every rank"), r
        assert r["never, then a step"] == r["never"], r
        assert "it was called by a plain transformers.Trainer" in r["transformers.trainer"], r
        assert "use shardopt.integrations.transformers.ShardedTrainer" in r["transformers.trainer"], r
        assert "it was called by a Lightning strategy that is not shardopt's" in r["lightning.pytorch.strategies.strategy"]
        assert "Trainer(strategy='shardopt_zero1' or 'shardopt_zero2')" in r["lightning.pytorch.strategies.strategy"]
        assert "it was called by a plain accelerate.Accelerator" in r["accelerate.accelerator"], r
        assert "use shardopt.integrations.accelerate.ShardedAccelerator (the same arguments)" in \
            r["accelerate.accelerator"], r
        assert r["shardopt integration"] == r["never"], r  # shardopt's own integration called: no hint
        if rank == 1:
            assert r["elsewhere"] == ("[rank 1] OSS.state_dict() has no consolidated state (the last "
                                      "consolidate_state_dict() collected the state on rank 0, not this rank): call "
                                      "state_dict() on rank 0, or consolidate_state_dict(recipient_rank=-1) on every "
                                      "rank to have it on every rank"), r
            assert "collected the state on rank 0, not this rank); it was called by a plain accelerate.Accelerator" \
                in r["elsewhere via accelerate"], r
        assert f"(step() ran after the last consolidate_state_dict()){generic}" in r["stepped"], r
        assert "(a state was loaded (load_state_dict or a sharded checkpoint) after the last " \
            "consolidate_state_dict())" in r["loaded"], r
        assert "(parameters were added or frozen/unfrozen (add_param_group, refresh_trainable) after the last " \
            "consolidate_state_dict())" in r["repartitioned"], r
