"""Checkpoints under hybrid sharding (OSS over a shard group, every replica the same state).

Saved from hybrid ZeRO-1 (2 shard groups of 2 ranks), a consolidated file and a sharded
folder each resume bit for bit against DDP + Adam resumed from its own state, at the same
shard size, at another one (S = 1: every rank a full replica) and flat (OSS over the whole
world); a folder saved flat resumes hybrid. Only the shard group of rank 0 writes optimizer
state (Note [replicated optimizer state] in shardopt.state_checks); replicas that have
diverged are refused on every rank before anything is written. Hybrid ZeRO-2 (OSS and
ShardedDataParallel given ``shard_size``) resumes bit for bit from either format and
reloads into flat ZeRO-2 with the same state.

Why exact: DDP all-reduces every gradient over the world, so the resumed OSS and the resumed
reference step the same numbers with the same elementwise Adam update, whatever the shard
size; both sides build a fresh DDP (same buckets), so atol = rtol = 0.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt import checkpoint
from shardopt.hybrid import resolve_layout
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp
from tests.helpers.oss import state_entries_equal

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

STEPS = 4
MORE = 2


def _steps(model: nn.Module, opt: torch.optim.Optimizer, ref: nn.Module, ref_opt: torch.optim.Optimizer,
           rank: int, steps: range) -> float:
    """DDP steps of both pairs on the same data; the largest |parameter difference| after."""
    ddps = [DDP(model), DDP(ref)]
    for step in steps:
        x = rank_batch(rank, step)
        for ddp, o in zip(ddps, (opt, ref_opt), strict=True):
            o.zero_grad(set_to_none=step % 2 == 0)
            ddp(x).pow(2).mean().backward()
            o.step()
    del ddps  # freed before run_ranks destroys the group (torch 2.13 + gloo can block)
    return max_abs_diff(model.parameters(), ref.parameters())


def _copy_ref(ref: nn.Module, ref_opt: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = seeded_mlp(seed=2)
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # Adam steps loaded tensors in place
    return model, opt


def _writer_ranks(path: str) -> dict[str, set[int]]:
    """Which ranks' dcp files hold the folder's optimizer and model entries (dcp names each
    rank's file ``__<rank>_<n>.distcp``)."""
    out: dict[str, set[int]] = {"optim": set(), "model": set()}
    for index, info in dcp.FileSystemReader(path).read_metadata().storage_data.items():
        match = re.match(r"__(\d+)_", info.relative_path)
        assert match, info.relative_path
        out[index.fqn.split(".")[0]].add(int(match.group(1)))
    return out


def _hybrid_checkpoint_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    layout = resolve_layout(shard_size=2)
    singles = [dist.new_group([r]) for r in range(world_size)]  # S = 1: every rank holds everything
    groups = {"S=2": layout.shard_group, "S=1": singles[rank], "flat": None}
    model, ref = seeded_mlp(), seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=layout.shard_group, lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    trained = _steps(model, opt, ref, ref_opt, rank, range(STEPS))
    consolidations = []
    consolidate = opt.consolidate_state_dict
    opt.consolidate_state_dict = lambda recipient_rank=0: (consolidations.append(recipient_rank),  # type: ignore[method-assign]
                                                           consolidate(recipient_rank))[1]
    paths = {"consolidated": os.path.join(root, "c.pt"), "sharded": os.path.join(root, "s")}
    checkpoint.save_consolidated(paths["consolidated"], model, opt, {"step": STEPS})
    checkpoint.save_sharded(paths["sharded"], model, opt, {"step": STEPS})
    loads = {"consolidated": checkpoint.load_consolidated, "sharded": checkpoint.load_sharded}
    resumed: dict[str, float] = {}
    for fmt, load in loads.items():
        for name, group in groups.items():
            fresh = seeded_mlp(seed=1)  # other weights: everything must come from the checkpoint
            fresh_opt = OSS(fresh.parameters(), optim=torch.optim.Adam, group=group, lr=1e-2)
            assert load(paths[fmt], fresh, fresh_opt) == {"step": STEPS}
            ref_model, ref_resumed = _copy_ref(ref, ref_opt)
            resumed[f"{fmt} -> {name}"] = _steps(fresh, fresh_opt, ref_model, ref_resumed, rank,
                                                 range(STEPS, STEPS + MORE))
            if fmt == "sharded" and name == "flat":  # and back: saved flat, resumed hybrid
                checkpoint.save_sharded(os.path.join(root, "flat"), fresh, fresh_opt)
                back = seeded_mlp(seed=3)
                back_opt = OSS(back.parameters(), optim=torch.optim.Adam, group=layout.shard_group, lr=1e-2)
                checkpoint.load_sharded(os.path.join(root, "flat"), back, back_opt)
                resumed["sharded flat -> S=2"] = _steps(back, back_opt, ref_model, ref_resumed, rank,
                                                        range(STEPS + MORE, STEPS + 2 * MORE))
    writers = {name: _writer_ranks(os.path.join(root, name)) for name in ("s", "flat")} if rank == 0 else None
    return {"trained": trained, "resumed": resumed, "consolidations": consolidations, "writers": writers}


def test_hybrid_checkpoints_resume_bit_for_bit_at_any_shard_size_and_only_replica_0_writes_optimizer_state(
        tmp_path: Any) -> None:
    results = run_ranks(_hybrid_checkpoint_rank, 4, str(tmp_path), timeout_s=90)
    print(f"\nhybrid ZeRO-1 checkpoints, resumed {MORE} steps vs DDP + Adam, max |diff| over 4 ranks:")
    for key in results[0]["resumed"]:
        print(f"  {key:22s} {max(r['resumed'][key] for r in results)}")
    print(f"  writers (ranks whose dcp files hold each part): {results[0]['writers']}")
    for rank, r in enumerate(results):
        assert r["trained"] == 0.0, (rank, r)
        assert len(r["resumed"]) == 7 and set(r["resumed"].values()) == {0.0}, (rank, r["resumed"])
        # One consolidation, in the shard group of rank 0 only, onto rank 0.
        assert r["consolidations"] == ([0] if rank in (0, 1) else []), (rank, r["consolidations"])
    writers = results[0]["writers"]
    assert writers["s"]["optim"] == {0, 1}, writers  # hybrid: the shard group of rank 0
    assert writers["flat"]["optim"] == {0, 1, 2, 3}, writers  # flat: every owner
    assert writers["s"]["model"] <= {0, 1, 2, 3} and writers["s"]["model"], writers


def _diverged_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    layout = resolve_layout(shard_size=1)  # 2 replicas of the whole state
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, group=layout.shard_group, lr=1e-2)
    model(rank_batch(0, 0)).pow(2).mean().backward()  # the same data: equal replicas
    opt.step()
    path = os.path.join(root, "s")
    checkpoint.save_sharded(path, model, opt, {"version": 1})
    if rank == 1:  # a change on one replica only
        next(iter(opt.optim.state.values()))["exp_avg"].add_(1.0)
    try:
        checkpoint.save_sharded(path, model, opt, {"version": 2})
        error = None
    except ValueError as exc:
        error = str(exc)
    fresh = seeded_mlp(seed=1)
    extra = checkpoint.load_sharded(path, fresh, OSS(fresh.parameters(), optim=torch.optim.Adam, lr=1e-2))
    return {"error": error, "extra": extra, "left": sorted(os.listdir(root))}


def test_save_sharded_refuses_diverged_replicas_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path: Any) -> None:
    results = run_ranks(_diverged_rank, 2, str(tmp_path), timeout_s=60)
    for r in results:
        assert r["error"] is not None and "ranks 0 and 1 both hold optimizer state" in r["error"], r
        assert "diverged" in r["error"] and "nothing was written" in r["error"], r
        assert r["extra"] == {"version": 1}, r  # the previous checkpoint, whole
        assert r["left"] == ["s"], r  # no staging folder left behind


def _zero2(seed: int, shard_size: int | None) -> tuple[nn.Module, OSS, nn.Module]:
    model = seeded_mlp(seed=seed)
    layout: dict[str, Any] = {} if shard_size is None else {"shard_size": shard_size}
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, **layout)
    return model, opt, ShardedDataParallel(model, opt, **layout)


def _zero2_steps(sdp: nn.Module, opt: OSS, rank: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=step % 2 == 0)
        sdp(rank_batch(rank, step)).pow(2).mean().backward()
        opt.step()


def _hybrid_zero2_checkpoint_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model, opt, sdp = _zero2(0, 2)
    _zero2_steps(sdp, opt, rank, range(STEPS))
    saved = copy.deepcopy(opt.state_dict(all_ranks=True))
    paths = {"consolidated": os.path.join(root, "c.pt"), "sharded": os.path.join(root, "s")}
    checkpoint.save_consolidated(paths["consolidated"], model, opt)
    checkpoint.save_sharded(paths["sharded"], model, opt)
    _zero2_steps(sdp, opt, rank, range(STEPS, STEPS + MORE))
    loads = {"consolidated": checkpoint.load_consolidated, "sharded": checkpoint.load_sharded}
    resumed, flat_state = {}, {}
    for fmt, load in loads.items():
        fresh, fresh_opt, fresh_sdp = _zero2(1, 2)
        load(paths[fmt], fresh, fresh_opt)
        _zero2_steps(fresh_sdp, fresh_opt, rank, range(STEPS, STEPS + MORE))
        resumed[fmt] = max_abs_diff(fresh.parameters(), model.parameters())
        flat, flat_opt, _ = _zero2(2, None)  # ZeRO-2 over the whole world: the same state, resharded
        load(paths[fmt], flat, flat_opt)
        flat_state[fmt] = state_entries_equal(flat_opt.state_dict(all_ranks=True)["state"], saved["state"])
    writers = _writer_ranks(paths["sharded"]) if rank == 0 else None
    return {"resumed": resumed, "flat_state": flat_state, "writers": writers}


def test_hybrid_zero2_checkpoints_resume_bit_for_bit_and_reload_flat(tmp_path: Any) -> None:
    # The resumed run does the uninterrupted run's arithmetic (same layout, same reduction
    # order), so atol = rtol = 0; the flat ZeRO-2 load must hold exactly the saved state.
    results = run_ranks(_hybrid_zero2_checkpoint_rank, 4, str(tmp_path), timeout_s=90)
    for rank, r in enumerate(results):
        assert r["resumed"] == {"consolidated": 0.0, "sharded": 0.0}, (rank, r)
        assert r["flat_state"] == {"consolidated": True, "sharded": True}, (rank, r)
    assert results[0]["writers"]["optim"] == {0, 1}, results[0]["writers"]
