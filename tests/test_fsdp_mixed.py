"""Mixed precision, HYBRID_SHARD and meta-device initialisation of FullyShardedDataParallel."""

from __future__ import annotations

import pytest
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP
from shardopt.nn.fsdp import MixedPrecision, ModuleClassPolicy, ShardingStrategy
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp
from tests.helpers.ddp_arithmetic import mixed_reference_step as _reference_step
from tests.helpers.gpt import Block, gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

BLOCKS = ModuleClassPolicy((Block,))


def _mixed(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    policies = (
        MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        MixedPrecision(param_dtype=torch.bfloat16),
        MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, keep_low_precision_grads=True),
    )
    for policy in policies:
        for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
            master = gpt()
            model = FSDP(gpt(), sharding_strategy=strategy, mixed_precision=policy, auto_wrap_policy=BLOCKS)
            opt_ref, opt = torch.optim.SGD(master.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                toks = tokens(rank, step)
                _reference_step(master, opt_ref, toks, policy)
                logits = model(toks)
                assert logits.dtype == policy.param_dtype
                lm_loss(logits, toks).backward()
                grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
                want = policy.reduce_dtype or policy.param_dtype if policy.keep_low_precision_grads else torch.float32
                assert grad_dtypes == {want}, (grad_dtypes, want)
                opt.step()
                opt.zero_grad()
            assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master shards
            key = f"{policy.param_dtype}/{policy.reduce_dtype}/{policy.keep_low_precision_grads}/{strategy.name}"
            out[key] = max_abs_diff(model.state_dict().values(), master.state_dict().values())
    return out


def test_mixed_precision_matches_a_reference_reducing_in_the_same_dtype_and_order() -> None:
    for out in run_ranks(_mixed, 2):
        assert max(out.values()) == 0.0, out


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _buffers(rank: int, world_size: int) -> str:
    model = FSDP(_WithBuffer(), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    y = model(torch.randn(3, 8))
    return f"{model.module.scale.dtype} {y.dtype}"


def test_buffer_dtype_casts_buffers() -> None:
    assert run_ranks(_buffers, 1) == ["torch.bfloat16 torch.bfloat16"]


def _hybrid(rank: int, world_size: int, folder: str) -> dict[str, float]:
    # Ranks {0,1} and {2,3} each hold a full copy, sharded in two; {0,2} and {1,3} replicate.
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pair = (shard_groups[rank // 2], replicate_groups[rank % 2])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out: dict[str, float] = {}
    synced = FSDP(gpt(seed=rank), sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=pair,
                  sync_module_states=True)
    out["sync_module_states"] = max_abs_diff(synced.state_dict().values(), gpt().state_dict().values())
    for how in ("groups", "mesh"):
        ref = DDP(gpt())
        kwargs = {"process_group": pair} if how == "groups" else {"device_mesh": mesh}
        model = FSDP(gpt(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=BLOCKS, **kwargs)
        opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9)
        for step in range(4):
            toks = tokens(rank, step)
            for m, o in ((ref, opt_ref), (model, opt)):
                o.zero_grad()
                lm_loss(m(toks), toks).backward()
            norm = model.clip_grad_norm_(1e9)
            norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
            out[f"{how}/norm"] = max(out.get(f"{how}/norm", 0.0), abs(norm.item() - norm_ref.item()) / norm_ref.item())
            opt_ref.step()
            opt.step()
        plain = ref.module.state_dict()
        scale = max(v.abs().max().item() for v in plain.values())
        out[how] = max_abs_diff(model.state_dict().values(), plain.values()) / scale
        # consolidated momentum buffers equal DDP's (gathered within the shard group only)
        osd, names = FSDP.full_optim_state_dict(model, opt, rank0_only=False), [n for n, _ in ref.module.named_parameters()]
        ref_state = opt_ref.state_dict()["state"]
        momentum_scale = max(v["momentum_buffer"].abs().max().item() for v in ref_state.values())
        out[f"{how}/optim"] = max(max_abs_diff([osd["state"][names[i]]["momentum_buffer"]], [st["momentum_buffer"]])
                                  for i, st in ref_state.items()) / momentum_scale
        # every parameter piece is a quarter-ish of the model: sharded in two, not four
        local = sum(p.numel() for p in model.parameters())
        out[f"{how}/fraction"] = local / sum(p.numel() for p in ref.parameters())
    # the last model's sharded checkpoint (dcp keeps one copy of the replicated pieces) loads
    # into a HYBRID_SHARD and a FULL_SHARD model of another init
    full = model.state_dict()
    dcp.save(model.sharded_state_dict(), checkpoint_id=folder)
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.FULL_SHARD):
        kwargs = {"device_mesh": mesh} if strategy is ShardingStrategy.HYBRID_SHARD else {}
        fresh = FSDP(gpt(seed=1), sharding_strategy=strategy, **kwargs)
        target = fresh.sharded_state_dict()
        dcp.load(target, checkpoint_id=folder)
        fresh.load_sharded_state_dict(target)
        out[f"sharded_load/{strategy.name}"] = max_abs_diff(fresh.state_dict().values(), full.values())
    return out


def test_hybrid_shard_on_four_ranks_matches_ddp_within_1e6(tmp_path: Path) -> None:
    for out in run_ranks(_hybrid, 4, str(tmp_path / "hybrid"), timeout_s=120):
        assert out["sharded_load/HYBRID_SHARD"] == out["sharded_load/FULL_SHARD"] == 0.0, out
        assert max(v for k, v in out.items() if not k.endswith("fraction")) <= 1e-6, out
        assert 0.45 < out["groups/fraction"] < 0.6 and 0.45 < out["mesh/fraction"] < 0.6, out


def _meta(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    expected = seeded_mlp(seed=3).state_dict()
    with torch.device("meta"):
        module = seeded_mlp(seed=3)
    torch.manual_seed(3)  # reset_parameters() runs in module order, as construction did
    model = FSDP(module)
    out["reset_parameters"] = max_abs_diff(model.state_dict().values(), expected.values())

    def init(m: nn.Module) -> None:
        m.to_empty(device="cpu")
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(0.5)

    with torch.device("meta"):
        module = seeded_mlp()
    model = FSDP(module, param_init_fn=init)
    out["param_init_fn"] = float(not all(bool((v == 0.5).all()) for v in model.state_dict().values()))
    y = model(rank_batch(rank, 0))
    out["forward"] = float(tuple(y.shape) != (6, 4))
    # a tied embedding/head stays tied through materialisation and trains like DDP
    with torch.device("meta"):
        meta_gpt = gpt()

    def init_gpt(m: nn.Module) -> None:  # to_empty unties embed/head; FSDP ties them again
        m.to_empty(device="cpu")
        torch.manual_seed(0)
        for sub in m.modules():
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
        with torch.no_grad():
            m.pos.fill_(0.01)

    model = FSDP(meta_gpt, auto_wrap_policy=BLOCKS, param_init_fn=init_gpt)
    out["still_tied"] = float(meta_gpt.head.weight is not meta_gpt.embed.weight)
    ref = DDP(gpt())
    ref.module.load_state_dict(model.state_dict())
    opt_ref, opt = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        toks = tokens(rank, step)
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            lm_loss(m(toks), toks).backward()
            o.step()
    out["tied_training"] = max_abs_diff(model.state_dict().values(), ref.module.state_dict().values())
    return out


def test_meta_device_modules_are_materialised_by_reset_parameters_or_param_init_fn() -> None:
    for out in run_ranks(_meta, 2):
        assert max(out.values()) == 0.0, out
