"""ZeRO-1 with fp32 master weights: DDP(bf16 model) + OSS(master_dtype=torch.float32).

Parity against two references: a single-process one doing DDP's casts (bit-exact at 2
ranks, where DDP's bf16 sum of two terms is order-free) and one that steps unsharded fp32
masters on DDP's own reduced gradients (bit-exact at every world size: what sharding must
not change). Also: masters move with ownership on re-partition and are never re-created,
clip_grad_norm on fp32 master gradients, checkpoints that resume bit-exactly and reshard,
and every error message."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt import checkpoint, comm
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.clip import clip_with_fed_norm, norms_within
from tests.helpers.ddp_arithmetic import ddp_reduce
from tests.helpers.masters import (
    MasterReference,
    loss_of,
    low_mlp,
    max_ulps,
)
from tests.helpers.oss import mixed_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

F32, BF16 = torch.float32, torch.bfloat16
NUMEL = 820  # low_mlp()'s parameters
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def _zero1(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for opt_name, (cls, kwargs) in OPTIMIZERS.items():
        for mode in ("plain", "accumulate", "clip", "closure"):
            tag = f"{opt_name}/{mode}"
            model = low_mlp()
            ddp = DDP(model)
            opt = OSS(model.parameters(), optim=cls, master_dtype=F32, **kwargs)
            on_ddp = MasterReference(low_mlp(), cls, **kwargs)  # steps on DDP's own sums
            single = MasterReference(low_mlp(), cls, **kwargs)  # DDP's casts, in one process
            memory_ok = True
            micro = 2 if mode == "accumulate" else 1
            for step in range(5):
                opt.zero_grad(set_to_none=step % 2 == 0)
                for k in range(micro):  # DDP sums micro-batches in the bf16 .grad (DDP's business)
                    loss_of(ddp, rank, 10 * step + k).backward()
                ddp_grads = [p.grad.float() for p in model.parameters()]  # type: ignore[union-attr]
                single_grads: list[torch.Tensor] | None = None
                for k in range(micro):
                    per_rank = [single.local_grads(lambda m, r=r, s=10 * step + k: loss_of(m, r, s))
                                for r in range(world_size)]
                    if single_grads is not None:  # DDP reduces .grad, which holds the earlier average
                        per_rank = [[a + g for a, g in zip(single_grads, grads)] for grads in per_rank]
                    single_grads = [ddp_reduce(list(g)) for g in zip(*per_rank)]
                assert single_grads is not None
                on_ddp.add_master_grads(ddp_grads)
                single.add_master_grads([g.float() for g in single_grads])
                if mode == "clip":  # the references clip by OSS's total (Note [fed clip norms])
                    total = opt.clip_grad_norm(0.02)
                    want = torch.nn.utils.get_total_norm([m.grad for m in on_ddp.masters if m.grad is not None])
                    out[tag + "/norms"] = [*out.get(tag + "/norms", []), (float(want), float(total))]
                    out[tag + "/split"] = bool(opt.plan.split_params)
                    clip_with_fed_norm(on_ddp.masters, 0.02, total)
                    clip_with_fed_norm(single.masters, 0.02, total)
                if mode == "closure":
                    opt.step(closure=lambda: 0.0)  # the closure's (here: no) backward is folded too
                else:
                    opt.step()
                on_ddp.step()
                single.step()
                for i, p in enumerate(opt.params):  # owners keep masters and no gradient at all
                    master = opt.master_of(p)
                    memory_ok &= (master is not None) == opt.owns(i)
                    memory_ok &= master is None or (master.grad is None and p.grad is None)
            out[tag + "/vs_ddp_sums"] = max_ulps(model.parameters(), on_ddp.params)
            out[tag + "/vs_single_process"] = max_ulps(model.parameters(), single.params)
            out[tag + "/memory_ok"] = memory_ok
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero1_ddp_with_fp32_masters_matches_references(world_size: int) -> None:
    results = run_ranks(_zero1, world_size, timeout_s=90)
    print(f"\nworld_size={world_size} max |param diff| in bf16 ulps after 5 steps:")
    for key in results[0]:
        if key.endswith("/norms"):
            # The default plan splits the 32 x 16 weight (every world size here): its norm is the
            # norm of its blocks' norms, torch's within its summation error.
            assert all(r[key.replace("/norms", "/split")] for r in results), key
            assert all(len(r[key]) == 5 and norms_within(r[key], NUMEL) for r in results), [r[key] for r in results]
        elif key.endswith("/split"):
            continue
        elif key.endswith(("vs_ddp_sums", "vs_single_process")):
            worst = max(r[key] for r in results)
            print(f"  {key:40s} {worst:.2f}")
            if key.endswith("vs_ddp_sums") or world_size == 2:
                assert worst == 0.0, (key, worst)
        else:
            assert all(r[key] for r in results), key


def _repartition(rank: int, world_size: int) -> dict[str, Any]:
    model = low_mlp()
    ddp = DDP(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=F32)
    ref = MasterReference(low_mlp(), torch.optim.Adam, lr=1e-2)

    def train(steps: range) -> None:
        for step in steps:
            opt.zero_grad()
            loss_of(ddp, rank, step).backward()
            ref.add_master_grads([p.grad.float() for p in model.parameters()])  # type: ignore[union-attr]
            opt.step()
            ref.step()

    def masters() -> dict[int, torch.Tensor]:
        return {i: s["master"].clone() for i, s in opt.state_dict(all_ranks=True)["state"].items()}

    train(range(3))
    before, owners_before = masters(), opt.partition.owners
    out: dict[str, Any] = {"masters_hold_more_than_params": any(
        not torch.equal(m, p.detach().float()) for m, p in zip(ref.masters, ref.params))}
    biggest = max(range(len(opt.params)), key=lambda i: opt.params[i].numel())
    opt.params[biggest].requires_grad_(False)
    opt.refresh_trainable()
    out["moved"] = sum(a != b for a, b in zip(owners_before, opt.partition.owners))
    out["frozen_keeps_masters"] = _same(before, masters())
    opt.params[biggest].requires_grad_(True)
    opt.refresh_trainable()
    out["thawed_keeps_masters"] = _same(before, masters())
    extra = nn.Linear(4, 3).to(BF16)
    opt.add_param_group({"params": list(extra.parameters()), "lr": 1e-3})
    added = masters()
    out["added_keeps_masters"] = _same(before, {i: added[i] for i in before})
    out["new_masters_from_params"] = all(torch.equal(added[len(before) + k], p.detach().float())
                                         for k, p in enumerate(extra.parameters()))
    train(range(3, 6))  # masters that moved keep training where they were
    out["ulps_after_moves"] = max_ulps(model.parameters(), ref.params)
    return out


def _same(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_masters_move_with_ownership_and_are_never_recreated_from_params() -> None:
    results = run_ranks(_repartition, 2, timeout_s=60)
    print(f"\nrepartition: {results[0]}")
    for r in results:
        assert r["masters_hold_more_than_params"] and r["moved"] > 0, r
        for key in ("frozen_keeps_masters", "thawed_keeps_masters", "added_keeps_masters", "new_masters_from_params"):
            assert r[key], (key, r)
        assert r["ulps_after_moves"] == 0.0, r


# ---------------------------------------------------------------------- checkpoints


def _train(model: nn.Module, opt: OSS, rank: int, steps: range) -> None:
    """Gradients summed one parameter at a time in a fixed order (see tests/test_checkpoint.py)."""
    for step in steps:
        opt.zero_grad(set_to_none=step % 2 == 0)
        loss_of(model, rank, step).backward()
        for param in model.parameters():
            comm.all_reduce(param.grad, None).wait()  # type: ignore[arg-type]
        opt.step()


def _masters_of(opt: OSS) -> list[torch.Tensor]:
    return [m.clone() for m in (opt.master_of(p) for p in opt.params) if m is not None]


def _resume(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for how in ("consolidated", "sharded", "export"):
        path = f"{folder}/{how}" + ("" if how == "sharded" else ".pt")
        model = low_mlp()
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=F32)
        _train(model, opt, rank, range(3))
        if how == "sharded":
            checkpoint.save_sharded(path, model, opt, {"step": 3})
        else:
            checkpoint.save_consolidated(path, model, opt, {"step": 3}, master_weights=how == "export")
        if how == "export" and rank == 0:
            saved = torch.load(path, weights_only=True)["model"]
            state = opt.state_dict()["state"]
            out["export_is_fp32_masters"] = all(
                torch.equal(saved[name], state[i]["master"]) and saved[name].dtype == F32
                for i, (name, _) in enumerate(model.named_parameters()))
        _train(model, opt, rank, range(3, 6))
        fresh = low_mlp(seed=1)  # everything must come from the checkpoint
        fresh_opt = OSS(fresh.parameters(), optim=torch.optim.Adam, lr=0.5, master_dtype=F32)
        load = checkpoint.load_sharded if how == "sharded" else checkpoint.load_consolidated
        assert load(path, fresh, fresh_opt) == {"step": 3}
        _train(fresh, fresh_opt, rank, range(3, 6))
        out[how + "/params_ulps"] = max_ulps(model.parameters(), fresh.parameters())
        out[how + "/masters_exact"] = all(torch.equal(a, b) for a, b in zip(_masters_of(opt), _masters_of(fresh_opt)))
    return out


def test_checkpoints_keep_fp32_masters_and_resume_bit_exactly(tmp_path: Any) -> None:
    results = run_ranks(_resume, 2, str(tmp_path), timeout_s=90)
    print(f"\nresume: {results[0]}")
    assert results[0]["export_is_fp32_masters"]
    for r in results:
        for how in ("consolidated", "sharded", "export"):
            assert r[how + "/params_ulps"] == 0.0 and r[how + "/masters_exact"], (how, r)


def _save(rank: int, world_size: int, folder: str) -> dict[str, Any] | None:
    model = low_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=F32)
    _train(model, opt, rank, range(3))
    checkpoint.save_consolidated(f"{folder}/c.pt", model, opt)
    checkpoint.save_sharded(f"{folder}/s", model, opt)
    opt.consolidate_state_dict(recipient_rank=0)
    return copy.deepcopy(opt.state_dict()) if rank == 0 else None


def _load(rank: int, world_size: int, folder: str) -> list[dict[str, Any] | None]:
    states = []
    for path, load in ((f"{folder}/c.pt", checkpoint.load_consolidated), (f"{folder}/s", checkpoint.load_sharded)):
        model = low_mlp(seed=5)
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.5, master_dtype=F32)
        load(path, model, opt)
        owned_masters = all((opt.master_of(p) is not None) == opt.owns(i) for i, p in enumerate(opt.params))
        opt.consolidate_state_dict(recipient_rank=0)
        states.append({"state": opt.state_dict(), "owned_masters": owned_masters} if rank == 0 else
                      {"owned_masters": owned_masters})
    return states


def test_masters_saved_at_two_ranks_load_identically_at_three_and_one(tmp_path: Any) -> None:
    saved = run_ranks(_save, 2, str(tmp_path), timeout_s=60)[0]
    assert saved is not None and all("master" in s for s in saved["state"].values())
    for world_size in (3, 1):
        results = run_ranks(_load, world_size, str(tmp_path), timeout_s=60)
        assert all(entry["owned_masters"] for r in results for entry in r)  # type: ignore[index]
        for loaded in results[0]:
            assert loaded is not None
            state = loaded["state"]
            assert state["param_groups"] == saved["param_groups"]
            assert state["state"].keys() == saved["state"].keys()
            for i, entry in saved["state"].items():
                for name, value in entry.items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(state["state"][i][name])), (i, name)


def _mixed_origins(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plain_model = low_mlp()
    plain = OSS(plain_model.parameters(), optim=torch.optim.Adam, lr=1e-2)  # no masters
    _train(plain_model, plain, rank, range(2))
    checkpoint.save_consolidated(f"{folder}/plain.pt", plain_model, plain)
    model = low_mlp(seed=3)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=F32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load_consolidated(f"{folder}/plain.pt", model, opt)
    out["no_masters_warns"] = any("has no master weights" in str(w.message) for w in caught)
    out["masters_start_from_params"] = all(  # a master copies the rows its rank owns (all of a whole parameter)
        torch.equal(opt.master_of(p), p.detach()[slice(*opt.owned_rows(p))].float())  # type: ignore[arg-type, misc]
        for p in model.parameters() if opt.master_of(p) is not None)
    _train(model, opt, rank, range(2, 4))
    checkpoint.save_consolidated(f"{folder}/masters.pt", model, opt)
    back = low_mlp(seed=4)
    back_opt = OSS(back.parameters(), optim=torch.optim.Adam, lr=1e-2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint.load_consolidated(f"{folder}/masters.pt", back, back_opt)
    out["masters_ignored_warns"] = any("that this OSS (master_dtype=None) keeps none for" in str(w.message)
                                       for w in caught)
    _train(back, back_opt, rank, range(4, 5))  # trains without masters
    out["ignored_masters_not_in_state"] = all("master" not in s for s in back_opt.optim.state.values())
    # a master whose shape does not fit its parameter: refused before anything changes
    opt.consolidate_state_dict(recipient_rank=-1)
    bad = copy.deepcopy(opt.state_dict())
    bad["state"][0]["master"] = torch.zeros(3)
    before = (_masters_of(opt), copy.deepcopy(opt.optim.state_dict()["state"]))
    try:
        opt.load_state_dict(bad)
        out["bad_master"] = "no error"
    except ValueError as exc:
        out["bad_master"] = str(exc)
    out["bad_master_changed_nothing"] = all(torch.equal(a, b) for a, b in zip(before[0], _masters_of(opt))) and all(
        torch.equal(before[1][k][n], opt.optim.state_dict()["state"][k][n]) for k in before[1] for n in before[1][k])
    if rank == 0:
        blob = torch.load(f"{folder}/masters.pt", weights_only=True)
        blob["optimizer"]["state"][0]["master"] = torch.zeros(16, 1)  # would fit as factored state
        del blob["checksums"]
        torch.save(blob, f"{folder}/bad.pt")
    comm.barrier(None)
    try:
        checkpoint.load_consolidated(f"{folder}/bad.pt", model, opt)
        out["bad_file"] = "no error"
    except ValueError as exc:
        out["bad_file"] = str(exc)
    return out


def test_checkpoints_with_and_without_masters_cross_load_and_bad_masters_are_refused(tmp_path: Any) -> None:
    results = run_ranks(_mixed_origins, 2, str(tmp_path), timeout_s=60)
    for r in results:
        for key in ("no_masters_warns", "masters_start_from_params", "masters_ignored_warns",
                    "ignored_masters_not_in_state", "bad_master_changed_nothing"):
            assert r[key], (key, r)
        assert ("state_dict['state'][0]['master'] has shape (3,) but parameter 0 has shape (16, 8); a master "
                "weight must be a floating tensor of exactly its parameter's shape" in r["bad_master"]), r
        assert "Nothing was loaded" in r["bad_master"]
        assert ("optimizer state 'master' of parameter 0 has shape (16, 1) in the checkpoint but the parameter "
                "has (16, 8); a master weight must be a floating tensor of exactly its parameter's shape"
                in r["bad_file"] and "Nothing was loaded" in r["bad_file"]), r["bad_file"]


# ---------------------------------------------------------------------- errors and rules


def _errors(rank: int, world_size: int) -> dict[str, str]:
    def message(fn: Any) -> str:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
        except (TypeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "warned: " + " | ".join(str(w.message) for w in caught)

    fp32 = list(low_mlp(dtype=F32).parameters())
    bf16 = list(low_mlp().parameters())
    out = {
        "not_a_dtype": message(lambda: OSS(bf16, master_dtype="float32")),
        "not_floating": message(lambda: OSS(bf16, master_dtype=torch.int32)),
        "narrower": message(lambda: OSS(fp32, master_dtype=BF16)),
        "same_width": message(lambda: OSS(bf16, master_dtype=torch.float16)),
        "no_op": message(lambda: OSS(fp32, master_dtype=F32)),
        "ranks_disagree": message(lambda: OSS(bf16, master_dtype=F32 if rank == 0 else torch.float64)),
        "no_masters_export": message(lambda: checkpoint.save_consolidated("/nonexistent/x.pt", low_mlp(),
                                                                          OSS(bf16), master_weights=True)),
    }
    opt = OSS(bf16, master_dtype=F32)
    out["add_fp64_group"] = message(lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(3).double())]}))
    out["groups_after_failed_add"] = str(len(opt.param_groups))
    out["torch_clip"] = message(lambda: torch.nn.utils.clip_grad_norm_(bf16, 1.0))
    model = low_mlp()
    params = list(model.parameters())
    a, b = OSS(params[:2], master_dtype=F32), OSS(params[2:])
    out["sdp_mixed"] = message(lambda: ShardedDataParallel(model, [a, b]))
    return out


def test_bad_master_dtype_inputs_are_refused_naming_argument_value_and_fix() -> None:
    results = run_ranks(_errors, 2, timeout_s=60)
    assert all(r == results[0] for r in results), results  # every rank raised the same, none hung
    msg = results[0]
    assert msg["not_a_dtype"].startswith("TypeError: master_dtype must be a torch.dtype"), msg
    assert msg["not_floating"].startswith("ValueError: master_dtype must be a floating dtype, got torch.int32"), msg
    assert "master_dtype=torch.bfloat16 cannot hold parameter 0 (shape (16, 8), dtype torch.float32)" in msg["narrower"]
    assert "torch.float32 for bf16/fp16 parameters" in msg["narrower"]
    assert "master_dtype=torch.float16 cannot hold parameter 0 (shape (16, 8), dtype torch.bfloat16)" in msg["same_width"]
    assert msg["no_op"].startswith("warned: OSS(master_dtype=torch.float32): every parameter is already "
                                   "torch.float32, so no master copies are kept"), msg["no_op"]
    assert ("OSS was built differently on different ranks: master_dtype is 'torch.float32' on rank 0 but "
            "'torch.float64' on rank 1; pass the same OSS arguments on every rank") in msg["ranks_disagree"], msg
    assert "save_consolidated(master_weights=True) needs an OSS with master_dtype set" in msg["no_masters_export"]
    assert "master_dtype=torch.float32 cannot hold parameter 6 (shape (3,), dtype torch.float64)" in msg["add_fp64_group"]
    assert msg["groups_after_failed_add"] == "1"  # rolled back
    assert msg["torch_clip"] == "warned: ", msg  # torch's clip over masters' parameters clips them, silently
    assert ("the sharded optimizers have different master_dtype (None, torch.float32); gradients of one dtype are "
            "reduced alike: give every OSS the same master_dtype") in msg["sdp_mixed"], msg["sdp_mixed"]


def _mixed_dtypes(rank: int, world_size: int) -> dict[str, Any]:
    """fp32 and bf16 parameters in one model: bf16 ones get masters, fp32 ones step as themselves."""
    model = mixed_mlp()
    ddp = DDP(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=F32)
    ref = MasterReference(mixed_mlp(), torch.optim.Adam, lr=1e-2)
    for step in range(4):
        opt.zero_grad()
        ddp(torch.randn(6, 8, generator=torch.Generator().manual_seed(step * 10 + rank))).float().pow(2).mean().backward()
        ref.add_master_grads([p.grad.float() for p in model.parameters()])  # type: ignore[union-attr]
        opt.step()
        ref.step()
    rule = all((opt.master_of(p) is not None) == (opt.owns(i) and p.dtype == BF16) for i, p in enumerate(opt.params))
    return {"rule": rule, "ulps": max_ulps(model.parameters(), ref.params)}


def test_mixed_fp32_and_bf16_parameters_keep_masters_for_the_bf16_ones_only() -> None:
    results = run_ranks(_mixed_dtypes, 2, timeout_s=60)
    assert all(r["rule"] and r["ulps"] == 0.0 for r in results), results
