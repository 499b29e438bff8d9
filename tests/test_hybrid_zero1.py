"""Hybrid ZeRO-1 with no new mechanism: OSS planned over the shard group, under DDP over the
whole world, equals DDP + the plain optimizer bit for bit, its state consolidates on the
shard group into the full optimizer state, and that state resumes training bit for bit in a
new hybrid OSS or in a flat one over the whole world.

Why exact: DDP all-reduces every gradient over the world, so every rank holds the same
averaged gradient as the DDP reference (same buckets, same ring). OSS then lets each of the S
ranks of a shard group step its 1/S of the parameters with the same elementwise Adam update
and gathers the result inside the group; the R groups compute the same step on the same
numbers. Nothing is summed in another order, so atol = rtol = 0. The one exception is the
clip norm: the default plan splits seeded_mlp()'s 32 x 16 weight across the shard group, and a
split parameter's norm is the norm of its blocks' norms, torch's within its summation error
only; so the DDP reference clips by OSS's total (Note [fed clip norms] in tests/helpers/clip.py)
and the totals are compared with torch's within total_norm_rtol.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.hybrid import HybridLayout, resolve_layout
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.clip import clip_with_fed_norm, norms_within
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

STEPS = 7
CLIP = 0.05
NUMEL = 820  # seeded_mlp()'s parameters


def _state_diff(got: dict[str, Any], want: dict[str, Any]) -> float:
    """Largest |difference| over every tensor of two ``torch.optim`` state dicts (inf: other keys)."""
    if got["state"].keys() != want["state"].keys():
        return float("inf")
    worst = 0.0
    for index, entry in want["state"].items():
        if entry.keys() != got["state"][index].keys():
            return float("inf")
        for key, value in entry.items():
            worst = max(worst, max_abs_diff([got["state"][index][key]], [value]))
    return worst


def _train(layout: HybridLayout, rank: int) -> dict[str, Any]:
    ref, hybrid = seeded_mlp(), seeded_mlp()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = OSS(hybrid.parameters(), optim=torch.optim.Adam, group=layout.shard_group, lr=1e-2)
    ddp_ref, ddp_hybrid = DDP(ref), DDP(hybrid)
    norms: list[tuple[float, float]] = []  # (torch's, OSS's) total norm of each clip
    for step in range(STEPS):
        set_to_none = step % 2 == 0
        for o in (ref_opt, opt):
            o.zero_grad(set_to_none=set_to_none)
        x = rank_batch(rank, step)
        ddp_ref(x).pow(2).mean().backward()
        ddp_hybrid(x).pow(2).mean().backward()
        if step % 2 == 1:  # clip on odd steps (below the gradient norm, so it scales)
            total = opt.clip_grad_norm(CLIP)
            want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters() if p.grad is not None])
            clip_with_fed_norm(ref.parameters(), CLIP, total)
            norms.append((float(want), float(total)))
        ref_opt.step()
        opt.step()
    owned = [(b.param, b.row_start, b.row_stop) for b in opt.plan.blocks_of_rank(opt.rank)]  # split or whole
    names: dict[torch.Tensor, str] = {p: n for n, p in hybrid.named_parameters()}
    split = [names[opt.params[i]] for i in opt.plan.split_params]
    opt.consolidate_state_dict(recipient_rank=0)
    on_recipient = _state_diff(opt.state_dict(), ref_opt.state_dict()) if layout.shard_rank == 0 else None
    full = opt.state_dict(all_ranks=True)
    everywhere = _state_diff(full, ref_opt.state_dict())
    del ddp_ref, ddp_hybrid  # freed here, before run_ranks destroys the group (torch 2.13 + gloo can block)
    resumed = {where: _resume(hybrid, full, group, ref, ref_opt, rank)
               for where, group in (("hybrid", layout.shard_group), ("flat", None))}
    return {"param_diff": max_abs_diff(hybrid.parameters(), ref.parameters()), "owned": owned,
            "norms": norms, "split": split,
            "plan_size": opt.world_size, "num_params": len(opt.params),
            "recipient_state_diff": on_recipient, "all_ranks_state_diff": everywhere,
            "resumed_diff": resumed}


def _resume(model: nn.Module, state: dict[str, Any], group: dist.ProcessGroup | None, ref: nn.Module,
            ref_opt: torch.optim.Optimizer, rank: int) -> float:
    """Load the consolidated state into a new OSS over ``group`` (the shard group, or the whole
    world: ZeRO-1 without replicas) and a copy of the model; after 2 more steps next to a
    resumed DDP + Adam, the largest |parameter difference|."""
    models = [seeded_mlp(), seeded_mlp()]
    models[0].load_state_dict(model.state_dict())
    models[1].load_state_dict(ref.state_dict())
    # torch.optim's load_state_dict keeps the tensors it is given and steps them in place:
    # copies, so that neither resume changes what the next one loads.
    opt = OSS(models[0].parameters(), optim=torch.optim.Adam, group=group, lr=1e-2)
    opt.load_state_dict(copy.deepcopy(state))
    plain = torch.optim.Adam(models[1].parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    ddps = [DDP(m) for m in models]
    for step in range(STEPS, STEPS + 2):
        x = rank_batch(rank, step)
        for ddp, o in zip(ddps, (opt, plain), strict=True):
            o.zero_grad()
            ddp(x).pow(2).mean().backward()
            o.step()
    del ddps
    return max_abs_diff(models[0].parameters(), models[1].parameters())


def _hybrid_zero1_rank(rank: int, world_size: int) -> dict[str, Any]:
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    layouts = {
        "shard_size": resolve_layout(shard_size=2),
        "device_mesh": resolve_layout(device_mesh=mesh),
        "process_groups": resolve_layout(process_groups=(shard_groups[rank // 2], replicate_groups[rank % 2])),
    }
    return {name: _train(layout, rank) for name, layout in layouts.items()}


def test_hybrid_zero1_equals_ddp_bit_for_bit_and_its_consolidated_state_resumes_hybrid_or_flat() -> None:
    results = run_ranks(_hybrid_zero1_rank, 4, timeout_s=90)
    print(f"\nhybrid ZeRO-1 (2 groups of 2) vs DDP + Adam after {STEPS} steps, max |diff| over ranks:")
    for form in results[0]:
        rows = [r[form] for r in results]
        norm_rel = max(abs(b - a) / a for r in rows for a, b in r["norms"])
        print(f"  {form:15s} params={max(r['param_diff'] for r in rows)} norm(relative)={norm_rel:.2g} "
              f"state(recipient)={max(r['recipient_state_diff'] for r in rows[::2])} "
              f"state(all_ranks)={max(r['all_ranks_state_diff'] for r in rows)} "
              f"resumed(hybrid, flat)={max(r['resumed_diff']['hybrid'] for r in rows)}, "
              f"{max(r['resumed_diff']['flat'] for r in rows)}")
        for rank, r in enumerate(rows):
            assert r["split"] == ["2.weight"], (form, rank, r)
            assert r["param_diff"] == 0.0, (form, rank, r)
            assert len(r["norms"]) == STEPS // 2 and norms_within(r["norms"], NUMEL), (form, rank, r)
            assert all(a > CLIP for a, _ in r["norms"]), (form, rank, r)  # every clip scales
            assert r["all_ranks_state_diff"] == 0.0, (form, rank, r)
            assert r["plan_size"] == 2, (form, rank, r)  # planned over the shard group, not the world
            assert r["resumed_diff"] == {"hybrid": 0.0, "flat": 0.0}, (form, rank, r)
            if rank % 2 == 0:  # shard rank 0 of each group received the consolidated state
                assert r["recipient_state_diff"] == 0.0, (form, rank, r)
        # Within a group the two ranks own complementary halves; across groups, the same half.
        # the two ranks of a shard group own every block of the plan once between them
        blocks = sorted(rows[0]["owned"] + rows[1]["owned"])
        assert len(set(blocks)) == len(blocks) and rows[0]["owned"] and rows[1]["owned"]
        for param in {b[0] for b in blocks}:
            mine = sorted(b for b in blocks if b[0] == param)
            assert mine[0][1] == 0 and all(a[2] == b[1] for a, b in zip(mine, mine[1:]))  # contiguous rows
        assert rows[0]["owned"] == rows[2]["owned"] and rows[1]["owned"] == rows[3]["owned"]
