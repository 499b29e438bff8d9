"""Per-parameter gradient norms under every stage (``shardopt.grad_norms``, Note [per-parameter
norms across ranks]) against DDP's, and the placeholder of a gradient held elsewhere refusing to
be read (Note [placeholders refuse to be read]).

Exactness: at 2 ranks every stage's reduced gradient is bit-identical to DDP's (the sum of two
fp32 terms commutes; tests/test_sharded_ddp_split.py), so a parameter held whole by one rank
gets exactly DDP's ``vector_norm`` (the float64 square and root round back to the same float32).
A parameter whose rows are spread over ranks (split by OSS, or every parameter under ZeRO-3) is
the root of a sum of per-block sums of squares instead of torch's one reduction: both are fp32
tree sums of ``n`` squares, each within about ``log2(n) * 2**-24`` relative of the exact sum, so
they differ by at most twice that, and the root halves it; each block's norm is rounded to fp32
once more (``2**-24``). The bound is ``(log2(n) + 1) * 2**-24`` per parameter: 1.1e-6 for the
head's 131,072 elements (measured: 2.0e-7 under ZeRO-2 and 3.0e-7 under ZeRO-3).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt import grad_norms
from shardopt.nn import FullyShardedDataParallel, ShardedDataParallel
from shardopt.nn.fsdp import ModuleClassPolicy
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.sdp import VocabModel, vocab_loss

pytestmark = pytest.mark.distributed  # starts processes

NUMEL = {n: p.numel() for n, p in VocabModel().named_parameters()}


def spread_bound(name: str) -> float:
    """Relative bound on a parameter spread over ranks (module docstring)."""
    return (math.log2(NUMEL[name]) + 1) * 2.0**-24


def _clean(name: str) -> str:
    return name.removeprefix("module.")


def _stage(kind: str) -> tuple[nn.Module, nn.Module, Any]:
    """(model to run, module to pass to grad_norms, optimizer) for one stage on a fresh VocabModel."""
    model = VocabModel()
    if kind == "zero1":
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        return DDP(model), model, opt
    if kind == "zero2":
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
        return ShardedDataParallel(model, opt), model, opt
    if kind == "zero2_whole":
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3, split_large_params=False)
        return ShardedDataParallel(model, opt), model, opt
    fsdp = FullyShardedDataParallel(model, auto_wrap_policy=ModuleClassPolicy((nn.Linear,)))
    return fsdp, fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-3)


def _norms(rank: int, world_size: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message="OSS: the heaviest rank")
    out: dict[str, Any] = {}
    ref_model = VocabModel()
    ref = DDP(ref_model)
    vocab_loss(ref, rank, 0).backward()
    out["ddp"] = {n: torch.linalg.vector_norm(p.grad).item() for n, p in ref_model.named_parameters()}
    out["ddp_inf"] = {n: p.grad.abs().max().item() for n, p in ref_model.named_parameters()}
    for kind in ("zero1", "zero2", "zero2_whole", "zero3"):
        net, named, opt = _stage(kind)
        if isinstance(opt, OSS):
            index = {id(p): i for i, p in enumerate(opt.params)}
            out[f"{kind}/split"] = [n for n, p in named.named_parameters() if index[id(p)] in opt.plan.split_params]
        vocab_loss(net, rank, 0).backward()
        out[kind] = {_clean(n): v.item() for n, v in grad_norms(named).items()}
        out[f"{kind}_inf"] = {_clean(n): v.item() for n, v in grad_norms(named, float("inf")).items()}
        opt.step()  # the norms leave the gradients as they were: the step still runs
        if isinstance(net, ShardedDataParallel):
            net.close()
        del net
    del ref
    return out


def test_per_parameter_norms_match_ddp_under_every_stage_at_two_ranks() -> None:
    results = run_ranks(_norms, 2, timeout_s=180)
    assert results[0] == results[1]  # the same dictionary on every rank
    out = results[0]
    assert out["zero2/split"] == ["head.weight"] and out["zero1/split"] == ["head.weight"]
    assert out["zero2_whole/split"] == []
    ddp, ddp_inf = out["ddp"], out["ddp_inf"]
    for kind in ("zero1", "zero2", "zero2_whole", "zero3"):
        got, got_inf = out[kind], out[f"{kind}_inf"]
        assert set(got) == set(ddp) == set(got_inf), (kind, sorted(got))
        for name, want in ddp.items():
            assert got_inf[name] == ddp_inf[name], (kind, name)  # a max is exact in any order
            spread = kind == "zero3" or (kind in ("zero1", "zero2") and name == "head.weight")
            if spread:
                assert abs(got[name] - want) <= spread_bound(name) * want, (kind, name, got[name], want)
            else:
                assert got[name] == want, (kind, name, got[name], want)  # held whole: DDP's norm bit for bit


def _refusals(rank: int, world_size: int) -> dict[str, str]:
    warnings.filterwarnings("ignore", message="OSS: the heaviest rank")
    model = VocabModel()
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)  # the default plan splits the head
    sdp = ShardedDataParallel(model, opt)
    out: dict[str, str] = {}
    vocab_loss(sdp, rank, 0).backward()
    head = model.head.weight
    out["shape"] = str(tuple(head.grad.shape)) if head.grad is not None else "None"
    for what, call in [("norm", lambda: head.grad.norm()), ("sum", lambda: float(head.grad.sum())),
                       ("mul_", lambda: head.grad.mul_(0.5)), ("isfinite", lambda: torch.isfinite(head.grad).all())]:
        try:
            call()
            out[what] = "no error"
        except RuntimeError as exc:
            out[what] = str(exc)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(vocab_loss(sdp, rank, 1)).backward()
    try:
        scaler.unscale_(opt)  # the nanoGPT order: unscale, then clip
        out["unscale"] = "no error"
    except RuntimeError as exc:
        out["unscale"] = str(exc)
    model.zero_grad(set_to_none=False)  # zero_grad still reaches the held gradient
    vocab_loss(sdp, rank, 2).backward()
    opt.step()
    out["stepped"] = "yes"
    sdp.close()
    bf16 = VocabModel(torch.bfloat16)  # fp32 masters: every owned gradient moves to a master
    opt = OSS(bf16.parameters(), optim=torch.optim.AdamW, lr=1e-3, master_dtype=torch.float32)
    sdp = ShardedDataParallel(bf16, opt)
    vocab_loss(sdp, rank, 0).backward()
    held = [p for p in bf16.parameters() if p.grad is not None]
    try:
        torch.stack([p.grad.norm() for p in held])
        out["masters"] = "no error"
    except RuntimeError as exc:
        out["masters"] = str(exc)
    out["masters_norms"] = str(sorted(grad_norms(bf16)))
    sdp.close()
    return out


def test_a_held_gradient_refuses_to_be_read_naming_grad_holder_grad_norms_and_sharded_grad_scaler() -> None:
    for out in run_ranks(_refusals, 2, timeout_s=120):
        assert out["shape"] == "(4096, 32)" and out["stepped"] == "yes", out
        for what in ("norm", "sum", "mul_", "isfinite"):
            assert "grad_holder(param).grad" in out[what] and "shardopt.grad_norms" in out[what], (what, out[what])
        assert "ShardedGradScaler" in out["unscale"] and "GradScaler.unscale_" in out["unscale"], out["unscale"]
        assert "grad_holder(param).grad" in out["masters"], out["masters"]  # not zeros from a placeholder
        assert out["masters_norms"] == str(sorted(n for n, _ in VocabModel().named_parameters())), out["masters_norms"]


def _bad_norm_type(rank: int, world_size: int) -> str:
    try:
        grad_norms(nn.Linear(2, 2), norm_type=0)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_grad_norms_refuses_a_non_positive_norm_type() -> None:
    assert "norm_type > 0" in run_ranks(_bad_norm_type, 1, timeout_s=60)[0]
