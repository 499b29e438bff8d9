"""ZeRO-2 with fp32 master weights: ShardedDataParallel over OSS(master_dtype=torch.float32)
matches a single-process reference doing the same casts, accumulates in fp32 with and
without no_sync, keeps nothing it does not need, and skips a step everywhere when one rank
sees an inf (fp16 with ShardedGradScaler)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler
from shardopt.placeholders import is_placeholder
from shardopt.testing import run_ranks
from tests.helpers.clip import clip_with_fed_norm, norms_within
from tests.helpers.ddp_arithmetic import ddp_reduce
from tests.helpers.masters import (
    MasterReference,
    loss_of,
    low_mlp,
    max_ulps,
    sdp_reduce,
)

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

F32, BF16 = torch.float32, torch.bfloat16
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def _memory_after_step(opt: OSS, model: torch.nn.Module) -> bool:
    """Non-owners hold no master; nobody holds a gradient (low-precision or master)."""
    ok = True
    for i, p in enumerate(opt.params):
        master = opt.master_of(p)
        ok &= (master is not None) == opt.owns(i)
        ok &= p.grad is None and (master is None or master.grad is None)
    return ok


def _parity(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    zero_modes = ("optimizer", "wrapper", "module")
    for opt_name, (cls, kwargs) in OPTIMIZERS.items():
        for wire in (None, BF16):
            for cap in (0, 2**23):
                tag = f"{opt_name}/reduce={wire}/cap={cap}"
                model = low_mlp()
                opt = OSS(model.parameters(), optim=cls, master_dtype=F32, **kwargs)
                sdp = ShardedDataParallel(model, opt, reduce_buffer_size=cap, reduce_dtype=wire)
                ref = MasterReference(low_mlp(), cls, **kwargs)
                memory_ok = True
                for step in range(5):
                    where = {"optimizer": opt, "wrapper": sdp, "module": model}[zero_modes[step % 3]]
                    where.zero_grad(set_to_none=step % 2 == 0)
                    loss_of(sdp, rank, step).backward()
                    owned_grads_are_fp32 = all(
                        (opt.master_of(p) is None or (opt.master_of(p).grad.dtype == F32 and is_placeholder(p)))
                        for p in model.parameters())
                    opt.step()
                    memory_ok &= _memory_after_step(opt, model) and owned_grads_are_fp32
                    per_rank = [ref.local_grads(lambda m, r=r, s=step: loss_of(m, r, s)) for r in range(world_size)]
                    ref.add_master_grads([sdp_reduce(list(g), wire or F32) for g in zip(*per_rank)])
                    ref.step()
                out[tag + "/ulps"] = max_ulps(model.parameters(), ref.params)
                out[tag + "/memory_ok"] = memory_ok
                out[tag + "/masters_exact"] = all(
                    torch.equal(opt.master_of(p), m[slice(*opt.owned_rows(p))])  # type: ignore[arg-type, misc]
                    for p, m in zip(model.parameters(), ref.masters)
                    if opt.master_of(p) is not None)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_zero2_with_fp32_masters_matches_reference_doing_the_same_casts(world_size: int) -> None:
    results = run_ranks(_parity, world_size, timeout_s=90)
    print(f"\nworld_size={world_size} max |param diff| in bf16 ulps after 5 steps:")
    for key in results[0]:
        if key.endswith("/ulps"):
            worst = max(r[key] for r in results)
            print(f"  {key:45s} {worst:.2f}")
            # The owner sums in rank order at any world size, as the reference does.
            assert worst == 0.0, (key, worst)
        else:
            assert all(r[key] for r in results), key


def _accumulation(rank: int, world_size: int) -> dict[str, Any]:
    """Four micro-batches per step: every one reduced (plain), or summed locally under
    no_sync and reduced with the last one (no_sync) or by reduce() (manual_reduce)."""
    out: dict[str, Any] = {}
    for mode in ("plain", "no_sync", "manual_reduce"):
        model = low_mlp()
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=F32)
        sdp = ShardedDataParallel(model, opt, reduce_buffer_size=100)
        ref = MasterReference(low_mlp(), torch.optim.Adam, lr=1e-2)
        bf16_ref = MasterReference(low_mlp(), torch.optim.Adam, lr=1e-2)  # sums micro-batches in bf16
        local_sums_ok = True
        for step in range(4):
            opt.zero_grad(set_to_none=step % 2 == 1)
            sums: list[list[torch.Tensor]] | None = None
            bf16_sums: list[list[torch.Tensor]] | None = None
            for micro in range(4):
                last = micro == 3
                if mode == "plain" or (mode == "no_sync" and last):
                    loss_of(sdp, rank, 10 * step + micro).backward()
                else:
                    with sdp.no_sync():
                        loss_of(sdp, rank, 10 * step + micro).backward()
                    # the local sum is fp32 and .grad is freed (Note [no_sync sums in master precision] in local_sums)
                    local_sums_ok &= all(is_placeholder(p) for p in model.parameters())
                grads = [ref.local_grads(lambda m, r=r, s=10 * step + micro: loss_of(m, r, s))
                         for r in range(world_size)]
                if mode == "plain":
                    ref.add_master_grads([sdp_reduce(list(g), F32) for g in zip(*grads)])
                    bf16_ref.add_master_grads([sdp_reduce(list(g), F32) for g in zip(*grads)])
                else:
                    sums = [[g.float() for g in rank_grads] for rank_grads in grads] if sums is None else [
                        [a.add_(b) for a, b in zip(acc, rank_grads)] for acc, rank_grads in zip(sums, grads)]
                    bf16_sums = [list(rank_grads) for rank_grads in grads] if bf16_sums is None else [
                        [a + b for a, b in zip(acc, rank_grads)] for acc, rank_grads in zip(bf16_sums, grads)]
            if mode != "plain":
                assert sums is not None and bf16_sums is not None
                ref.add_master_grads([sdp_reduce(list(g), F32) for g in zip(*sums)])
                bf16_ref.add_master_grads([sdp_reduce(list(g), F32) for g in zip(*bf16_sums)])
            if mode == "manual_reduce":
                sdp.reduce()
            opt.step()
            ref.step()
            bf16_ref.step()
        out[mode] = max_ulps(model.parameters(), ref.params)
        out[mode + "/masters_differ_from_bf16_sums"] = any(
            not torch.equal(a, b) for a, b in zip(ref.masters, bf16_ref.masters))
        out[mode + "/local_sums_ok"] = local_sums_ok
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_accumulation_sums_in_fp32_with_and_without_no_sync(world_size: int) -> None:
    results = run_ranks(_accumulation, world_size, timeout_s=90)
    print(f"\nworld_size={world_size} accumulation (bf16 ulps vs reference): {results[0]}")
    for mode in ("plain", "no_sync", "manual_reduce"):
        assert max(r[mode] for r in results) == 0.0, (mode, results)
        assert all(r[mode + "/local_sums_ok"] for r in results), mode
    for mode in ("no_sync", "manual_reduce"):  # the fp32 sums are not what bf16 sums would give
        assert results[0][mode + "/masters_differ_from_bf16_sums"], mode


def _scaler(rank: int, world_size: int) -> dict[str, Any]:
    """fp16 parameters, fp32 masters, ShardedGradScaler; an inf in one owned gradient on the
    last rank only at step 3."""
    out: dict[str, Any] = {}
    f16 = torch.float16
    for wrapper in ("sdp", "ddp"):
        model = low_mlp(dtype=f16)
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=F32)
        wrapped = ShardedDataParallel(model, opt, reduce_buffer_size=50) if wrapper == "sdp" else DDP(model)
        scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=3, device="cpu")
        ref = MasterReference(low_mlp(dtype=f16), torch.optim.Adam, lr=1e-2)
        owned = [p for i, p in enumerate(opt.params) if opt.owns(i)]
        for step in range(6):
            opt.zero_grad()
            scale = scaler.get_scale()
            scaler.scale(loss_of(wrapped, rank, step, f16)).backward()
            # DDP's own reduced fp16 gradients: the reference steps on exactly what DDP summed
            ddp_grads = [p.grad.float() for p in model.parameters()] if wrapper == "ddp" else []
            if step == 3 and rank == world_size - 1 and owned:
                # Only the last rank sees it, in a gradient only it steps: its master's (ZeRO-2)
                # or its owned parameter's, folded into the master by the unscale (ZeRO-1).
                master = opt.master_of(owned[0])
                assert master is not None
                target = master.grad if master.grad is not None else owned[0].grad
                target.view(-1)[0] = float("inf")  # type: ignore[union-attr]
            if step == 1:
                scaler.unscale_(opt)  # explicit: the unscaled gradients are the masters' fp32 ones
                out[f"{wrapper}/unscaled_fp32_master_grads"] = all(
                    opt.master_of(p).grad.dtype == F32 and p.grad is None for p in owned)  # type: ignore[union-attr]
            before = ([p.detach().clone() for p in model.parameters()],
                      [opt.master_of(p).detach().clone() for p in owned],  # type: ignore[union-attr]
                      copy.deepcopy(opt.optim.state_dict()["state"]))
            scaler.step(opt)
            scaler.update()
            if step == 3:
                after_state = opt.optim.state_dict()["state"]
                out[f"{wrapper}/params_unchanged"] = all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
                out[f"{wrapper}/masters_unchanged"] = all(
                    torch.equal(a, opt.master_of(p)) for a, p in zip(before[1], owned))  # type: ignore[arg-type]
                out[f"{wrapper}/state_unchanged"] = all(torch.equal(before[2][k][n], after_state[k][n])
                                                        for k in before[2] for n in before[2][k])
                out[f"{wrapper}/backed_off"] = scaler.get_scale() == scale * 0.5
                out[f"{wrapper}/master_grads_freed"] = all(opt.master_of(p).grad is None for p in owned)  # type: ignore[union-attr]
                continue
            per_rank = [ref.local_grads(lambda m, r=r, s=step, k=scale: loss_of(m, r, s, f16) * k) for r in range(world_size)]
            reduced = ddp_grads or [sdp_reduce(list(g), F32) for g in zip(*per_rank)]
            if wrapper == "ddp" and world_size == 2:  # DDP's sum is the single-process one at 2 ranks
                out["ddp/sum_exact"] = out.get("ddp/sum_exact", True) and all(
                    torch.equal(a, ddp_reduce(list(g)).float()) for a, g in zip(ddp_grads, zip(*per_rank)))
            ref.add_master_grads([g * (1.0 / scale) for g in reduced])
            ref.step()
        out[f"{wrapper}/ulps"] = max_ulps(model.parameters(), ref.params, f16)
        out[f"{wrapper}/final_scale"] = scaler.get_scale()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp16_inf_in_one_ranks_master_grad_makes_every_rank_skip_and_back_off(world_size: int) -> None:
    results = run_ranks(_scaler, world_size, timeout_s=90)
    print(f"\nworld_size={world_size} fp16 + scaler: " + ", ".join(f"{k}={v}" for k, v in results[0].items()))
    for r in results:
        for key, value in r.items():
            if key.endswith(("unchanged", "backed_off", "freed", "master_grads")):
                assert value is True, (key, r)
    for wrapper in ("sdp", "ddp"):
        assert len({r[f"{wrapper}/final_scale"] for r in results}) == 1
        # ZeRO-2 sums in rank order like the reference; ZeRO-1 is compared with DDP's own sums.
        assert max(r[f"{wrapper}/ulps"] for r in results) == 0.0, wrapper
    if world_size == 2:
        assert all(r["ddp/sum_exact"] for r in results)


def _clip(rank: int, world_size: int) -> dict[str, Any]:
    """ZeRO-2 with fp32 masters clipped by OSS.clip_grad_norm against torch's clip of the
    reference's masters by OSS's total (Note [fed clip norms] in tests/helpers/clip.py: the
    default plan splits the 32 x 16 weight, whose norm is then the norm of its blocks' norms)."""
    model = low_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.5, master_dtype=F32)
    sdp = ShardedDataParallel(model, opt)
    ref = MasterReference(low_mlp(), torch.optim.SGD, lr=0.5)
    names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
    out: dict[str, Any] = {"split": [names[opt.params[i]] for i in opt.plan.split_params], "fp32": True, "norms": [],
                           "numel": sum(p.numel() for p in model.parameters())}
    for step in range(3):
        opt.zero_grad()
        loss_of(sdp, rank, step).backward()
        total = opt.clip_grad_norm(0.05)
        opt.step()
        per_rank = [ref.local_grads(lambda m, r=r, s=step: loss_of(m, r, s)) for r in range(world_size)]
        ref.add_master_grads([sdp_reduce(list(g), F32) for g in zip(*per_rank)])
        ref_total = torch.nn.utils.get_total_norm([m.grad for m in ref.masters if m.grad is not None])
        clip_with_fed_norm(ref.masters, 0.05, total)
        ref.step()
        out["norms"].append((float(ref_total), float(total)))
        out["fp32"] &= total.dtype == F32
    out["ulps"] = max_ulps(model.parameters(), ref.params)
    return out


def test_clip_grad_norm_clips_the_fp32_master_gradients_like_torch() -> None:
    results = run_ranks(_clip, 2, timeout_s=60)
    for r in results:
        assert r["split"] == ["2.weight"] and r["fp32"], r
        assert len(r["norms"]) == 3 and norms_within(r["norms"], r["numel"]), r  # torch's within its summation error
        assert r["ulps"] == 0.0, r


def _freeze(rank: int, world_size: int) -> dict[str, Any]:
    """Freeze the largest layer for two steps mid-training: ShardedDataParallel re-partitions,
    the frozen parameter's master is parked with its state and comes back unchanged."""
    model = low_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=F32)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=100)
    ref = MasterReference(low_mlp(), torch.optim.Adam, lr=1e-2)
    layer, ref_layer = model[2], ref.model[2]  # type: ignore[index]
    owners = []
    for step in range(6):
        frozen = step in (2, 3)
        for p in (*layer.parameters(), *ref_layer.parameters()):
            p.requires_grad_(not frozen)
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the set of trainable parameters changed; re-partitioning"
            loss_of(sdp, rank, step).backward()
        owners.append(opt.partition.owners)
        opt.step()
        trainable = [(k, p) for k, p in enumerate(ref.params) if p.requires_grad]
        per_rank = [torch.autograd.grad(loss_of(ref.model, r, step), [p for _, p in trainable])
                    for r in range(world_size)]
        reduced = [sdp_reduce(list(g), F32) for g in zip(*per_rank)]
        for (k, _), g in zip(trainable, reduced):
            ref.masters[k].grad = g
        ref.step()
    return {"ulps": max_ulps(model.parameters(), ref.params), "repartitioned": len(set(owners)) > 1}


def test_freezing_a_layer_mid_training_parks_its_master_and_matches_reference() -> None:
    results = run_ranks(_freeze, 2, timeout_s=60)
    assert all(r["ulps"] == 0.0 and r["repartitioned"] for r in results), results


def _discarded_gradients(rank: int, world_size: int) -> dict[str, Any]:
    """A backward whose gradients are then zeroed, on any object and either way, adds
    nothing to the next step: the run equals one that never did that backward (Note
    [placeholders for moved gradients])."""
    zeroers = {
        "module/none": lambda model, sdp, opt: model.zero_grad(set_to_none=True),
        "module/zeros": lambda model, sdp, opt: model.zero_grad(set_to_none=False),
        "optimizer/zeros": lambda model, sdp, opt: torch.optim.Optimizer.zero_grad(opt, set_to_none=False),
        "per_parameter": lambda model, sdp, opt: [setattr(p, "grad", None) for p in model.parameters()],
        "wrapper": lambda model, sdp, opt: sdp.zero_grad(),
    }
    out: dict[str, Any] = {}
    for discard_under_no_sync in (False, True):
        for name, zero in [("never", None), *zeroers.items()]:
            model = low_mlp()
            opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=F32)
            sdp = ShardedDataParallel(model, opt, reduce_buffer_size=100)
            placeholders_ok = True
            for step in range(3):
                if zero is not None:
                    if discard_under_no_sync:
                        with sdp.no_sync():
                            loss_of(sdp, rank, 100 + step).backward()
                    else:
                        loss_of(sdp, rank, 100 + step).backward()
                    placeholders_ok &= any(is_placeholder(p) for p in model.parameters())
                    zero(model, sdp, opt)
                loss_of(sdp, rank, step).backward()
                if step == 1:  # torch's clip over the model skips placeholders (and warns)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                opt.step()
                placeholders_ok &= all(p.grad is None for p in model.parameters())
            tag = f"no_sync={discard_under_no_sync}/{name}"
            out[tag] = [p.detach().clone() for p in model.parameters()]
            out[tag + "/placeholders_ok"] = placeholders_ok
            sdp.close()
    result: dict[str, Any] = {}
    for tag in [t for t in out if not t.endswith("_ok") and not t.endswith("/never")]:
        never = out[tag.split("/")[0] + "/never"]
        result[tag] = all(torch.equal(a, b) for a, b in zip(out[tag], never))
        result[tag + "/placeholders_ok"] = out[tag + "/placeholders_ok"]
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradients_zeroed_on_the_module_between_backward_and_step_are_not_stepped(world_size: int) -> None:
    results = run_ranks(_discarded_gradients, world_size, timeout_s=120)
    failed = sorted({k for r in results for k, v in r.items() if not v})
    assert not failed, failed
