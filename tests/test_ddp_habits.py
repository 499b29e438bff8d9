"""A DDP script's habits under ZeRO-1/2: torch's clip_grad_norm_, accumulation
through ``require_backward_grad_sync``, DDP-only attributes, torch's GradScaler.

Each habit either gives DDP's result (bit for bit where the arithmetic is DDP's: fp32 at
two ranks; at three ranks ZeRO-2's reduction adds in another order than gloo's all-reduce,
so there the clip is compared with torch's clip over the *same* reduced gradients) or a
clear error on every rank. Every run has a short timeout, so a hang is a failure.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import clip_grad_norm_ as clip_bound_at_import  # bound before any wrapper exists

from shardopt.nn import FullyShardedDataParallel as FSDP
from shardopt.nn import ShardedDataParallel
from shardopt.nn.data_parallel.ddp_habits import DDP_ONLY
from shardopt.optim import OSS, ShardedGradScaler
from shardopt.optim import grad_norm
from shardopt.testing import RankFailure, run_ranks
from tests.helpers.data import decay_groups, rank_batch, seeded_mlp
from tests.helpers.gpt import gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

MAX_NORM = 0.05  # far below the gradients' norm (about 3): every step clips
SMALL_NORM = 0.01  # for the bf16 MLP, whose gradients' norm is about 0.19


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# ------------------------------------------------------------------ clip_grad_norm_ under ZeRO-2


def _gpt_like_ddp(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for how in ("torch.nn.utils.clip_grad_norm_", "bound at import", "OSS.clip_grad_norm"):
        ref, model = gpt(), gpt()
        ddp = DDP(ref)
        ref_opt = torch.optim.AdamW(decay_groups(ref), lr=1e-2)
        opt = OSS(decay_groups(model), optim=torch.optim.AdamW, lr=1e-2)
        sdp = ShardedDataParallel(model, opt)
        norms = []
        for step in range(6):
            toks = tokens(rank, step)
            lm_loss(ddp(toks), toks).backward()
            lm_loss(sdp(toks), toks).backward()
            expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
            if how == "OSS.clip_grad_norm":
                total = opt.clip_grad_norm(MAX_NORM)
            elif how == "bound at import":
                total = clip_bound_at_import(model.parameters(), MAX_NORM)
            else:
                total = torch.nn.utils.clip_grad_norm_(sdp.parameters(), MAX_NORM)
            norms.append((float(expected), float(total)))
            ref_opt.step()
            opt.step()
            ref_opt.zero_grad(set_to_none=step % 2 == 0)
            opt.zero_grad(set_to_none=step % 2 == 0)
        out[how] = {"params": max_diff(ref, model), "norms": norms}
        sdp.close()
    return out


def test_clipping_a_zero2_gpt_with_decay_groups_trains_bitwise_like_ddp() -> None:
    for out in run_ranks(_gpt_like_ddp, 2, timeout_s=120):
        for how, seen in out.items():
            assert seen["params"] == 0.0, (how, seen)
            assert all(a == b for a, b in seen["norms"]), (how, seen["norms"])
            assert min(a for a, _ in seen["norms"]) > 10 * MAX_NORM, seen  # clipping is active every step


def _full_reduced_grads(model: nn.Module) -> list[torch.Tensor | None]:
    """Every parameter's reduced gradient, from its owner (ZeRO-2 leaves it there only)."""
    mine = {i: p.grad.clone() for i, p in enumerate(model.parameters()) if p.grad is not None}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict[int, torch.Tensor] = {k: v for d in everyone for k, v in d.items()}
    return [merged.get(i) for i in range(len(list(model.parameters())))]


def _clip_orders(rank: int, world_size: int) -> dict[str, list[float]]:
    """Each way of passing parameters, against torch's clip over the same reduced gradients."""
    out: dict[str, list[float]] = {}
    extra = nn.Parameter(torch.ones(5))  # a plain parameter outside the model, mixed in
    for case in ("module order", "reversed", "matrices only", "with a plain parameter", "foreach=False", "max norm",
                 "OSS.clip_grad_norm"):
        model, ref = gpt(), gpt()
        opt = OSS(decay_groups(model), optim=torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(model, opt)
        toks = tokens(rank, 0)
        lm_loss(sdp(toks), toks).backward()
        for q, g in zip(ref.parameters(), _full_reduced_grads(model), strict=True):
            q.grad = g
        extra.grad = torch.full((5,), 0.5)
        ref_extra = nn.Parameter(torch.ones(5))
        ref_extra.grad = torch.full((5,), 0.5)
        passed, expected_over = list(model.parameters()), list(ref.parameters())
        if case == "reversed":
            passed, expected_over = passed[::-1], expected_over[::-1]
        elif case == "matrices only":
            passed = [p for p in passed if p.dim() >= 2]
            expected_over = [q for q in expected_over if q.dim() >= 2]
        elif case == "with a plain parameter":
            passed, expected_over = [passed[0], extra, *passed[1:]], [expected_over[0], ref_extra, *expected_over[1:]]
        options: dict[str, Any] = {"foreach": False} if case == "foreach=False" else {}
        if case == "max norm":
            options["norm_type"] = float("inf")
        # torch's own function: no registered parameter is in expected_over
        expected = torch.nn.utils.clip_grad.clip_grad_norm_(expected_over, MAX_NORM, **options)
        if case == "OSS.clip_grad_norm":
            total = opt.clip_grad_norm(MAX_NORM)
        else:
            total = torch.nn.utils.clip_grad_norm_(passed, MAX_NORM, **options)
        grad_diffs = [float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters())
                      if p.grad is not None and any(q is r for r in expected_over)]
        if case == "with a plain parameter":
            grad_diffs.append(float((extra.grad - ref_extra.grad).abs().max()))
        out[case] = [abs(float(total) - float(expected)), max(grad_diffs, default=0.0), float(total)]
        sdp.close()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_clip_over_zero2_sums_in_the_order_passed_bitwise_like_torch_on_the_same_gradients(
    world_size: int,
) -> None:
    for out in run_ranks(_clip_orders, world_size, timeout_s=120):
        for case, (norm_diff, grad_diff, total) in out.items():
            assert norm_diff == 0.0 and grad_diff == 0.0, (world_size, case, norm_diff, grad_diff)
            assert total > 10 * MAX_NORM, (case, total)


def _nonfinite(rank: int, world_size: int) -> dict[str, str]:
    out = {}
    for kind in ("ZeRO-2", "ZeRO-3"):
        model = seeded_mlp()
        net: nn.Module = (ShardedDataParallel(model, OSS(model.parameters(), lr=0.1)) if kind == "ZeRO-2"
                          else FSDP(model))
        if rank == 1:  # an inf on one rank only: the global norm is inf on every rank
            next(iter(model.parameters())).register_hook(lambda g: torch.full_like(g, float("inf")))
        net(rank_batch(rank, 0)).sum().backward()
        try:
            torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM, error_if_nonfinite=True)
            out[kind] = "clipped"
        except RuntimeError as exc:
            out[kind] = str(exc)
        if isinstance(net, ShardedDataParallel):
            net.close()
    return out


def test_error_if_nonfinite_raises_on_every_rank_when_one_rank_has_an_inf() -> None:
    for out in run_ranks(_nonfinite, 2, timeout_s=60):
        for kind, text in out.items():
            assert text.startswith("The total norm of order 2.0 for gradients from `parameters` is non-finite"), \
                (kind, text)
            assert "error_if_nonfinite=False" in text, (kind, text)


def _clip_on_rank_zero_only(rank: int, world_size: int, path: str) -> None:
    grad_norm.ARRIVAL_TIMEOUT_S = 2.0
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    sdp(rank_batch(rank, 0)).sum().backward()
    start = time.monotonic()
    try:
        if rank == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # as under `if rank == 0:`
        opt.step()
        seen: dict[str, Any] = {"error": None}
    except BaseException as exc:
        seen = {"error": str(exc), "kind": type(exc).__name__}
        raise
    finally:
        seen["seconds"] = time.monotonic() - start
        Path(path, f"rank{rank}.json").write_text(json.dumps(seen))


def test_torch_clip_on_one_rank_only_is_an_error_on_every_rank_not_a_hang(tmp_path: Path) -> None:
    with pytest.raises(RankFailure):
        run_ranks(_clip_on_rank_zero_only, 2, str(tmp_path), timeout_s=60)
    caller = json.loads((tmp_path / "rank0.json").read_text())
    other = json.loads((tmp_path / "rank1.json").read_text())
    assert caller["kind"] == "RuntimeError", caller
    assert ("[rank 0] gradient clipping over sharded gradients was called on this rank, but group rank(s) [1] did "
            "not call it within 2 s") in caller["error"], caller
    assert "on every rank, as with DDP, not under `if rank == 0`" in caller["error"], caller
    assert other["kind"] == "CollectiveError" and "rank 0 failed: RuntimeError: [rank 0] gradient clipping" in \
        other["error"], other
    assert caller["seconds"] < 10 and other["seconds"] < 12, (caller, other)


def _masters_clip(rank: int, world_size: int) -> dict[str, list[float]]:
    """bf16 parameters with fp32 masters: torch's clip over the model equals OSS.clip_grad_norm
    on a twin, under DDP (ZeRO-1) and ShardedDataParallel (ZeRO-2)."""
    from tests.helpers.masters import loss_of, low_mlp

    out: dict[str, list[float]] = {}
    for zero in ("ZeRO-1", "ZeRO-2"):
        models = [low_mlp(), low_mlp()]
        opts = [OSS(m.parameters(), optim=torch.optim.SGD, lr=0.1, master_dtype=torch.float32) for m in models]
        nets = [DDP(m) if zero == "ZeRO-1" else ShardedDataParallel(m, o) for m, o in zip(models, opts)]
        for net in nets:
            loss_of(net, rank, 0).backward()
        totals = [float(torch.nn.utils.clip_grad_norm_(models[0].parameters(), SMALL_NORM)),
                  float(opts[1].clip_grad_norm(SMALL_NORM))]
        for opt in opts:
            opt.step()
        out[zero] = [*totals, max_diff(models[0], models[1])]
        for net in nets:
            if isinstance(net, ShardedDataParallel):
                net.close()
    return out


def test_torch_clip_over_bf16_parameters_with_fp32_masters_clips_the_masters_like_oss() -> None:
    for out in run_ranks(_masters_clip, 2, timeout_s=120):
        for zero, (by_torch, by_oss, diff) in out.items():
            assert by_torch == by_oss and by_torch > 10 * SMALL_NORM and diff == 0.0, (zero, out)


def _placeholder(rank: int, world_size: int) -> tuple[float, list[float], bool]:
    from shardopt.clipping import ClipArgs
    from shardopt.optim.masters import is_placeholder, leave_placeholder

    p, q = nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    leave_placeholder(p)  # zeros standing for a gradient held elsewhere (Note [placeholders for moved gradients])
    q.grad = torch.full((4,), 2.0, dtype=torch.bfloat16)
    total = grad_norm.clip_params([], [p, q], ClipArgs(1.0))
    return float(total), q.grad.float().tolist(), is_placeholder(p)


def test_a_clip_neither_counts_nor_scales_the_placeholder_of_a_plain_parameter() -> None:
    total, clipped, still = run_ranks(_placeholder, 1, timeout_s=60)[0]
    assert total == 4.0 and clipped == [0.5] * 4 and still  # 2 / (4 + 1e-6) rounds to 0.5 in bf16


def _fsdp_and_mixed(rank: int, world_size: int) -> dict[str, Any]:
    def message(call: Any) -> str:
        try:
            call()
        except (ValueError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    out: dict[str, Any] = {}
    models = [seeded_mlp(), seeded_mlp()]
    wrapped = [FSDP(m) for m in models]
    for w in wrapped:
        w(rank_batch(rank, 0)).sum().backward()
    out["torch"] = float(torch.nn.utils.clip_grad_norm_(wrapped[0].parameters(), MAX_NORM))
    out["own"] = float(wrapped[1].clip_grad_norm_(MAX_NORM))
    out["grads"] = max(float((p.grad - q.grad).abs().max()) for p, q in  # type: ignore[operator]
                       zip(wrapped[0].parameters(), wrapped[1].parameters()) if p.grad is not None and p.grad.numel())
    part = list(wrapped[0].parameters())[:1]
    out["part"] = message(lambda: torch.nn.utils.clip_grad_norm_(part, MAX_NORM))
    out["plain"] = message(lambda: torch.nn.utils.clip_grad_norm_([*wrapped[0].parameters(), nn.Parameter(
        torch.ones(2))], MAX_NORM))
    model = seeded_mlp()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    out["two wrappers"] = message(lambda: torch.nn.utils.clip_grad_norm_(
        [*model.parameters(), *wrapped[0].parameters()], MAX_NORM))
    sdp.close()
    return out


def test_torch_clip_over_zero3_is_fsdp_clip_and_a_part_or_a_mix_is_refused() -> None:
    results = run_ranks(_fsdp_and_mixed, 2, timeout_s=120)
    for out in results:
        assert out["torch"] == out["own"] and out["grads"] == 0.0 and out["torch"] > 10 * MAX_NORM, out
        assert out["part"].startswith("ValueError: torch.nn.utils.clip_grad_norm_ was given 1 of the "), out
        assert "only all of them together can be clipped: pass model.parameters() of the FullyShardedDataParallel " \
               "(all of them, nothing else), or call FullyShardedDataParallel.clip_grad_norm_(max_norm)" in out["part"]
        assert " and 1 parameter(s) outside it" in out["plain"], out
        assert out["two wrappers"].startswith("ValueError: torch.nn.utils.clip_grad_norm_ was given parameters of 2 "
                                              "shardopt wrappers (FullyShardedDataParallel"), out
        assert "clip each model's parameters in its own call" in out["two wrappers"], out


# ------------------------------------------------------------------ accumulation and DDP's attributes


def _accumulate(rank: int, world_size: int) -> dict[str, Any]:
    ref, model = gpt(), gpt()
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(decay_groups(ref), lr=1e-2)
    opt = OSS(decay_groups(model), optim=torch.optim.AdamW, lr=1e-2)
    sdp = ShardedDataParallel(model, opt)
    micro_steps = 3
    for step in range(4):
        for micro in range(micro_steps):  # the nanoGPT loop
            last = micro == micro_steps - 1
            ddp.require_backward_grad_sync = last
            sdp.require_backward_grad_sync = last
            toks = tokens(rank, 10 * step + micro)
            (lm_loss(ddp(toks), toks) / micro_steps).backward()
            (lm_loss(sdp(toks), toks) / micro_steps).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
    refused = {}
    for name in DDP_ONLY:
        try:
            if name in ("_set_static_graph", "register_comm_hook"):
                getattr(sdp, name)()
            else:
                setattr(sdp, name, True)
            refused[name] = "accepted"
        except AttributeError as exc:
            refused[name] = str(exc)
    sdp.close()
    return {"params": max_diff(ref, model), "refused": refused}


def test_require_backward_grad_sync_accumulates_like_ddp_and_ddp_only_attributes_are_refused() -> None:
    for out in run_ranks(_accumulate, 2, timeout_s=120):
        assert out["params"] == 0.0, out
        for name, text in out["refused"].items():
            assert text.startswith(f"ShardedDataParallel has no DistributedDataParallel {name!r}"), (name, text)
            assert DDP_ONLY[name] in text, (name, text)


# ------------------------------------------------------------------ torch's GradScaler


def _scaler_with_inf_on_one_rank(rank: int, world_size: int, zero: str) -> dict[str, Any]:
    """DDP + torch's GradScaler against ZeRO-1 (DDP + OSS, torch's scaler) or ZeRO-2 with
    ShardedGradScaler, unscaling and clipping before the step as DDP scripts do; rank 1's
    gradient of the first layer holds an inf at step 1 only.
    bf16 autocast on CPU, so the scaler's arithmetic runs as on a GPU with fp16."""
    ref, model = seeded_mlp(), seeded_mlp()
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    wrapped: nn.Module
    if zero == "ZeRO-1":
        wrapped, scaler = DDP(model), torch.amp.GradScaler("cpu", init_scale=2.0**8)
    else:
        wrapped, scaler = ShardedDataParallel(model, opt), ShardedGradScaler(init_scale=2.0**8, device="cpu")
    scales = []
    for step in range(4):
        for net, s in ((ddp, ref_scaler), (wrapped, scaler)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(rank_batch(rank, step)).float().pow(2).mean()
            if step == 1 and rank == 1:
                handle = net.module[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
            s.scale(loss).backward()
            if step == 1 and rank == 1:
                handle.remove()
        for s, net, o in ((ref_scaler, ref, ref_opt), (scaler, model, opt)):  # the DDP script's clip
            s.unscale_(o)  # type: ignore[arg-type]
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        ref_scaler.step(ref_opt)
        scaler.step(opt)
        ref_scaler.update()
        scaler.update()
        scales.append((float(ref_scaler.get_scale()), float(scaler.get_scale())))
        ref_opt.zero_grad()
        opt.zero_grad()
    if isinstance(wrapped, ShardedDataParallel):
        wrapped.close()
    return {"params": max_diff(ref, model), "scales": scales}


@pytest.mark.parametrize("zero", ["ZeRO-1", "ZeRO-2"])
def test_inf_on_one_rank_makes_every_rank_skip_and_back_off_like_ddp(zero: str) -> None:
    for out in run_ranks(_scaler_with_inf_on_one_rank, 2, zero, timeout_s=120):
        assert out["params"] == 0.0, out
        assert all(a == b for a, b in out["scales"]), out
        assert out["scales"][1][0] == out["scales"][0][0] / 2, out  # the inf step backed off


def _torch_scaler_on_zero2(rank: int, world_size: int) -> str:
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(sdp(rank_batch(rank, 0)).sum()).backward()
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        return str(exc)
    finally:
        sdp.close()
    return "stepped"


def test_torch_grad_scaler_on_zero2_is_refused_at_the_first_step_on_every_rank_naming_sharded_grad_scaler() -> None:
    for rank, text in enumerate(run_ranks(_torch_scaler_on_zero2, 2, timeout_s=60)):
        assert text.startswith(f"[rank {rank}] torch.amp.GradScaler cannot step an OSS under ShardedDataParallel"), text
        assert "use shardopt.optim.ShardedGradScaler (same arguments)" in text, text
