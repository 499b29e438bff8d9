"""ShardedDataParallel (ZeRO-2): parity with DDP and a single-process reference under every
usage pattern, memory, bytes on the wire, and error messages."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.memory import heap_bytes
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.placeholders import is_placeholder
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp
from tests.helpers.ddp_arithmetic import add_to_grads, average_in_rank_order, reference_backward
from tests.helpers.sdp import Branchy, rel_diff, tolerance

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def reference_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    world_size: int,
    loss_of: Callable[[nn.Module, int], torch.Tensor],
) -> None:
    """One data-parallel step in one process (see :func:`tests.helpers.data.reference_backward`)."""
    reference_backward(model, world_size, loss_of)
    opt.step()


def _parity_sweep(rank: int, world_size: int) -> dict[str, float]:
    results: dict[str, float] = {}
    zero_modes = ("optimizer", "wrapper", "module")
    for opt_name, (cls, kwargs) in OPTIMIZERS.items():
        for cap in (0, 100, 2**23):
            ref, ddp_model, sharded = seeded_mlp(), seeded_mlp(), seeded_mlp()
            ddp = DDP(ddp_model)
            ddp_opt = cls(ddp_model.parameters(), **kwargs)
            ref_opt = cls(ref.parameters(), **kwargs)
            opt = OSS(sharded.parameters(), optim=cls, **kwargs)
            sdp = ShardedDataParallel(sharded, opt, reduce_buffer_size=cap)
            for step in range(6):
                set_to_none = step % 2 == 0
                where = zero_modes[step % 3]
                {"optimizer": opt, "wrapper": sdp, "module": sharded}[where].zero_grad(set_to_none=set_to_none)
                ddp_opt.zero_grad(set_to_none=set_to_none)
                ref_opt.zero_grad(set_to_none=set_to_none)
                x = rank_batch(rank, step)
                sdp(x).pow(2).mean().backward()
                opt.step()
                ddp(x).pow(2).mean().backward()
                ddp_opt.step()
                reference_step(ref, ref_opt, world_size, lambda m, r, s=step: m(rank_batch(r, s)).pow(2).mean())
            results[f"{opt_name}/cap={cap}/vs_ddp"] = rel_diff(sharded, ddp_model)
            results[f"{opt_name}/cap={cap}/vs_reference"] = rel_diff(sharded, ref)
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity_with_ddp_and_reference_any_zero_grad(world_size: int) -> None:
    results = run_ranks(_parity_sweep, world_size)
    print(f"\nworld_size={world_size} max relative |param diff| after 6 steps:")
    for key in results[0]:
        worst = max(r[key] for r in results)
        print(f"  {key:40s} {worst:.3e}")
        assert worst <= tolerance(world_size), (key, worst)


def _accumulation(rank: int, world_size: int) -> dict[str, float]:
    """Four micro-batches per step, three ways, against DDP and a single-process reference
    doing the same arithmetic: under no_sync each rank sums its micro-batch gradients and the
    sums are averaged once; without no_sync every micro-batch is averaged and added."""
    results = {}
    for mode in ("no_sync", "plain", "manual_reduce"):
        ref, ddp_model, sharded = seeded_mlp(), seeded_mlp(), seeded_mlp()
        ddp = DDP(ddp_model)
        ddp_opt = torch.optim.Adam(ddp_model.parameters(), lr=1e-2)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        opt = OSS(sharded.parameters(), optim=torch.optim.Adam, lr=1e-2)
        sdp = ShardedDataParallel(sharded, opt, reduce_buffer_size=100)
        params = list(ref.parameters())
        for step in range(5):
            opt.zero_grad(set_to_none=step % 2 == 1)
            ddp_opt.zero_grad(set_to_none=step % 2 == 1)
            ref_opt.zero_grad(set_to_none=step % 2 == 1)
            local: list[list[torch.Tensor]] = []
            for micro in range(4):
                x = rank_batch(rank, 10 * step + micro)
                last = micro == 3
                if mode == "plain" or (mode == "no_sync" and last):
                    sdp(x).pow(2).mean().backward()
                else:
                    with sdp.no_sync():
                        sdp(x).pow(2).mean().backward()
                if mode == "plain":
                    ddp(x).pow(2).mean().backward()
                elif last and mode == "no_sync":
                    ddp(x).pow(2).mean().backward()
                else:
                    with ddp.no_sync():
                        ddp(x).pow(2).mean().backward()
                    if mode == "manual_reduce" and last:
                        # DDP has no manual reduce: average the local sums by hand.
                        for p in ddp_model.parameters():
                            torch.distributed.all_reduce(p.grad.mul_(1.0 / world_size))
                grads = [torch.autograd.grad(ref(rank_batch(r, 10 * step + micro)).pow(2).mean(), params)
                         for r in range(world_size)]
                if mode == "plain":
                    add_to_grads(params, average_in_rank_order([list(g) for g in grads]))
                else:
                    local = [list(g) for g in grads] if not local else [
                        [a + b for a, b in zip(acc, g)] for acc, g in zip(local, grads)]
            if mode != "plain":
                add_to_grads(params, average_in_rank_order(local))  # type: ignore[arg-type]
            if mode == "manual_reduce":
                sdp.reduce()
            opt.step()
            ddp_opt.step()
            ref_opt.step()
        results[mode + "/vs_reference"] = rel_diff(sharded, ref)
        results[mode + "/vs_ddp"] = rel_diff(sharded, ddp_model)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_accumulation_with_and_without_no_sync_matches_ddp(world_size: int) -> None:
    results = run_ranks(_accumulation, world_size)
    print(f"\nworld_size={world_size} accumulation: {results[0]}")
    for key in results[0]:
        worst = max(r[key] for r in results)
        # DDP re-reduces the already averaged gradient with each micro-batch ((A + g_r) / N
        # summed), a different rounding of the same sum: 1e-6 relative against DDP there.
        limit = 1e-6 if key == "plain/vs_ddp" else tolerance(world_size)
        assert worst <= limit, (key, worst)


def _unused(rank: int, world_size: int) -> dict[str, Any]:
    """``never`` is never used; ``b`` used on rank 0 only, then on even steps only."""
    results: dict[str, Any] = {}
    for pattern in ("rank0_only", "even_steps", "always"):
        ddp_model, sharded = Branchy(), Branchy()
        ddp = DDP(ddp_model, find_unused_parameters=True)
        ddp_opt = torch.optim.Adam(ddp_model.parameters(), lr=1e-2)
        opt = OSS(sharded.parameters(), optim=torch.optim.Adam, lr=1e-2)
        sdp = ShardedDataParallel(sharded, opt, reduce_buffer_size=40)
        for step in range(6):
            use_b = {"rank0_only": rank == 0, "even_steps": step % 2 == 0, "always": True}[pattern]
            x = rank_batch(rank, step)
            opt.zero_grad()
            ddp_opt.zero_grad()
            sdp(x, use_b).pow(2).mean().backward()
            ddp(x, use_b).pow(2).mean().backward()
            opt.step()
            ddp_opt.step()
        results[pattern] = rel_diff(sharded, ddp_model)
        results[pattern + "/never_grad_is_none"] = sharded.never.weight.grad is None
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_unused_parameters_do_not_hang_and_match_ddp_find_unused(world_size: int) -> None:
    results = run_ranks(_unused, world_size, timeout_s=60)
    print(f"\nworld_size={world_size} unused parameters: {results[0]}")
    for key in ("rank0_only", "even_steps", "always"):
        assert max(r[key] for r in results) <= tolerance(world_size), key
        assert all(r[key + "/never_grad_is_none"] for r in results)


def _memory(rank: int, world_size: int) -> dict[str, Any]:
    model = seeded_mlp(width=64)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
    cap = 500
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=cap)
    sdp(rank_batch(rank, 0)).pow(2).mean().backward()
    # The owner's gradient is in its holder: the parameter, or a split parameter's owned rows.
    held = [(p, opt.grad_holder(p)) for p in model.parameters()]
    # A split parameter's param.grad holds only a placeholder (Note [split gradients behind placeholders]).
    grads_ok = all((p.grad is not None and not is_placeholder(p)) == (h is p) and (h is None or h.grad is not None)
                   for p, h in held)
    # (a split parameter is one entry per block: count distinct parameters)
    multi = [b.spec for b in sdp.reduction_buckets if len({id(p) for p in b.spec.params}) > 1]
    largest_single = max(p.numel() for p in model.parameters())
    return {
        "grads_only_on_owner": grads_ok,
        "buffers_released": all(b.state.name == "EMPTY" and not b.holds_buffers for b in sdp.reduction_buckets),
        "multi_param_buckets_within_cap": all(s.numel - len(s.params) <= cap for s in multi),
        "every_bucket_within_cap_or_single": all(
            s.numel - len(s.params) <= max(cap, largest_single) for s in (b.spec for b in sdp.reduction_buckets)
        ),
        "owned_grad_elems": sum(h.numel() for _, h in held if h is not None),
        "split": len(opt.plan.split_params),
        "all_elems": sum(p.numel() for p in model.parameters()),
    }


def test_after_backward_only_owned_gradients_remain_and_buckets_are_freed() -> None:
    results = run_ranks(_memory, 3)
    for r in results:
        assert r["grads_only_on_owner"] and r["buffers_released"], r
        assert r["multi_param_buckets_within_cap"] and r["every_bucket_within_cap_or_single"], r
    assert sum(r["owned_grad_elems"] for r in results) == results[0]["all_elems"]
    assert results[0]["split"] > 0  # Adam splits the largest layer at 3 ranks: owned rows are counted


def _trainability(rank: int, world_size: int) -> dict[str, Any]:
    ref, sharded = seeded_mlp(), seeded_mlp()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = OSS(sharded.parameters(), optim=torch.optim.Adam, lr=1e-2)
    sdp = ShardedDataParallel(sharded, opt, reduce_buffer_size=64)
    caught: list[str] = []
    for step in range(8):
        if step == 2:  # freeze the first layer mid-training
            for m in (ref, sharded):
                m[0].weight.requires_grad_(False)
        if step == 5:  # and unfreeze it again
            for m in (ref, sharded):
                m[0].weight.requires_grad_(True)
        if step == 4:  # an eval pass in between must change nothing
            sdp.eval()
            with torch.no_grad():
                sdp(rank_batch(rank, 99))
            sdp.train()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.zero_grad()
            ref_opt.zero_grad()
            sdp(rank_batch(rank, step)).pow(2).mean().backward()
            opt.step()
        caught += [str(x.message) for x in w if "trainable" in str(x.message)]
        reference_step(ref, ref_opt, world_size, lambda m, r, s=step: m(rank_batch(r, s)).pow(2).mean())
    return {"diff": rel_diff(sharded, ref), "warnings": caught}


def test_freeze_unfreeze_and_eval_switch_match_reference_and_warn_once_per_change() -> None:
    results = run_ranks(_trainability, 2)
    for r in results:
        assert r["diff"] == 0.0, r
        assert len(r["warnings"]) == 2, r["warnings"]  # one per change: freeze, unfreeze


def _low_precision(rank: int, world_size: int) -> dict[str, float]:
    """reduce_fp16 / reduce_dtype=bf16 against a reference that reduces in the same dtype and
    order: each rank's grad * (1/N) rounded to the wire dtype, summed in fp32 in rank order."""
    results = {}
    for wire, kwargs in ((torch.float16, {"reduce_fp16": True}), (torch.bfloat16, {"reduce_dtype": torch.bfloat16})):
        ref, sharded = seeded_mlp(), seeded_mlp()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        opt = OSS(sharded.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
        sdp = ShardedDataParallel(sharded, opt, reduce_buffer_size=100, **kwargs)
        for step in range(5):
            opt.zero_grad()
            sdp(rank_batch(rank, step)).pow(2).mean().backward()
            opt.step()
            params = list(ref.parameters())
            total: list[torch.Tensor] = []
            for r in range(world_size):
                grads = torch.autograd.grad(ref(rank_batch(r, step)).pow(2).mean(), params)
                wired = [(g * (1.0 / world_size)).to(wire).float() for g in grads]
                total = wired if not total else [t + w for t, w in zip(total, wired)]
            for p, g in zip(params, total):
                p.grad = g
            ref_opt.step()
        results[str(wire)] = rel_diff(sharded, ref)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_in_fp16_and_bf16_matches_same_dtype_reference(world_size: int) -> None:
    results = run_ranks(_low_precision, world_size)
    for key in results[0]:
        assert max(r[key] for r in results) <= tolerance(world_size), (key, results)


def _buffers_and_startup(rank: int, world_size: int) -> dict[str, float]:
    torch.manual_seed(rank)  # different weights per rank: startup sync must fix that
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    torch.manual_seed(0)
    ddp_model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    torch.manual_seed(0)
    expected = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    # rank 0's initial weights are seed-0 weights only on rank 0; broadcast them to compare
    for p, q in zip(model.parameters(), expected.parameters()):
        q.data.copy_(p.data)
        torch.distributed.broadcast(q.data, 0)
    ddp_model.load_state_dict(expected.state_dict())
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    startup = max_abs_diff(model.parameters(), expected.parameters())
    ddp = DDP(ddp_model)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    for step in range(4):
        x = rank_batch(rank, step)
        for m, o in ((sdp, opt), (ddp, ddp_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    return {
        "startup": startup,
        "params": max_abs_diff(model.parameters(), ddp_model.parameters()),
        "buffers": max_abs_diff(model.buffers(), ddp_model.buffers()),
    }


def test_startup_sync_and_buffer_broadcast_match_ddp() -> None:
    for r in run_ranks(_buffers_and_startup, 2):
        assert r == {"startup": 0.0, "params": 0.0, "buffers": 0.0}, r


def _two_optimizers(rank: int, world_size: int) -> float:
    ddp_model, sharded = seeded_mlp(), seeded_mlp()
    ddp = DDP(ddp_model)
    ddp_opts = [torch.optim.SGD(ddp_model[0].parameters(), lr=0.1),
                torch.optim.Adam(list(ddp_model[2].parameters()) + list(ddp_model[4].parameters()), lr=1e-2)]
    opts = [OSS(sharded[0].parameters(), optim=torch.optim.SGD, lr=0.1),
            OSS(list(sharded[2].parameters()) + list(sharded[4].parameters()), optim=torch.optim.Adam, lr=1e-2)]
    sdp = ShardedDataParallel(sharded, opts, reduce_buffer_size=64)
    for step in range(5):
        x = rank_batch(rank, step)
        for o in opts + ddp_opts:
            o.zero_grad()
        sdp(x).pow(2).mean().backward()
        ddp(x).pow(2).mean().backward()
        for o in opts + ddp_opts:
            o.step()
    return rel_diff(sharded, ddp_model)


def test_several_sharded_optimizers_match_ddp() -> None:
    assert max(run_ranks(_two_optimizers, 3)) <= tolerance(3)


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _bytes(rank: int, world_size: int) -> dict[str, int]:
    torch.manual_seed(0)
    make = lambda: nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # noqa: E731
    ddp_model, sharded = make(), make()
    ddp = DDP(ddp_model)
    ddp_opt = torch.optim.Adam(ddp_model.parameters(), lr=1e-3)
    opt = OSS(sharded.parameters(), optim=torch.optim.Adam, lr=1e-3)
    sdp = ShardedDataParallel(sharded, opt)
    sent = {}
    for name, model, o in (("ddp", ddp, ddp_opt), ("zero2", sdp, opt)):
        for step in range(3):
            torch.distributed.barrier()
            before = _wchar()
            o.zero_grad()
            model(torch.randn(4, 256)).sum().backward()
            o.step()
            sent[name] = _wchar() - before
    sent["param_bytes"] = sum(p.numel() * 4 for p in sharded.parameters())
    return sent


@pytest.mark.parametrize("world_size", [2, 4])
def test_bytes_sent_per_step_do_not_exceed_ddp(world_size: int) -> None:
    results = run_ranks(_bytes, world_size)
    ideal = 2 * (world_size - 1) / world_size * results[0]["param_bytes"]
    for r in results:
        print(f"\nworld_size={world_size} bytes/step: ddp={r['ddp']} zero2={r['zero2']} "
              f"ratio={r['zero2'] / r['ddp']:.3f} ideal={ideal:.0f}")
        assert r["zero2"] <= 1.02 * r["ddp"], r


def _errors(rank: int, world_size: int) -> list[str]:
    messages = []
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    cases: list[tuple[type[Exception], Callable[[], Any]]] = [
        (TypeError, lambda: ShardedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))),  # type: ignore[arg-type]
        (ValueError, lambda: ShardedDataParallel(model, opt, reduce_buffer_size=-1)),
        (ValueError, lambda: ShardedDataParallel(model, opt, reduce_dtype=torch.int32)),
        (ValueError, lambda: ShardedDataParallel(model, OSS(model[0].parameters(), lr=0.1))),
        (ValueError, lambda: ShardedDataParallel(model, [opt, OSS(model[0].parameters(), lr=0.1)])),
    ]
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    cases.append((ValueError, lambda: ShardedDataParallel(mixed, opt)))
    for exc, call in cases:
        with pytest.raises(exc) as info:
            call()
        messages.append(str(info.value))
    sdp = ShardedDataParallel(model, opt)
    with pytest.raises(RuntimeError) as info:
        sdp.reduce()
    messages.append(str(info.value))
    return messages


def test_user_errors_say_what_to_do() -> None:
    messages = run_ranks(_errors, 2)[0]
    expected = [
        "sharded_optimizer must be a shardopt.optim.OSS",
        "reduce_buffer_size must be >= 0 elements",
        "reduce_dtype must be a floating dtype",
        "are not in any sharded optimizer",
        "is in two of the sharded optimizers",
        "several device types",
        "nothing to reduce",
    ]
    for fragment, message in zip(expected, messages, strict=True):
        assert fragment in message, (fragment, message)


def _mismatched_backward(rank: int, world_size: int) -> None:
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    sdp(rank_batch(rank, 0)).sum().backward()
    if rank == 1:  # a backward the other rank never runs: its reduction has no partner
        sdp(rank_batch(rank, 1)).sum().backward()


def test_backward_on_one_rank_only_fails_with_an_error_instead_of_hanging() -> None:
    from shardopt.testing import RankFailure

    with pytest.raises(RankFailure) as info:
        run_ranks(_mismatched_backward, 2, timeout_s=5)
    assert info.value.rank == 1


def _surface(rank: int, world_size: int) -> dict[str, Any]:
    model = Branchy()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet = ShardedDataParallel(model, opt, auto_refresh_trainable=False, warn_on_trainable_params_changed=False)
        model.never.requires_grad_(False)
        quiet(rank_batch(rank, 0))
        out["quiet_warnings"] = len(caught)
        model.never.requires_grad_(True)
        loud = ShardedDataParallel(model, opt, auto_refresh_trainable=False)
        model.never.requires_grad_(False)
        loud(rank_batch(rank, 0))
        loud(rank_batch(rank, 1))
        out["loud_warnings"] = [str(w.message) for w in caught]
    out["forwards_attribute"] = loud.trunk is model.trunk
    pending = loud.sync_buffers(blocking=False)
    for p in pending:
        p.wait()
    out["sync_buffers_pending"] = isinstance(pending, list)
    out["to_returns_self"] = loud.to("cpu") is loud
    return out


def test_wrapper_surface_and_trainability_warning_switches() -> None:
    for r in run_ranks(_surface, 2):
        assert r["quiet_warnings"] == 0, r
        assert len(r["loud_warnings"]) == 1 and "call refresh_trainable()" in r["loud_warnings"][0], r
        assert r["forwards_attribute"] and r["sync_buffers_pending"] and r["to_returns_self"], r


class Checkpointed(nn.Module):
    """Two blocks run under activation checkpointing (reentrant or not), then a head."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(8, 3)
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        if self.use_reentrant:
            x = x.requires_grad_()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


def _checkpointing(rank: int, world_size: int) -> dict[str, float]:
    results = {}
    for reentrant in (False, True):
        ddp_model, sharded = Checkpointed(reentrant), Checkpointed(reentrant)
        ddp = DDP(ddp_model)
        ddp_opt = torch.optim.Adam(ddp_model.parameters(), lr=1e-2)
        opt = OSS(sharded.parameters(), optim=torch.optim.Adam, lr=1e-2)
        sdp = ShardedDataParallel(sharded, opt, reduce_buffer_size=20)
        for step in range(5):
            x = rank_batch(rank, step)
            for m, o in ((sdp, opt), (ddp, ddp_opt)):
                o.zero_grad()
                m(x.clone()).pow(2).mean().backward()
                o.step()
        results[f"reentrant={reentrant}"] = rel_diff(sharded, ddp_model)
    return results


def test_activation_checkpointing_inside_the_wrapper_matches_ddp() -> None:
    # A reentrant checkpoint runs a nested backward whose end fires the wrapper's flush
    # early; a parameter is still reduced exactly once (the "used" flags make the partial
    # flush harmless), so the result must equal DDP's.
    for r in run_ranks(_checkpointing, 2):
        assert r == {"reentrant=False": 0.0, "reentrant=True": 0.0}, r


def _cuda_parity(rank: int, world_size: int) -> float:
    device = torch.device("cuda", 0)  # several gloo ranks can share one GPU
    ddp_model, sharded = seeded_mlp().to(device), seeded_mlp().to(device)
    ddp = DDP(ddp_model)
    ddp_opt = torch.optim.Adam(ddp_model.parameters(), lr=1e-2, foreach=False)
    opt = OSS(sharded.parameters(), optim=torch.optim.Adam, lr=1e-2, foreach=False)
    sdp = ShardedDataParallel(sharded, opt, reduce_buffer_size=100)
    for step in range(5):
        x = rank_batch(rank, step).to(device)
        for m, o in ((sdp, opt), (ddp, ddp_opt)):
            o.zero_grad(set_to_none=step % 2 == 0)
            m(x).pow(2).mean().backward()
            o.step()
    return rel_diff(sharded, ddp_model)


@pytest.mark.gpu
def test_cuda_tensors_on_gloo_match_ddp() -> None:
    assert max(run_ranks(_cuda_parity, 2, backend="gloo")) == 0.0


def _scratch_released(rank: int, world_size: int) -> list[float]:
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])  # 48 MiB of fp32 params
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.01, momentum=0.9)
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=2**20)
    growth = []
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        sdp(torch.randn(2, 1024)).sum().backward()
        after_backward = heap_bytes()
        opt.step()
        assert after_backward is not None
        growth.append((heap_bytes() - after_backward) / 2**20)  # type: ignore[operator]
    return growth[1:]  # step 0 creates the momentum buffers


@pytest.mark.skipif(heap_bytes() is None, reason="heap readings need glibc's mallinfo2")
def test_no_scratch_buffer_outlives_the_step() -> None:
    # Gradient buckets and gathered parameter chunks (up to 16 MiB) are freed when their
    # transfer completes (Note [release scratch buffers] in shardopt.comm); the heap after step must not grow.
    for growth in run_ranks(_scratch_released, 2):
        assert max(growth) < 0.5, growth
