"""``OSS(..., offload="cpu")`` (Note [offloaded masters] in shardopt.optim.masters): training
with the masters, their gradients and the optimizer state offloaded equals the same run
without offload bit for bit, for ZeRO-1 (DDP + OSS), ZeRO-2 (ShardedDataParallel, parameters
whole, split and hybrid), fp32 and bf16 with fp32 masters, with gradient accumulation (with
and without ``no_sync``), clipping, ShardedGradScaler (an inf on one rank) and checkpoints
saved with offload and loaded without, and the reverse.

Why exact: on a CPU the offloaded step runs the same torch kernels on the same values. An
fp32 parameter's mirror is its exact copy, and its flat step equals its per-parameter step
over aligned segments (Note [aligned segments] in shardopt.optim.flat_masters); the copies
to and from the host are exact; a bf16 parameter has an fp32 master with or without offload.
The offloaded runs place every host buffer however small (Note [host buffer placement] in
shardopt.host_memory), the reference runs on torch's own allocations: placement moves
addresses, never values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shardopt.host_memory as host_memory
from shardopt import checkpoint
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler
from shardopt.testing import run_ranks
from tests.helpers.masters import backward_micro_steps, loss_of
from tests.helpers.oss import state_entries_equal
from tests.helpers.kernels import optimizer_kernels

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

F32, BF16 = torch.float32, torch.bfloat16
ADAMW: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
STAGES = ("zero1", "zero2", "zero2-whole", "zero2-hybrid")
MODES = ("plain", "accumulate", "no_sync", "carry", "clip", "scaler", "freeze", "checkpoint")
CHECKPOINT_VARIANTS = {"offload-to-offload": ("cpu", "cpu"), "offload-to-device": ("cpu", None),
                       "device-to-offload": (None, "cpu")}
"""Saved with / loaded into offload (the reference saves and loads without)."""
PLAIN = 1 << 62
"""A placement threshold no buffer reaches (Note [host buffer placement] in shardopt.host_memory)."""


def mlp(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Aligned weights (stepped flat) and two biases that are not (48 and 4 elements: stepped as
    views); the 64x64 weight is larger than a rank's share at 2 and 3 ranks, so the default
    plan splits it."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 4)).to(dtype)


def _build(stage: str, model: nn.Module, dtype: torch.dtype, offload: str | None, world_size: int,
           lr: float = ADAMW["lr"]) -> tuple[OSS, nn.Module]:
    options: dict[str, Any] = {**ADAMW, "lr": lr, "offload": offload,
                               "master_dtype": F32 if dtype != F32 else None}
    if stage == "zero2-whole":
        options["split_large_params"] = False
    if stage == "zero2-hybrid":
        options["shard_size"] = 1 if world_size > 1 else None  # each rank a shard group, replicated
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, **options)
    return opt, (DDP(model) if stage == "zero1" else ShardedDataParallel(model, opt))


def _save(stage: str, folder: str, model: nn.Module, opt: OSS) -> Callable[[nn.Module, OSS], None]:
    """Save (consolidated for ZeRO-1, sharded for ZeRO-2); returns the matching load."""
    if stage == "zero1":
        checkpoint.save_consolidated(folder + ".pt", model, opt)
        return lambda m, o: checkpoint.load_consolidated(folder + ".pt", m, o)
    checkpoint.save_sharded(folder, model, opt)
    return lambda m, o: checkpoint.load_sharded(folder, m, o)


def _train(rank: int, world_size: int, stage: str, dtype: torch.dtype, mode: str, offload: str | None,
           folder: str, offload_after: str | None = None) -> tuple[list[torch.Tensor], dict[Any, Any], list[float]]:
    """Six steps; returns the parameters, the consolidated optimizer state and the clip norms.
    With ``mode="checkpoint"`` the run saves at step 3 and goes on in a fresh model and
    optimizer built with ``offload_after``, which load the checkpoint (the reference is a run
    that does the same without offload: a fresh DDP at 3 ranks may sum its buckets in another
    order than the uninterrupted one, which is no concern of offload's)."""
    model = mlp(dtype)
    opt, wrapped = _build(stage, model, dtype, offload, world_size)
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=2, device="cpu") if mode == "scaler" else None
    norms: list[float] = []
    for step in range(6):
        if mode == "checkpoint" and step == 3:
            load = _save(stage, f"{folder}/{stage}-{dtype}-{offload}-{offload_after}", model, opt)
            model = mlp(dtype, seed=5)
            opt, wrapped = _build(stage, model, dtype, offload_after, world_size, lr=0.5)
            load(model, opt)
        if mode == "freeze" and step in (2, 4) and stage != "zero1":  # frozen mid-training, then trainable
            model[2].weight.requires_grad_(step == 4)  # again: its state is parked with its owner (on the host)
            # (DDP cannot change which parameters train after it is built: ZeRO-2 only)
        if mode != "carry" or step % 3 == 0:  # carry: gradients summed across steps, as DDP does
            opt.zero_grad(set_to_none=step % 2 == 0)
        micro = 2 if mode in ("accumulate", "no_sync") else 1
        backward_micro_steps(wrapped, rank, step, micro, dtype, scaler, no_sync=mode == "no_sync")
        if scaler is not None:
            if step == 3 and rank == world_size - 1:  # an inf on one rank: every rank skips
                opt.collect_master_grads()
                owned = [p for p in opt.params if opt.grad_holder(p) is not None]
                holder = opt.grad_holder(owned[0])
                target = holder.grad if holder is not None and holder.grad is not None else owned[0].grad
                target.view(-1)[0] = float("inf")  # type: ignore[union-attr]
            scaler.step(opt)
            scaler.update()
            continue
        if mode == "clip":
            norms.append(float(opt.clip_grad_norm(0.05)))
        opt.step()
    if opt.offload is not None:  # every owned trainable parameter is stepped through a host master
        held = [(p, opt.grad_holder(p)) for p in opt.params if opt.grad_holder(p) is not None]
        assert held and all(h is opt.master_of(p) and h is not p and h.device.type == "cpu" for p, h in held)
    state = opt.state_dict(all_ranks=True)["state"]
    return [p.detach().clone() for p in model.parameters()], state, norms


def _equality(rank: int, world_size: int, folder: str) -> dict[str, dict[str, bool]]:
    out: dict[str, dict[str, bool]] = {}
    for stage in STAGES:
        for dtype in (F32, BF16):
            for mode in MODES:
                host_memory.MIN_PLACED_BYTES = PLAIN  # the reference: torch's own allocations
                base = _train(rank, world_size, stage, dtype, mode, None, folder)
                variants = CHECKPOINT_VARIANTS if mode == "checkpoint" else {"offload": ("cpu", None)}
                for variant, (offload, after) in variants.items():
                    host_memory.MIN_PLACED_BYTES = 0  # every host buffer placed, however small
                    params, state, norms = _train(rank, world_size, stage, dtype, mode, offload, folder, after)
                    out[f"{stage}/{dtype}/{mode}/{variant}"] = {
                        "params": all(torch.equal(x, y) for x, y in zip(params, base[0], strict=True)),
                        "state": state_entries_equal(state, base[1]),
                        "norms": norms == base[2],
                        "moved": bool(params) and not all(torch.equal(x, y) for x, y in zip(params, mlp(dtype).parameters(),
                                                                                             strict=True)),
                    }
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_offloaded_training_equals_training_without_offload_bit_for_bit(world_size: int, tmp_path: Any) -> None:
    results = run_ranks(_equality, world_size, str(tmp_path), timeout_s=600)
    assert results[0], "no configuration ran"
    for tag in results[0]:
        for key in ("params", "state", "norms", "moved"):
            assert all(r[tag][key] for r in results), (tag, key, [r[tag] for r in results])


def _errors(rank: int, world_size: int) -> dict[str, str]:
    out: dict[str, str] = {}
    model = mlp(F32)
    for bad in ("nvme", "gpu", True):
        try:
            OSS(model.parameters(), optim=torch.optim.AdamW, offload=bad, lr=1e-2)  # type: ignore[arg-type]
            out[repr(bad)] = "accepted"
        except ValueError as exc:
            out[repr(bad)] = str(exc)
    try:  # the ranks disagree: named before the first collective, not a hang
        OSS(model.parameters(), optim=torch.optim.AdamW, offload="cpu" if rank == 0 else None, lr=1e-2)
        out["disagree"] = "accepted"
    except ValueError as exc:
        out["disagree"] = str(exc)
    return out


def test_bad_offload_values_and_ranks_that_disagree_are_clear_errors() -> None:
    for r in run_ranks(_errors, 2, timeout_s=60):
        assert "offload must be None or 'cpu', got 'nvme' (NVMe offload is not implemented)" in r["'nvme'"]
        assert "got 'gpu'" in r["'gpu'"] and "pass offload='cpu'" in r["'gpu'"]
        assert "got True" in r["True"]
        assert "offload" in r["disagree"] and "same OSS arguments on every rank" in r["disagree"], r["disagree"]


def _kernel_counts(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    """The wrapped optimizer's aten calls per step over an fp32 model of 8 and of 64 layers,
    with offload (host mirrors stepped as one flat tensor) and without (one tensor per
    parameter: the control, which shows that the counter sees per-parameter work)."""
    out: dict[str, tuple[int, int]] = {}
    for name, kwargs in (("adamw/default", {}), ("adamw/foreach", {"foreach": True}), ("adamw/fused", {"fused": True})):
        for layers in (8, 64):
            counts = []
            for offload in ("cpu", None):
                torch.manual_seed(0)
                model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])
                opt = OSS(model.parameters(), optim=torch.optim.AdamW, offload=offload, **ADAMW, **kwargs)
                for _ in range(3):  # the first step creates the state
                    opt.zero_grad()
                    model(torch.randn(4, 64)).pow(2).mean().backward()
                    count = optimizer_kernels(opt.step, torch.optim.AdamW)
                counts.append(count)
            out[f"{name}/{layers}"] = (counts[0], counts[1])
    return out


def test_host_optimizer_kernels_per_step_do_not_grow_with_the_number_of_parameters() -> None:
    counts = run_ranks(_kernel_counts, 1, timeout_s=180)[0]
    print(f"\nhost optimizer aten calls per step (offload, without): {counts}")
    for name in ("adamw/default", "adamw/foreach", "adamw/fused"):
        (off8, dev8), (off64, dev64) = counts[f"{name}/8"], counts[f"{name}/64"]
        assert off8 == off64 > 0, (name, off8, off64)
        assert dev64 > dev8 and dev64 > off64, (name, dev8, dev64)  # the counter sees per-tensor work


def _save_both(rank: int, world_size: int, folder: str) -> None:
    """Three ZeRO-2 steps (bf16 with fp32 masters, and fp32) with and without offload, each
    saved as a sharded checkpoint."""
    for dtype in (F32, BF16):
        for offload in ("cpu", None):
            model = mlp(dtype)
            opt, wrapped = _build("zero2", model, dtype, offload, world_size)
            for step in range(3):
                opt.zero_grad()
                loss_of(wrapped, rank, step, dtype).backward()
                opt.step()
            checkpoint.save_sharded(f"{folder}/{dtype}-{offload}", model, opt, {"step": 3})


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}/").items()}
    return {prefix: value}


def test_a_checkpoint_saved_with_offload_converts_to_the_same_file_as_one_saved_without(tmp_path: Any) -> None:
    from shardopt.integrations.checkpoints import convert_sharded

    run_ranks(_save_both, 2, str(tmp_path), timeout_s=120)
    for dtype in (F32, BF16):
        files = {}
        for offload in ("cpu", None):
            convert_sharded(str(tmp_path / f"{dtype}-{offload}"), str(tmp_path / f"{dtype}-{offload}.pt"))
            files[offload] = _flatten(torch.load(tmp_path / f"{dtype}-{offload}.pt", weights_only=True))
        assert files["cpu"].keys() == files[None].keys() and len(files[None]) > 10, sorted(files[None])[:20]
        assert any("master" in k for k in files[None]) == (dtype == BF16)  # mirrors are never saved
        for key, value in files[None].items():
            assert torch.equal(torch.as_tensor(files["cpu"][key]), torch.as_tensor(value)), key
