"""State of FSDP models: full and sharded state dicts across world sizes, summon_full_params,
apply, clip_grad_norm_, sync_module_states, optimizer state consolidation and re-sharding."""

from __future__ import annotations

import pytest
import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn.fsdp import FullyShardedDataParallel as FSDP
from shardopt.nn.fsdp import ModuleClassPolicy, ShardingStrategy
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp
from tests.helpers.fsdp import all_sharded
from tests.helpers.gpt import Block, gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

BLOCKS = ModuleClassPolicy((Block,))


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        toks = tokens(rank, step)
        opt.zero_grad()
        lm_loss(model(toks), toks).backward()
        opt.step()


def _save(rank: int, world_size: int, folder: str) -> tuple[bytes, bytes, float]:
    """Train at this world size, return full model + optimizer state, write a sharded folder."""
    ref = DDP(gpt())
    model = FSDP(gpt(), auto_wrap_policy=BLOCKS)
    # eps=1e-3 keeps Adam from turning last-bit differences of near-zero gradients (three
    # ranks sum in another order than DDP) into lr-sized ones when training resumes.
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2, eps=1e-3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    _train(ref, opt_ref, rank, range(3))
    _train(model, opt, rank, range(3))
    full = model.state_dict(rank0_only=False, offload_to_cpu=True)
    osd = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
    # The consolidated optimizer state is DDP's, entry for entry (bitwise at two ranks).
    names = [n for n, _ in ref.module.named_parameters()]
    ref_state = opt_ref.state_dict()["state"]
    diff = max(max_abs_diff([osd["state"][names[i]][k]], [v]) for i, st in ref_state.items() for k, v in st.items())
    for strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):  # the same for the others
        other = FSDP(gpt(), auto_wrap_policy=BLOCKS, sharding_strategy=strategy)
        other_opt = torch.optim.Adam(other.parameters(), lr=1e-2, eps=1e-3)
        _train(other, other_opt, rank, range(3))
        other_osd = FSDP.full_optim_state_dict(other, other_opt, rank0_only=False)
        diff = max(diff, max(max_abs_diff([other_osd["state"][names[i]][k]], [v])
                             for i, st in ref_state.items() for k, v in st.items()))
    dcp.save(model.sharded_state_dict(), checkpoint_id=folder)
    rank0_only = model.state_dict(rank0_only=True)
    assert (len(rank0_only) > 0) == (rank == 0)
    return _to_bytes(full), _to_bytes(osd), diff


def _load(rank: int, world_size: int, folder: str, full_b: bytes, osd_b: bytes) -> dict[str, float]:
    full, osd = _from_bytes(full_b), _from_bytes(osd_b)
    out: dict[str, float] = {}
    # Full state dict into another world size, strategy and wrapping, from another init.
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        model = FSDP(gpt(seed=1), sharding_strategy=strategy)
        model.load_state_dict(full)
        out[f"full/{strategy.name}"] = max_abs_diff(model.state_dict().values(), full.values())
    # Sharded folder written at another world size, read into this layout by dcp.
    model = FSDP(gpt(seed=1), auto_wrap_policy=ModuleClassPolicy((Block, nn.LayerNorm)))
    target = model.sharded_state_dict()
    dcp.load(target, checkpoint_id=folder)
    model.load_sharded_state_dict(target)
    out["sharded"] = max_abs_diff(model.state_dict().values(), full.values())
    # Optimizer state re-sharded here: consolidating it again gives back the same dict ...
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt.load_state_dict(FSDP.shard_full_optim_state_dict(osd, model, opt))
    again = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
    out["optim_roundtrip"] = max(
        max_abs_diff([again["state"][n][k]], [v]) if isinstance(v, torch.Tensor) else float(again["state"][n][k] != v)
        for n, st in osd["state"].items() for k, v in st.items()
    )
    # ... and training continues like DDP resumed from the same consolidated state.
    ref = DDP(gpt(seed=1))
    ref.module.load_state_dict(full)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    names = [n for n, _ in ref.module.named_parameters()]
    opt_ref.load_state_dict({"state": {i: osd["state"][n] for i, n in enumerate(names) if n in osd["state"]},
                             "param_groups": [{**osd["param_groups"][0], "params": list(range(len(names)))}]})
    _train(ref, opt_ref, rank, range(3, 5))
    _train(model, opt, rank, range(3, 5))
    plain = ref.module.state_dict()
    scale = max(v.abs().max().item() for v in plain.values())
    out["resumed_training"] = max_abs_diff(model.state_dict().values(), plain.values()) / scale
    return out


def test_state_dicts_and_optimizer_state_reshard_from_two_to_three_ranks(tmp_path: Path) -> None:
    saved = run_ranks(_save, 2, str(tmp_path / "ckpt"))
    full_b, osd_b, diff = saved[0]
    assert diff == 0.0, "consolidated optimizer state differs from DDP's"
    for r in (1,):
        assert _from_bytes(saved[r][0]).keys() == _from_bytes(full_b).keys()
    for out in run_ranks(_load, 3, str(tmp_path / "ckpt"), full_b, osd_b):
        exact = {k: v for k, v in out.items() if k != "resumed_training"}
        assert max(exact.values()) == 0.0, out
        assert out["resumed_training"] <= 1e-6, out


def _summon(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    ref, model = DDP(gpt()), FSDP(gpt(), auto_wrap_policy=BLOCKS)
    toks = tokens(rank, 0)
    lm_loss(ref(toks), toks).backward()
    lm_loss(model(toks), toks).backward()
    with model.summon_full_params(with_grads=True, writeback=False):
        full = dict(model.named_parameters())
        out["with_grads"] = max(max_abs_diff([full[n].grad], [p.grad]) for n, p in ref.module.named_parameters())
        out["shapes"] = float(any(full[n].shape != p.shape for n, p in ref.module.named_parameters()))
    assert all_sharded(model)
    full_shapes = model.full_parameter_shapes()
    with model.summon_full_params(recurse=False):  # only the root's own parameters are full
        own = dict(model.named_parameters())
        assert own["blocks.0.qkv.weight"].shape != full_shapes["blocks.0.qkv.weight"]
        assert own["embed.weight"].shape == full_shapes["embed.weight"] and own["pos"].shape == full_shapes["pos"]
        assert own["ln_f.weight"].shape == full_shapes["ln_f.weight"]
    with model.summon_full_params():
        model.module.blocks[1].proj.weight.data.fill_(0.5)
    with model.summon_full_params(writeback=False):
        model.module.blocks[0].proj.weight.data.fill_(0.25)
    sd = model.state_dict()
    out["writeback"] = float(not bool((sd["blocks.1.proj.weight"] == 0.5).all()))
    out["no_writeback"] = float(bool((sd["blocks.0.proj.weight"] == 0.25).any()))
    with model.summon_full_params(rank0_only=True, writeback=False, offload_to_cpu=True):
        shown_full = [p.shape == full_shapes[n] for n, p in model.named_parameters()]
        out["rank0_only"] = float(all(shown_full) != (rank == 0))
    # apply(fn) sees full parameters and writes back, like apply on the plain module.
    plain = gpt()

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.constant_(m.weight, 0.01 * m.weight.shape[0])

    plain.apply(init)
    model.apply(init)
    out["apply"] = max_abs_diff(model.state_dict().values(), plain.state_dict().values())
    return out


def test_summon_full_params_options_and_apply_behave_like_the_unsharded_module() -> None:
    for out in run_ranks(_summon, 2):
        assert max(out.values()) == 0.0, out


def _clip(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for norm_type in (2.0, 1.0, float("inf")):
        ref, model = DDP(gpt()), FSDP(gpt(), auto_wrap_policy=BLOCKS)
        opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
        worst = 0.0
        for step in range(3):
            toks = tokens(rank, step)
            for m, o in ((ref, opt_ref), (model, opt)):
                o.zero_grad()
                lm_loss(m(toks), toks).backward()
            n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
            n = model.clip_grad_norm_(0.05, norm_type)
            worst = max(worst, abs(n.item() - n_ref.item()) / n_ref.item())
            assert n_ref.item() > 0.05  # clipping is active
            opt_ref.step()
            opt.step()
        plain = ref.module.state_dict()
        scale = max(v.abs().max().item() for v in plain.values())
        out[f"norm/{norm_type}"] = worst
        out[f"params/{norm_type}"] = max_abs_diff(model.state_dict().values(), plain.values()) / scale
    return out


def test_clip_grad_norm_matches_torch_clip_on_ddp_within_1e6() -> None:
    for out in run_ranks(_clip, 3):
        assert max(out.values()) <= 1e-6, out


def _sync(rank: int, world_size: int) -> float:
    worst = 0.0
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        model = FSDP(gpt(seed=rank), sync_module_states=True, auto_wrap_policy=BLOCKS, sharding_strategy=strategy)
        worst = max(worst, max_abs_diff(model.state_dict().values(), gpt(seed=0).state_dict().values()))
    return worst


def test_sync_module_states_gives_every_rank_rank0_weights() -> None:
    assert run_ranks(_sync, 3) == [0.0, 0.0, 0.0]


def _ignored(rank: int, world_size: int) -> dict[str, float]:
    plain, core = seeded_mlp(), seeded_mlp()
    model = FSDP(core, ignored_modules=[core[4]])
    x = rank_batch(rank, 0)
    model(x).pow(2).mean().backward()
    plain(x).pow(2).mean().backward()
    return {
        "ignored_full_shape": float(core[4].weight.dim() != 2),
        "others_sharded": float(not all_sharded(model) or core[0].weight.shape == (16, 8)),
        # FSDP leaves an ignored module's gradients local (not averaged over ranks)
        "ignored_local_grad": max_abs_diff([core[4].weight.grad, core[4].bias.grad],
                                           [plain[4].weight.grad, plain[4].bias.grad]),
        "state_dict": max_abs_diff(model.state_dict().values(), plain.state_dict().values()),
    }


def test_ignored_modules_stay_unsharded_with_local_gradients() -> None:
    for out in run_ranks(_ignored, 2):
        assert max(out.values()) == 0.0, out


def _save_sharded_optim(rank: int, world_size: int, folder: str) -> tuple[bytes, bytes, dict[str, int]]:
    """Train 3 steps, write model and optimizer state with dcp, train 2 more (the uninterrupted run)."""
    model = FSDP(gpt(), auto_wrap_policy=BLOCKS)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    _train(model, opt, rank, range(3))
    state = {"model": model.sharded_state_dict(), "optim": FSDP.sharded_optim_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=folder)
    osd = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
    # elements of sharded state tensors this rank holds (and wrote), and their full sizes
    sharded = [v for st in state["optim"]["state"].values() for v in st.values() if hasattr(v, "local_shards")]
    written = {"local": sum(s.tensor.numel() for v in sharded for s in v.local_shards()),
               "full": sum(v.size().numel() for v in sharded)}
    _train(model, opt, rank, range(3, 5))
    return _to_bytes(osd), _to_bytes(model.state_dict()), written


def _load_sharded_optim(rank: int, world_size: int, folder: str, strategy: str) -> tuple[bytes, bytes]:
    """A fresh model and optimizer (other seed, other wrapping) loaded from the folder, then 2 steps."""
    model = FSDP(gpt(seed=1), auto_wrap_policy=ModuleClassPolicy((Block, nn.LayerNorm)),
                 sharding_strategy=ShardingStrategy[strategy])
    opt = torch.optim.Adam(model.parameters(), lr=5.0, eps=1.0)  # the saved hyperparameters replace these
    state = {"model": model.sharded_state_dict(), "optim": FSDP.sharded_optim_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=folder)
    model.load_sharded_state_dict(state["model"])
    FSDP.load_sharded_optim_state_dict(model, opt, state["optim"])
    osd = FSDP.full_optim_state_dict(model, opt, rank0_only=False)
    _train(model, opt, rank, range(3, 5))
    return _to_bytes(osd), _to_bytes(model.state_dict())


def test_sharded_optimizer_state_is_written_in_pieces_and_resumes_at_any_world_size(tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpt")
    saved = run_ranks(_save_sharded_optim, 2, folder)
    osd, uninterrupted = _from_bytes(saved[0][0]), _from_bytes(saved[0][1])
    # every state element is written by exactly one rank, about half by each
    written = [w for _, _, w in saved]
    assert written[0]["full"] > 0 and sum(w["local"] for w in written) == written[0]["full"], written
    assert all(w["local"] <= written[0]["full"] // 2 + 64 for w in written), written

    def same_state(other: dict[str, Any]) -> float:
        assert other["param_groups"] == osd["param_groups"]
        return max(max_abs_diff([other["state"][n][k]], [v]) if isinstance(v, torch.Tensor)
                   else float(other["state"][n][k] != v) for n, st in osd["state"].items() for k, v in st.items())

    # the same world size resumes bit for bit; 3 ranks and another strategy restore the same state
    resumed = run_ranks(_load_sharded_optim, 2, folder, "FULL_SHARD")
    assert same_state(_from_bytes(resumed[0][0])) == 0.0
    assert max_abs_diff(_from_bytes(resumed[0][1]).values(), uninterrupted.values()) == 0.0
    for strategy in ("SHARD_GRAD_OP", "NO_SHARD"):
        for loaded_b, _ in run_ranks(_load_sharded_optim, 3, folder, strategy):
            assert same_state(_from_bytes(loaded_b)) == 0.0, strategy


class _Parent(nn.Module):
    """A trainer's module holding the model (as a LightningModule holds its network)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("scale", torch.ones(()))  # the parent's own state (no gradient to sync)

    def forward(self, toks: torch.Tensor) -> torch.Tensor:
        return self.net(toks) * self.scale


def _through_a_parent(rank: int, world_size: int) -> dict[str, float]:
    out: dict[str, float] = {}
    plain = _Parent(gpt())
    ref = DDP(plain)
    wrapped = _Parent(FSDP(gpt(), auto_wrap_policy=BLOCKS))
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(wrapped.parameters(), lr=1e-2)
    _train(ref, opt_ref, rank, range(2))
    _train(wrapped, opt, rank, range(2))
    saved = wrapped.state_dict()  # what a trainer's checkpoint holds
    expected = plain.state_dict()
    out["keys"] = float(list(saved) != list(expected))
    out["values"] = max_abs_diff(saved.values(), expected.values())
    fresh_plain = _Parent(gpt(seed=3))  # the file loads into the plain model ...
    fresh_plain.load_state_dict(saved)
    out["into_plain"] = max_abs_diff(fresh_plain.state_dict().values(), expected.values())
    fresh = _Parent(FSDP(gpt(seed=3), auto_wrap_policy=BLOCKS))  # ... and into a wrapped one
    fresh.load_state_dict(saved)
    out["into_wrapped"] = max_abs_diff(fresh.state_dict().values(), expected.values())
    out["sharded_after_load"] = float(not all_sharded(fresh.net))
    _train(ref, opt_ref, rank, range(2, 3))  # and the loaded model trains on like the original
    opt_fresh = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    opt_fresh.load_state_dict(opt.state_dict())
    _train(fresh, opt_fresh, rank, range(2, 3))
    out["trains_on"] = max_abs_diff(fresh.state_dict().values(), plain.state_dict().values())
    bad = dict(saved)
    bad.pop("net.pos")
    result = _Parent(FSDP(gpt(), auto_wrap_policy=BLOCKS)).load_state_dict(bad, strict=False)
    out["missing_named"] = float(result.missing_keys != ["net.pos"])
    return out


def test_state_dict_through_a_parent_module_is_full_and_clean_and_loads_anywhere() -> None:
    for out in run_ranks(_through_a_parent, 2):
        assert max(out.values()) == 0.0, out
