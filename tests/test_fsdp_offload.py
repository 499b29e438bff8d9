"""CPU offload of FullyShardedDataParallel (``cpu_offload=CPUOffload(offload_params=True)``)
against the same run without offload.

On this CPU-only machine the compute device is the CPU too, so offloading changes where no
arithmetic happens: the shard is still a host tensor of its own, uploaded into a separate
buffer before each all-gather, and the reduced gradients are downloaded into new host
tensors and landed at the end of backward (Note [offloaded shards] in
shardopt.nn.fsdp.offload). Every comparison is therefore exact (``== 0.0``): the same CPU
kernels on the same values in the same order. The CUDA checks are in tests/test_gpu.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.fsdp import CPUOffload as TorchCPUOffload

from shardopt import grad_norms
from shardopt.nn.fsdp import CPUOffload, MixedPrecision, ModuleClassPolicy, ShardingStrategy
from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff
from tests.helpers.fsdp import all_sharded
from tests.helpers.gpt import Block, gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

BLOCKS = ModuleClassPolicy((Block,))
SHARDED = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)
PRECISIONS = {"fp32": None, "bf16": MixedPrecision(param_dtype=torch.bfloat16)}
OFFLOAD = CPUOffload(offload_params=True)
MAX_NORM = 0.05  # below every step's gradient norm here, so clipping scales every step


def _offloaded_on_host(model: nn.Module) -> bool:
    """Every unit's shard is a host tensor of its own (never the full buffer), every
    parameter between steps and every gradient it holds is on the host."""
    for wrapper in FSDP.fsdp_modules(model):
        handle = wrapper.unit.handle
        if handle is None:
            continue
        if handle.host is None or handle.shard.device.type != "cpu" or handle.full is handle.shard:
            return False
        if handle.full.untyped_storage().data_ptr() == handle.shard.untyped_storage().data_ptr():
            return False
        for p in handle.params:
            if p.device.type != "cpu" or (p.grad is not None and p.grad.device.type != "cpu"):
                return False
    return True


def _build(strategy: ShardingStrategy, precision: str, offload: bool, seed: int = 0, **kwargs: Any) -> FSDP:
    return FSDP(gpt(seed=seed), sharding_strategy=strategy, auto_wrap_policy=BLOCKS,
                mixed_precision=PRECISIONS[precision], cpu_offload=OFFLOAD if offload else None, **kwargs)


def _train_step(model: FSDP, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    """Two micro-batches: under ``no_sync`` on even steps, two synchronised backwards on
    odd ones (accumulation in the sharded gradients); clipping; Adam."""
    opt.zero_grad(set_to_none=step % 2 == 0)
    for micro in range(2):
        toks = tokens(rank, 2 * step + micro)
        if micro == 0 and step % 2 == 0:
            with model.no_sync():
                lm_loss(model(toks), toks).backward()
        else:
            lm_loss(model(toks), toks).backward()
    norm = model.clip_grad_norm_(MAX_NORM)
    opt.step()
    return norm.item()


def _train(rank: int, strategy: ShardingStrategy, precision: str, offload: bool, steps: int,
           **kwargs: Any) -> dict[str, Any]:
    model = _build(strategy, precision, offload, **kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    on_host = not offload or _offloaded_on_host(model)
    norms = []
    for step in range(steps):
        norms.append(_train_step(model, opt, rank, step))
        on_host = on_host and (not offload or _offloaded_on_host(model))
        assert all_sharded(model)
    state_on_host = all(t.device.type == "cpu" for s in opt.state.values() for t in s.values()
                        if isinstance(t, torch.Tensor))
    # a last backward, then the full parameters and gradients as summon_full_params shows them
    toks = tokens(rank, 99)
    opt.zero_grad()
    lm_loss(model(toks), toks).backward()
    by_name = grad_norms(model)
    with model.summon_full_params(with_grads=True, writeback=False):
        summoned = [t.detach().clone() for p in model.parameters() for t in (p, p.grad) if t is not None]
    with model.summon_full_params(writeback=True):  # a write inside the context reaches the shards
        with torch.no_grad():
            model.module.ln_f.weight.mul_(0.5)
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": FSDP.full_optim_state_dict(model, opt, rank0_only=False),
        "sharded": [_local(v) for v in model.sharded_state_dict().values()],
        "norms": norms, "grad_norms": list(by_name.values()), "summoned": summoned,
        "on_host": on_host, "state_on_host": state_on_host,
    }


def _local(value: Any) -> torch.Tensor:
    """This rank's elements of a sharded state dict entry (a ShardedTensor or a tensor)."""
    if isinstance(value, ShardedTensor):
        return torch.cat([s.tensor.reshape(-1) for s in value.local_shards()] + [torch.empty(0)])
    return value.detach().reshape(-1)


def _flat_optim(osd: dict[str, Any]) -> list[torch.Tensor]:
    return [v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            for name in sorted(osd["state"]) for _, v in sorted(osd["state"][name].items())]


def _offload_parity(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in (*SHARDED, ShardingStrategy.NO_SHARD):
        for precision in PRECISIONS:
            plain = _train(rank, strategy, precision, offload=False, steps=5)
            offloaded = _train(rank, strategy, precision, offload=True, steps=5)
            key = f"{strategy.name}/{precision}"
            out[key] = max(
                max_abs_diff(plain["model"].values(), offloaded["model"].values()),
                max_abs_diff(_flat_optim(plain["optim"]), _flat_optim(offloaded["optim"])),
                max_abs_diff(plain["sharded"], offloaded["sharded"]),
                max_abs_diff(plain["summoned"], offloaded["summoned"]),
                max_abs_diff(plain["grad_norms"], offloaded["grad_norms"]),
                max(abs(a - b) for a, b in zip(plain["norms"], offloaded["norms"], strict=True)),
            )
            assert list(plain["model"]) == list(offloaded["model"])
            out[f"{key}/clipped"] = min(plain["norms"]) > MAX_NORM
            out[f"{key}/on_host"] = offloaded["on_host"] and offloaded["state_on_host"]
    # Units wrapped by hand with different choices: the blocks offloaded, the root not.
    models = []
    for inner in (False, True):
        model = gpt()
        for i, block in enumerate(model.blocks):
            model.blocks[i] = FSDP(block, cpu_offload=CPUOffload(offload_params=inner))
        models.append(FSDP(model))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    norms = [[_train_step(m, o, rank, step) for step in range(4)] for m, o in zip(models, opts, strict=True)]
    out["mixed_by_hand"] = max(max_abs_diff(models[0].state_dict().values(), models[1].state_dict().values()),
                               max(abs(a - b) for a, b in zip(*norms, strict=True)))
    out["mixed_by_hand/on_host"] = all(p.device.type == "cpu" and p.grad is not None and p.grad.device.type == "cpu"
                                       for p in models[1].module.blocks.parameters())
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_offloaded_training_equals_the_same_run_without_offload_bit_for_bit(world_size: int) -> None:
    for out in run_ranks(_offload_parity, world_size, timeout_s=300):
        diffs = {k: v for k, v in out.items() if isinstance(v, float)}
        flags = {k: v for k, v in out.items() if isinstance(v, bool)}
        assert diffs and max(diffs.values()) == 0.0, diffs
        assert flags and all(flags.values()), flags


def _hybrid(rank: int, world_size: int) -> dict[str, Any]:
    """HYBRID_SHARD over 2 groups of 2: the replicas' all-reduce runs before the download."""
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair = (shard_groups[rank // 2], replicate_groups[rank % 2])
    out: dict[str, Any] = {}
    for precision in PRECISIONS:
        runs = [_train(rank, ShardingStrategy.HYBRID_SHARD, precision, offload, 4, process_group=pair)
                for offload in (False, True)]
        out[precision] = max(
            max_abs_diff(runs[0]["model"].values(), runs[1]["model"].values()),
            max_abs_diff(_flat_optim(runs[0]["optim"]), _flat_optim(runs[1]["optim"])),
            max_abs_diff(runs[0]["summoned"], runs[1]["summoned"]),
            max(abs(a - b) for a, b in zip(runs[0]["norms"], runs[1]["norms"], strict=True)),
        )
        out[f"{precision}/on_host"] = runs[1]["on_host"] and runs[1]["state_on_host"]
    return out


def test_hybrid_shard_with_offload_equals_the_same_run_without_bit_for_bit() -> None:
    for out in run_ranks(_hybrid, 4, timeout_s=300):
        assert out["fp32"] == out["bf16"] == 0.0 and out["fp32/on_host"] and out["bf16/on_host"], out


def _resume(rank: int, world_size: int, folder: str) -> dict[str, float]:
    """3 steps, a checkpoint, 3 more steps in a fresh model of another seed; the other side of
    the checkpoint with and without offload, full and sharded checkpoints."""
    out: dict[str, float] = {}
    for strategy in SHARDED:
        for precision in PRECISIONS:
            whole = _build(strategy, precision, offload=False)
            whole_opt = torch.optim.Adam(whole.parameters(), lr=1e-2)
            for step in range(6):
                _train_step(whole, whole_opt, rank, step)
            want = whole.state_dict()
            want_optim = _flat_optim(FSDP.full_optim_state_dict(whole, whole_opt, rank0_only=False))
            for save_offloaded in (True, False):
                for kind in ("full", "sharded"):
                    first = _build(strategy, precision, offload=save_offloaded)
                    first_opt = torch.optim.Adam(first.parameters(), lr=1e-2)
                    for step in range(3):
                        _train_step(first, first_opt, rank, step)
                    second = _build(strategy, precision, offload=not save_offloaded, seed=1)
                    second_opt = torch.optim.Adam(second.parameters(), lr=1e-2)
                    if kind == "full":
                        model_sd = first.state_dict()
                        osd = FSDP.full_optim_state_dict(first, first_opt, rank0_only=False)
                        second.load_state_dict(model_sd)
                        second_opt.load_state_dict(FSDP.shard_full_optim_state_dict(osd, second, second_opt))
                    else:
                        path = f"{folder}/{strategy.name}-{precision}-{save_offloaded}"
                        dcp.save({"model": first.sharded_state_dict(),
                                  "optim": FSDP.sharded_optim_state_dict(first, first_opt)}, checkpoint_id=path)
                        target = {"model": second.sharded_state_dict(),
                                  "optim": FSDP.sharded_optim_state_dict(second, second_opt)}
                        dcp.load(target, checkpoint_id=path)
                        second.load_sharded_state_dict(target["model"])
                        FSDP.load_sharded_optim_state_dict(second, second_opt, target["optim"])
                    for step in range(3, 6):
                        _train_step(second, second_opt, rank, step)
                    key = f"{strategy.name}/{precision}/{kind}/saved_{'offloaded' if save_offloaded else 'plain'}"
                    out[key] = max(
                        max_abs_diff(second.state_dict().values(), want.values()),
                        max_abs_diff(_flat_optim(FSDP.full_optim_state_dict(second, second_opt, rank0_only=False)),
                                     want_optim),
                    )
    return out


def test_checkpoints_move_between_offloaded_and_plain_models_and_resume_bit_for_bit(tmp_path: Path) -> None:
    for out in run_ranks(_resume, 2, str(tmp_path), timeout_s=300):
        assert len(out) == 16 and max(out.values()) == 0.0, out


def _errors(rank: int, world_size: int) -> dict[str, str]:
    messages: dict[str, str] = {}
    for name, bad in {"bool": True, "string": "cpu", "torch": TorchCPUOffload(offload_params=True)}.items():
        try:
            FSDP(gpt(), cpu_offload=bad)  # type: ignore[arg-type]
            messages[name] = ""
        except TypeError as exc:
            messages[name] = str(exc)
    try:  # ranks that disagree are refused on every rank before the first collective
        FSDP(gpt(), cpu_offload=CPUOffload(offload_params=rank == 1))
        messages["disagree"] = ""
    except ValueError as exc:
        messages["disagree"] = str(exc)
    return messages


def test_a_cpu_offload_that_is_not_a_cpu_offload_or_differs_across_ranks_is_refused_naming_the_fix() -> None:
    fix = "use cpu_offload=CPUOffload(offload_params=True) with `from shardopt.nn.fsdp import CPUOffload`"
    for messages in run_ranks(_errors, 2):
        assert messages["bool"] == f"cpu_offload must be a shardopt CPUOffload or None, got True (builtins.bool); {fix}"
        assert messages["string"] == f"cpu_offload must be a shardopt CPUOffload or None, got 'cpu' (builtins.str); {fix}"
        assert messages["torch"].startswith("cpu_offload must be a shardopt CPUOffload or None, got "
                                            "CPUOffload(offload_params=True) (torch.distributed.fsdp."), messages
        assert messages["torch"].endswith(fix), messages
        assert ("cpu_offload is CPUOffload(offload_params=False) on rank 0 but CPUOffload(offload_params=True) on "
                "rank 1") in messages["disagree"], messages


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_cpu_offload_params_must_be_a_bool(bad: object) -> None:
    with pytest.raises(TypeError) as info:
        CPUOffload(offload_params=bad)  # type: ignore[arg-type]
    assert str(info.value) == (f"CPUOffload.offload_params must be a bool, got {bad!r}; "
                               "use CPUOffload(offload_params=True)")
