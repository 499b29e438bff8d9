"""Hybrid ZeRO-2: ShardedDataParallel over a layout of R shard groups of S ranks (Note
[hybrid reduction] in shardopt/nn/data_parallel/replicas.py).

Exactness: each rank's gradient is scaled by 1/N and summed in rank order inside its shard
group, then the group sums are all-reduced across replicas. With 2 replicas that last sum
has two terms, which commute, so a one-process reference adding ``(g0/N + g1/N) + (g2/N +
g3/N)`` (tests/helpers/hybrid.py) is matched bit for bit (atol = rtol = 0), and so is the
2-groups-of-3 layout. DDP's gloo ring adds the N terms in its own order, so against DDP the
bound is tests/helpers/sdp.py's ``tolerance`` (1e-6 relative beyond 2 ranks), as for flat
ZeRO-2 at 3-4 ranks; so is 3 groups of 2, whose 3-term replicate sum is in gloo's order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.hybrid import HybridLayout
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.optim.grad_scaler import ShardedGradScaler
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp
from tests.helpers.hybrid import bytes_by_group, group_then_replicas, hybrid_reference_backward
from tests.helpers.masters import MasterReference, low_mlp
from tests.helpers.masters import loss_of as masters_loss
from tests.helpers.sdp import Branchy, VocabModel, rel_diff, tolerance, vocab_loss

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

STEPS = 5
CLIP = 0.05
ADAM = {"lr": 1e-2}


def _mlp_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    return model(rank_batch(rank, step)).pow(2).mean()


def _branchy_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    # Head b is used by the last rank only: in the other shard groups its owner gets its
    # gradient only through the replicate all-reduce (the "used" flags travel with it).
    return model(rank_batch(rank, step), use_b=rank == dist.get_world_size() - 1).pow(2).mean()


def _vocab_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    return vocab_loss(model, rank, step)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module, int, int], torch.Tensor], bool]] = {
    "mlp": (seeded_mlp, _mlp_loss, False),
    "branchy": (Branchy, _branchy_loss, False),
    "vocab_split": (VocabModel, _vocab_loss, True),
}


def _layout_kwargs(form: str, shard_size: int, rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(OSS keywords, ShardedDataParallel keywords) naming the layout in ``form``."""
    if form == "shard_size":
        return {"shard_size": shard_size}, {}
    if form == "device_mesh":
        mesh = init_device_mesh("cpu", (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))
        return {"device_mesh": mesh}, {"device_mesh": mesh}
    shard = [dist.new_group(list(range(g, g + shard_size))) for g in range(0, world_size, shard_size)]
    replicate = [dist.new_group(list(range(p, world_size, shard_size))) for p in range(shard_size)]
    pair = (shard[rank // shard_size], replicate[rank % shard_size])
    return {"group": pair}, {"process_group": pair}


def _train(case: str, form: str, shard_size: int, rank: int, world_size: int) -> dict[str, Any]:
    """Hybrid ZeRO-2 + Adam next to DDP + Adam and the one-process group-then-replicas
    reference, clipping on odd steps; the largest differences."""
    build, loss_of, split = CASES[case]
    model, ddp_model, ref = build(), build(), build()
    oss_kwargs, sdp_kwargs = _layout_kwargs(form, shard_size, rank, world_size)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, split_large_params=split, **oss_kwargs, **ADAM)
    sdp = ShardedDataParallel(model, opt, **sdp_kwargs)
    ddp = DDP(ddp_model, find_unused_parameters=case == "branchy")
    ddp_opt, ref_opt = torch.optim.Adam(ddp_model.parameters(), **ADAM), torch.optim.Adam(ref.parameters(), **ADAM)
    norm_diff = 0.0
    for step in range(STEPS):
        set_to_none = step % 2 == 0
        for o in (opt, ddp_opt, ref_opt):
            o.zero_grad(set_to_none=set_to_none)
        loss_of(sdp, rank, step).backward()
        loss_of(ddp, rank, step).backward()
        hybrid_reference_backward(ref, world_size, shard_size, functools.partial(loss_of, step=step))
        if step % 2 == 1 and not split:  # a split parameter's norm is within rounding of torch's, not
            # its bits (Note [sharded norm in torch's order] in shardopt/optim/grad_norm.py)
            got = opt.clip_grad_norm(CLIP)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), CLIP)
            norm_diff = max(norm_diff, abs(float(got) - float(want)))
        for o in (opt, ddp_opt, ref_opt):
            o.step()
    del ddp  # before the group goes (torch 2.13 + gloo)
    sdp.close()
    layout = opt.layout
    assert isinstance(layout, HybridLayout)
    return {"vs_reference": max_abs_diff(model.parameters(), ref.parameters()), "vs_ddp": rel_diff(model, ddp_model),
            "norm_diff": norm_diff, "splits": len(opt.plan.split_params), "plan_size": opt.world_size,
            "shard_ranks": layout.shard_ranks}


def _parity_4(rank: int, world_size: int) -> dict[str, Any]:
    out = {f"{case}/{form}": _train(case, form, 2, rank, world_size)
           for case in ("mlp", "branchy") for form in ("shard_size", "device_mesh", "process_groups")}
    out["vocab_split/shard_size"] = _train("vocab_split", "shard_size", 2, rank, world_size)
    out["bf16_masters"] = _masters(rank, world_size)
    return out


def test_hybrid_zero2_at_2_groups_of_2_equals_the_group_then_replica_sum_bit_for_bit_and_ddp_within_bounds() -> None:
    results = run_ranks(_parity_4, 4, timeout_s=120)
    print("\nhybrid ZeRO-2, 2 groups of 2, Adam, 5 steps (clip on odd steps): max over ranks")
    print(f"  bf16 parameters with fp32 masters: vs reference {max(r.pop('bf16_masters') for r in results)}")
    for key in results[0]:
        rows = [r[key] for r in results]
        print(f"  {key:28s} vs reference {max(r['vs_reference'] for r in rows)}  vs DDP (relative) "
              f"{max(r['vs_ddp'] for r in rows):.3g}  clip norm {max(r['norm_diff'] for r in rows)}  "
              f"split params {rows[0]['splits']}")
        for rank, r in enumerate(rows):
            assert r["vs_reference"] == 0.0 and r["norm_diff"] == 0.0, (key, rank, r)
            assert r["vs_ddp"] <= tolerance(4), (key, rank, r)  # DDP's ring adds the 4 terms in its own order
            assert r["plan_size"] == 2 and r["shard_ranks"] == ((0, 1) if rank < 2 else (2, 3)), (key, rank, r)
    assert results[0]["vocab_split/shard_size"]["splits"] > 0  # the head really is split under the layout


def _parity_6(rank: int, world_size: int) -> dict[str, Any]:
    return {f"S={s}": _train(case, "shard_size", s, rank, world_size) for s in (3, 2) for case in ("mlp",)}


def test_hybrid_zero2_at_6_ranks_in_2_groups_of_3_and_3_groups_of_2_is_within_the_ddp_bound() -> None:
    results = run_ranks(_parity_6, 6, timeout_s=120)
    print("\nhybrid ZeRO-2 at 6 ranks, Adam, 5 steps: max over ranks")
    for key in results[0]:
        rows = [r[key] for r in results]
        print(f"  {key}: vs reference {max(r['vs_reference'] for r in rows)}  vs DDP (relative) "
              f"{max(r['vs_ddp'] for r in rows):.3g}")
        for r in rows:
            assert r["vs_ddp"] <= tolerance(6), (key, r)
    # 2 groups of 3: the replicate sum has two terms, so the reference's order is the only one.
    assert all(r["S=3"]["vs_reference"] == 0.0 and r["S=3"]["norm_diff"] == 0.0 for r in results), results


MICRO = 3


def _accumulate(mode: str, rank: int, world_size: int) -> float:
    """3 steps of 3 micro-steps in ``mode``, next to DDP accumulating the same way
    (``no_replicate_sync`` next to DDP's no_sync: the same sum, in another order)."""
    model, ddp_model = seeded_mlp(), seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, shard_size=2, **ADAM)
    sdp = ShardedDataParallel(model, opt)
    ddp = DDP(ddp_model)
    ddp_opt = torch.optim.Adam(ddp_model.parameters(), **ADAM)
    for step in range(3):
        opt.zero_grad()
        ddp_opt.zero_grad()
        for micro in range(MICRO):
            last = micro == MICRO - 1
            batch = 10 * step + micro
            context: AbstractContextManager[None]
            if mode == "default":
                context = nullcontext()
            elif mode == "no_sync":
                context = nullcontext() if last else sdp.no_sync()
            elif mode == "no_replicate_sync":
                context = nullcontext() if last else sdp.no_replicate_sync()
            else:  # the whole window inside no_replicate_sync, finished by reduce()
                context = sdp.no_replicate_sync()
            with context:
                _mlp_loss(sdp, rank, batch).backward()
            if mode == "no_replicate_sync+reduce" and last:
                sdp.reduce()
            with nullcontext() if (last or mode == "default") else ddp.no_sync():
                _mlp_loss(ddp, rank, batch).backward()
        opt.step()
        ddp_opt.step()
    del ddp
    sdp.close()
    return rel_diff(model, ddp_model)


def _scaler(deferred: bool, rank: int) -> dict[str, Any]:
    """Two micro-steps a step (the first under ``no_replicate_sync`` when ``deferred``), inf on
    the last rank's first micro-step of step 1, in one replica only: every rank skips that step."""
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, shard_size=2, **ADAM)
    sdp = ShardedDataParallel(model, opt)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8)
    skipped, scales = [], []
    for step in range(3):
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        poison = float("inf") if rank == dist.get_world_size() - 1 and step == 1 else 1.0
        with sdp.no_replicate_sync() if deferred else nullcontext():
            scaler.scale(_mlp_loss(sdp, rank, step) * poison).backward()
        scaler.scale(_mlp_loss(sdp, rank, 100 + step)).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)))
        scales.append(float(scaler.get_scale()))
    sdp.close()
    return {"skipped": skipped, "scales": scales}


def _accumulation_and_scaler(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {mode: _accumulate(mode, rank, world_size)
                           for mode in ("default", "no_sync", "no_replicate_sync", "no_replicate_sync+reduce")}
    out["scaler"] = _scaler(False, rank)
    out["scaler_deferred"] = _scaler(True, rank)
    return out


def test_hybrid_accumulation_modes_equal_ddp_accumulating_the_same_way_and_an_inf_on_one_rank_skips_everywhere() -> None:
    results = run_ranks(_accumulation_and_scaler, 4, timeout_s=120)
    print(f"\nhybrid ZeRO-2 accumulation (2 groups of 2, 3 steps of {MICRO} micro-steps), max relative diff vs DDP:")
    for mode in ("default", "no_sync", "no_replicate_sync", "no_replicate_sync+reduce"):
        print(f"  {mode:26s} {max(r[mode] for r in results):.3g}")
        assert all(r[mode] <= tolerance(4) for r in results), (mode, [r[mode] for r in results])
    for rank, r in enumerate(results):
        for key in ("scaler", "scaler_deferred"):
            assert r[key]["skipped"] == [False, True, False], (key, rank, r[key])
            assert r[key]["scales"] == [256.0, 128.0, 128.0], (key, rank, r[key])


def _masters(rank: int, world_size: int) -> float:
    """bf16 parameters with fp32 masters under 2 groups of 2 against a one-process reference
    that widens each bf16 gradient, scales it by 1/N, sums group then replicas in fp32 and
    steps fp32 masters: the largest |parameter difference|."""
    model = low_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, shard_size=2, master_dtype=torch.float32, **ADAM)
    sdp = ShardedDataParallel(model, opt)
    ref = MasterReference(low_mlp(), torch.optim.Adam, **ADAM)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=step % 2 == 0)
        masters_loss(sdp, rank, step).backward()
        opt.step()
        per_rank = [[g.float() for g in ref.local_grads(functools.partial(masters_loss, rank=r, step=step))]
                    for r in range(world_size)]
        grads = group_then_replicas(per_rank, 2)
        ref.add_master_grads([g for g in grads if g is not None])
        ref.step()
    sdp.close()
    return max_abs_diff(model.parameters(), ref.model.parameters())


def _bad_inputs(rank: int, world_size: int) -> dict[str, str]:
    """Each bad input's error on this rank (``"no error"`` if none)."""
    def attempt(build: Callable[[], object]) -> str:
        try:
            built = build()
        except (ValueError, RuntimeError, TypeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        if isinstance(built, ShardedDataParallel):
            built.close()
        return "no error"

    def flat_sdp_no_replicate_sync() -> None:
        model = seeded_mlp()
        sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
        try:
            with sdp.no_replicate_sync():
                pass
        finally:
            sdp.close()

    def two_layouts() -> ShardedDataParallel:
        model = seeded_mlp()
        params = list(model.parameters())
        return ShardedDataParallel(model, [OSS(params[:2], lr=0.1, shard_size=2), OSS(params[2:], lr=0.1)])

    def freeze_inside_a_deferred_window() -> None:
        model = seeded_mlp()
        sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1, shard_size=2),
                                  warn_on_trainable_params_changed=False)
        try:
            with sdp.no_replicate_sync():
                _mlp_loss(sdp, rank, 0).backward()
            model[0].weight.requires_grad_(False)
            _mlp_loss(sdp, rank, 1).backward()  # the forward re-plans: refused, nothing lost
        finally:
            sdp.close()

    return {
        "freeze_in_window": attempt(freeze_inside_a_deferred_window),
        "indivisible": attempt(lambda: OSS(seeded_mlp().parameters(), lr=0.1, shard_size=3)),
        "ranks_disagree": attempt(lambda: OSS(seeded_mlp().parameters(), lr=0.1, shard_size=2 if rank < 2 else 4)),
        "one_rank_hybrid": attempt(lambda: OSS(seeded_mlp().parameters(), lr=0.1, shard_size=2 if rank == 0 else None)),
        "sdp_other_layout": attempt(lambda: (m := seeded_mlp(), ShardedDataParallel(
            m, OSS(m.parameters(), lr=0.1, shard_size=2), shard_size=4))[1]),
        "sdp_layout_flat_oss": attempt(lambda: (m := seeded_mlp(), ShardedDataParallel(
            m, OSS(m.parameters(), lr=0.1), shard_size=2))[1]),
        "two_layouts": attempt(two_layouts),
        "no_replicate_sync_flat": attempt(flat_sdp_no_replicate_sync),
        "same_layout_given_twice": attempt(lambda: (m := seeded_mlp(), ShardedDataParallel(
            m, OSS(m.parameters(), lr=0.1, shard_size=2), shard_size=2))[1]),
    }


EXPECTED_ERRORS = {
    "freeze_in_window": "RuntimeError: [rank {rank}] refresh_trainable() (or freezing/unfreezing parameters) inside "
                        "a no_replicate_sync() window",
    "indivisible": "ValueError: shard_size must divide the world size 4, got shard_size=3; use one of [1, 2, 4]",
    "ranks_disagree": "ValueError: the hybrid layout was built differently on different ranks: shard_size is 2 on "
                      "rank 0 but 4 on rank 2",
    "one_rank_hybrid": "ValueError: the hybrid layout was built differently on different ranks: given is "
                       "('shard_size',) on rank 0 but () on rank 1",
    "sdp_other_layout": "ShardedDataParallel was given shard_size naming [[0, 1, 2, 3]], but its OSS has shard "
                        "groups [[0, 1], [2, 3]]",
    "sdp_layout_flat_oss": "ShardedDataParallel was given shard_size naming [[0, 1], [2, 3]], but its OSS is flat",
    "two_layouts": "ValueError: the sharded optimizers have different hybrid layouts",
    "no_replicate_sync_flat": "no_replicate_sync() needs a hybrid layout, but this ShardedDataParallel is flat",
    "same_layout_given_twice": "no error",
}


def test_bad_hybrid_inputs_raise_a_clear_error_on_every_rank_and_nothing_hangs() -> None:
    results = run_ranks(_bad_inputs, 4, timeout_s=90)
    for case, expected in EXPECTED_ERRORS.items():
        for rank, r in enumerate(results):
            assert expected.format(rank=rank % 2) in r[case], (case, rank, r[case])  # [rank r]: r in the shard group


def _model_of_equal_layers() -> nn.Module:
    """8 fp32 128x128 matrices (64 KiB each): owned evenly at 2 and 4 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(128, 128, bias=False) for _ in range(8)])


def _bytes(rank: int, world_size: int) -> dict[str, Any]:
    """Bytes this rank sends per process group: one flat ZeRO-2 step, one hybrid step, and
    windows of 3 micro-steps in the default and the deferred mode."""
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}
    for name, kwargs in (("flat", {}), ("hybrid", {"shard_size": 2})):
        model = _model_of_equal_layers()
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, split_large_params=False, **kwargs)
        sdp = ShardedDataParallel(model, opt)
        with bytes_by_group() as sent:
            sdp(x).pow(2).mean().backward()
            opt.step()
        out[name] = dict(sent)
        if opt.layout is not None:
            out["replicate_ranks"], out["shard_ranks"] = opt.layout.replicate_ranks, opt.layout.shard_ranks
            for mode in ("default", "deferred"):
                per_micro = []
                for micro in range(3):
                    deferred = mode == "deferred" and micro < 2
                    with bytes_by_group() as sent, sdp.no_replicate_sync() if deferred else nullcontext():
                        sdp(x).pow(2).mean().backward()
                    per_micro.append(sent.get(opt.layout.replicate_ranks, 0.0))
                opt.zero_grad()
                out[mode] = per_micro
        sdp.close()
    return out


def test_replicate_bytes_per_step_are_at_most_1_over_s_of_flat_zero2s_and_deferred_windows_send_them_once() -> None:
    results = run_ranks(_bytes, 4, timeout_s=90)
    grads = 8 * 128 * 128 * 4
    print(f"\nbytes sent per rank per step (model gradient {grads} B), by process group:")
    for rank, r in enumerate(results):
        flat_total = sum(r["flat"].values())
        replicate = r["hybrid"][r["replicate_ranks"]]
        print(f"  rank {rank}: flat ZeRO-2 {flat_total:.0f} (world); hybrid: shard group {list(r['shard_ranks'])} "
              f"{r['hybrid'][r['shard_ranks']]:.0f}, replicate group {list(r['replicate_ranks'])} {replicate:.0f} "
              f"({replicate / flat_total:.3f} of flat); per micro-step replicate: default {r['default']}, "
              f"deferred {r['deferred']}")
        assert set(r["hybrid"]) == {r["shard_ranks"], r["replicate_ranks"]}, r["hybrid"]
        assert replicate <= flat_total / 2, (rank, replicate, flat_total)  # S = 2
        # The replicate stage all-reduces the owner's half of the gradient (and one flag per
        # owned matrix): a 2-rank ring sends it once.
        assert grads / 2 <= replicate <= grads / 2 + 64, (rank, replicate)
        assert r["default"] == [replicate] * 3, (rank, r["default"])
        assert r["deferred"] == [0.0, 0.0, replicate], (rank, r["deferred"])


def _step_in_open_window(rank: int, world_size: int) -> dict[str, str]:
    """A step inside an unfinished no_replicate_sync window is refused on every rank, before any
    collective; after the window is finished the same step goes through."""
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, shard_size=2, **ADAM)
    sdp = ShardedDataParallel(model, opt)
    with sdp.no_replicate_sync():
        _mlp_loss(sdp, rank, 0).backward()
    try:
        opt.step()
        refused = "stepped"
    except RuntimeError as exc:
        refused = str(exc)
    sdp.reduce()  # finishes the window: the all-reduce across replicas runs once
    opt.step()
    sdp.close()
    return {"refused": refused}


def test_a_step_inside_an_unfinished_no_replicate_sync_window_is_refused_on_every_rank() -> None:
    for rank, out in enumerate(run_ranks(_step_in_open_window, 4, timeout_s=60)):
        assert out["refused"].startswith(f"[rank {rank % 2}] OSS.step() inside an unfinished no_replicate_sync() window"), out
        assert "finish the window first" in out["refused"], out
