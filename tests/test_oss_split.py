"""OSS with large parameters split into row blocks: ZeRO-1 parity, state, errors.

The model is a small language model with a large untied embedding and head (each about half
the model), so at 2-4 ranks the plan cuts them into row blocks owned by several ranks. Under
DDP every rank holds the same averaged gradient, so a split OSS steps each element with the
same arithmetic as the plain torch optimizer over the whole tensor, provided every cut is
aligned for torch's vectorized kernels (Note [aligned cuts] in shardopt.partition): the
parameters must equal DDP's bit for bit at every world size, for every elementwise optimizer
in its for-loop, foreach and fused forms.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt import checkpoint
from shardopt.optim import OSS
from shardopt.testing import run_ranks

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

VOCAB, DIM, STEPS = 384, 64, 4


def _lm(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, VOCAB)).to(dtype)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (8,), generator=g), torch.randint(0, VOCAB, (8,), generator=g)


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return nn.functional.cross_entropy(model(x).float(), y)


def _train(models: list[nn.Module], opts: list[torch.optim.Optimizer], rank: int, steps: range) -> None:
    for step in steps:
        for m, o in zip(models, opts, strict=True):
            o.zero_grad(set_to_none=step % 2 == 0)
            _loss(m, rank, step).backward()
            o.step()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach().float() - q.detach().float()).abs().max()) for p, q in zip(a.parameters(), b.parameters(),
                                                                                          strict=True))


OPTIMIZERS: list[tuple[str, type[torch.optim.Optimizer], dict[str, Any]]] = [
    ("adam", torch.optim.Adam, {"lr": 1e-2, "foreach": False}),
    ("adam-foreach", torch.optim.Adam, {"lr": 1e-2, "foreach": True}),
    ("adam-fused", torch.optim.Adam, {"lr": 1e-2, "fused": True}),
    ("adamw-foreach", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    ("adamw-fused", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    ("sgd-momentum", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": False}),
    ("sgd-momentum-foreach", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "foreach": True}),
    ("sgd-momentum-fused", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
    ("rmsprop", torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.9}),
    ("adagrad", torch.optim.Adagrad, {"lr": 1e-2}),
]


def _zero1_parity(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, cls, kwargs in OPTIMIZERS:
        ref, split, whole = _lm(), _lm(), _lm()
        ddp_ref, ddp_split, ddp_whole = DDP(ref), DDP(split), DDP(whole)
        opts = [cls(ref.parameters(), **kwargs), OSS(split.parameters(), optim=cls, **kwargs),
                OSS(whole.parameters(), optim=cls, split_large_params=False, **kwargs)]
        _train([ddp_ref, ddp_split, ddp_whole], opts, rank, range(STEPS))
        oss = opts[1]
        assert isinstance(oss, OSS)
        out[name] = {"split": oss.plan.split_params, "vs_ddp": _max_diff(split, ref), "whole_vs_ddp": _max_diff(whole, ref),
                     "state_bytes": sum(v.numel() * v.element_size() for s in oss.optim.state.values()
                                        for v in s.values() if isinstance(v, torch.Tensor) and v.dim())}
        del ddp_ref, ddp_split, ddp_whole
    # bf16 parameters with fp32 masters: the split run equals the unsplit one bit for bit (the
    # unsplit one is checked against references in test_oss_masters.py).
    split, whole = _lm(dtype=torch.bfloat16), _lm(dtype=torch.bfloat16)
    ddp_split, ddp_whole = DDP(split), DDP(whole)
    opts = [OSS(split.parameters(), optim=torch.optim.AdamW, lr=1e-2, master_dtype=torch.float32),
            OSS(whole.parameters(), optim=torch.optim.AdamW, lr=1e-2, master_dtype=torch.float32, split_large_params=False)]
    _train([ddp_split, ddp_whole], opts, rank, range(STEPS))
    masters = opts[0]
    assert isinstance(masters, OSS)
    out["bf16-masters"] = {"split": masters.plan.split_params, "vs_whole": _max_diff(split, whole),
                           "master_rows": [tuple(masters.master_of(p).shape) for p in split.parameters()  # type: ignore[union-attr]
                                           if masters.master_of(p) is not None]}
    del ddp_split, ddp_whole
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zero1_with_split_parameters_equals_ddp_bit_for_bit(world_size: int) -> None:
    results = run_ranks(_zero1_parity, world_size, timeout_s=120)
    for rank, r in enumerate(results):
        for name, rec in r.items():
            assert rec["split"], (name, "the plan should cut the embedding and/or head at this world size")
            if name == "bf16-masters":
                assert rec["vs_whole"] == 0.0, (rank, name, rec)
                continue
            assert rec["vs_ddp"] == 0.0 and rec["whole_vs_ddp"] == 0.0, (world_size, rank, name, rec)
    # Balance: every rank's per-element state is within one cut quantum (one row here) of the mean.
    for name, _, _ in OPTIMIZERS:
        loads = [r[name]["state_bytes"] for r in results]
        # The plan promises the heaviest rank within mean + R in parameter bytes, R = one cut quantum
        # (one 64-wide row of the embedding or head here); per-element state is the same number of
        # bytes per parameter element for every parameter, so the same bound holds for it.
        numel = sum(p.numel() for p in _lm().parameters())
        one_row = sum(loads) / numel * DIM
        assert max(loads) <= sum(loads) / world_size + one_row, (name, loads, one_row)


def _state_and_checkpoints(rank: int, world_size: int, folder: str, split: bool = True) -> dict[str, Any]:
    """Save (split or not) at ``world_size``: consolidated and sharded; reload elsewhere in the test."""
    model = _lm()
    ddp = DDP(model)
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1, split_large_params=split)
    _train([ddp], [opt], rank, range(STEPS))
    opt.consolidate_state_dict(recipient_rank=0)
    full = opt.state_dict() if rank == 0 else None
    checkpoint.save_sharded(f"{folder}/sharded", model, opt)
    checkpoint.save_consolidated(f"{folder}/consolidated.pt", model, opt)
    del ddp
    return {"split": opt.plan.split_params, "full": full}


def _resume(rank: int, world_size: int, folder: str, how: str, split: bool) -> dict[str, Any]:
    """Load at this world size (split or not) and train on; compare with a plain torch AdamW
    that loaded the consolidated state dict."""
    model, ref = _lm(seed=5), _lm(seed=6)
    ddp, ddp_ref = DDP(model), DDP(ref)
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1, split_large_params=split)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    blob = torch.load(f"{folder}/consolidated.pt", weights_only=False)
    ref.load_state_dict(blob["model"])
    torch_opt.load_state_dict(blob["optimizer"])
    if how == "sharded":
        checkpoint.load_sharded(f"{folder}/sharded", model, opt)
    else:
        checkpoint.load_consolidated(f"{folder}/consolidated.pt", model, opt)
    _train([ddp, ddp_ref], [opt, torch_opt], rank, range(STEPS, STEPS + 3))
    opt.consolidate_state_dict(recipient_rank=0)
    state = opt.state_dict() if rank == 0 else None
    same_state = state is None or all(
        torch.equal(state["state"][i][k], torch_opt.state_dict()["state"][i][k]) for i in state["state"]
        for k in state["state"][i])
    del ddp, ddp_ref
    return {"diff": _max_diff(model, ref), "split": opt.plan.split_params, "same_state": same_state}


def test_split_state_consolidates_to_torch_format_and_reloads_at_any_world_size_split_or_not(tmp_path: Any) -> None:
    saved = run_ranks(_state_and_checkpoints, 2, str(tmp_path), timeout_s=120)
    assert saved[0]["split"], "the plan should cut a parameter at 2 ranks"
    full = saved[0]["full"]
    # torch.optim's format: whole parameters' state, loadable by the plain optimizer.
    plain = torch.optim.AdamW(_lm().parameters(), lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(copy.deepcopy(full))
    shapes = [tuple(p.shape) for p in _lm().parameters()]
    assert [tuple(full["state"][i]["exp_avg"].shape) for i in range(len(shapes))] == shapes
    for world_size, how, split in [(1, "sharded", True), (3, "sharded", True), (2, "sharded", False),
                                   (3, "consolidated", True), (4, "sharded", True)]:
        results = run_ranks(_resume, world_size, str(tmp_path), how, split, timeout_s=120)
        for rank, r in enumerate(results):
            assert r["diff"] == 0.0 and r["same_state"], (world_size, how, split, rank, r)
    # A checkpoint of whole parameters (every checkpoint written before split ownership existed has
    # this layout: keys "<index>.<name>") loads into split OSS at another world size.
    whole = run_ranks(_state_and_checkpoints, 2, str(tmp_path), False, timeout_s=120)
    assert whole[0]["split"] == ()
    for rank, r in enumerate(run_ranks(_resume, 3, str(tmp_path), "sharded", True, timeout_s=120)):
        assert r["split"] and r["diff"] == 0.0 and r["same_state"], (rank, r)


def _freeze_and_groups(rank: int, world_size: int) -> dict[str, Any]:
    """Freeze the split head mid-training, unfreeze it, add a param group: equal to DDP + torch."""
    model, ref = _lm(), _lm()
    opt = OSS([{"params": list(model.parameters())[:3]}], optim=torch.optim.Adam, lr=1e-2)
    torch_opt = torch.optim.Adam([{"params": list(ref.parameters())[:3]}], lr=1e-2)
    ddp, ddp_ref = DDP(model), DDP(ref)
    out: dict[str, Any] = {}
    _train([ddp, ddp_ref], [opt, torch_opt], rank, range(2))
    for o, m in ((opt, model), (torch_opt, ref)):
        o.add_param_group({"params": list(m.parameters())[3:], "lr": 5e-3})
    out["split_after_add"] = opt.plan.split_params
    _train([ddp, ddp_ref], [opt, torch_opt], rank, range(2, 4))
    k = opt.plan.split_params[0]  # freeze a parameter that is split now
    frozen = [list(model.parameters())[k], list(ref.parameters())[k]]
    for p in frozen:
        p.requires_grad_(False)
    del ddp, ddp_ref
    ddp, ddp_ref = DDP(model), DDP(ref)  # DDP must be rebuilt when trainability changes
    opt.refresh_trainable()
    out["frozen_blocks"] = len(opt.plan.blocks_of(k))
    _train([ddp, ddp_ref], [opt, torch_opt], rank, range(4, 6))
    for p in frozen:
        p.requires_grad_(True)
    del ddp, ddp_ref
    ddp, ddp_ref = DDP(model), DDP(ref)
    opt.refresh_trainable()
    out["split_unfrozen"] = opt.plan.split_params
    _train([ddp, ddp_ref], [opt, torch_opt], rank, range(6, 8))
    out["diff"] = _max_diff(model, ref)
    opt.consolidate_state_dict(recipient_rank=-1)
    state = opt.state_dict()
    out["same_state"] = all(torch.equal(state["state"][i][k], torch_opt.state_dict()["state"][i][k])
                            for i in state["state"] for k in state["state"][i])
    del ddp, ddp_ref
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_freezing_unfreezing_and_adding_groups_move_split_state_and_match_torch(world_size: int) -> None:
    for rank, r in enumerate(run_ranks(_freeze_and_groups, world_size, timeout_s=120)):
        assert r["split_after_add"], r
        assert r["frozen_blocks"] == 1, r  # frozen: whole, its state parked on one owner
        assert r["split_unfrozen"] == r["split_after_add"], r  # trainable again: split again, state cut back
        assert r["diff"] == 0.0 and r["same_state"], (rank, r)


def _clip(rank: int, world_size: int) -> list[tuple[str, float, float, float]]:
    rows = []
    for norm_type, max_norm in ((2.0, 0.05), (math.inf, 0.01), (1.0, 0.5)):
        model, ref = _lm(), _lm()
        ddp = DDP(model)
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        _loss(ddp, rank, 0).backward()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            q.grad = p.grad.clone()  # type: ignore[union-attr]
        expected = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm, norm_type=norm_type)
        total = opt.clip_grad_norm(max_norm, norm_type=norm_type)
        diffs = [float((p.grad[a:b] - q.grad[a:b]).abs().max())  # type: ignore[index]
                 for p, q in zip(model.parameters(), ref.parameters(), strict=True)
                 if (rows_ := opt.owned_rows(p)) is not None for a, b in [rows_]]
        rows.append((str(norm_type), float(expected), float(total), max(diffs, default=0.0)))
        del ddp
    return rows


def test_clip_grad_norm_with_split_parameters_counts_every_element_once() -> None:
    for rank, rows in enumerate(run_ranks(_clip, 3, timeout_s=60)):
        for norm_type, expected, total, grad_diff in rows:
            if norm_type == "inf":  # a max of maxes: exact
                assert total == expected and grad_diff == 0.0, (rank, norm_type, expected, total, grad_diff)
                continue
            # A split parameter's norm is the norm of its blocks' norms, not torch's one kernel over
            # the whole tensor: the same sum of |g|^p in another order. Each partial sum is within
            # n * eps of exact (n = elements, eps = 2**-24 for fp32) and so is the total, so the
            # relative difference is below 2 * 1e5 * 6e-8 ~ 1.2e-2 in the worst case; in practice
            # rounding errors cancel and it is ~1e-7. We bound at 1e-5, far below any clip effect.
            assert abs(total - expected) <= 1e-5 * expected, (rank, norm_type, expected, total)
            assert grad_diff <= 1e-5 * max(abs(expected), 1.0), (rank, norm_type, grad_diff)


def _errors(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _lm()
    for name, kwargs in (("matrix-wise", {"optim": torch.optim.Adafactor, "split_large_params": True}),
                         ("not-bool", {"optim": torch.optim.Adam, "split_large_params": "yes"})):
        try:
            OSS(model.parameters(), **kwargs)  # type: ignore[arg-type]
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3, split_large_params=False)
        out["unbalanced_warning"] = [str(w.message) for w in caught if "heaviest rank" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3)
        out["split_warning"] = [str(w.message) for w in caught if "heaviest rank" in str(w.message)]
    out["split_default"] = split.split_large_params
    try:  # torch's Muon refuses 1-D parameters: only their owners build it over one
        OSS(model.parameters(), optim=torch.optim.Muon, lr=0.02)
        out["muon-1d"] = "no error"
    except ValueError as exc:
        out["muon-1d"] = str(exc)
    out["adafactor_default"] = OSS(model.parameters(), optim=torch.optim.Adafactor).split_large_params
    return out


def test_split_arguments_are_checked_and_an_unbalanced_whole_plan_warns_naming_the_parameter() -> None:
    for r in run_ranks(_errors, 4, timeout_s=60):
        assert r["matrix-wise"].startswith("ValueError: OSS(split_large_params=True) with optim=Adafactor"), r["matrix-wise"]
        assert "leave split_large_params=None" in r["matrix-wise"]
        assert r["not-bool"].startswith("TypeError: split_large_params must be None, True or False, got 'yes'")
        assert len(r["unbalanced_warning"]) == 1 and re.search(r"parameter [03] \(shape \(384, 64\)", r["unbalanced_warning"][0]), r
        assert "split_large_params=False" in r["unbalanced_warning"][0]
        assert r["split_warning"] == [] and r["split_default"] is True and r["adafactor_default"] is False
        # every rank raises, naming the rank whose parameters Muon refused (not "rank N left" later)
        assert re.match(r"OSS: building Muon over the parameters each rank owns failed on rank\(s\) \[.*\]; on rank \d: "
                        "ValueError: Muon only supports 2D parameters", r["muon-1d"]), r["muon-1d"]


def test_state_fragments_cut_and_join_by_rows_and_refuse_gaps() -> None:
    from shardopt.optim import sharded_entries
    from shardopt.optim.state_transport import assemble, cut_rows, join_rows

    whole = {"exp_avg": torch.arange(12.0).reshape(6, 2), "step": torch.tensor(3.0)}
    top, bottom = cut_rows(whole, (0, 6), (0, 2)), cut_rows(whole, (0, 6), (2, 6))
    assert torch.equal(top["exp_avg"], whole["exp_avg"][:2]) and top["step"] is whole["step"]  # 0-dim: shared
    rows, joined = join_rows([((2, 6), bottom), ((0, 2), top)], 0)
    assert rows == (0, 6) and torch.equal(joined["exp_avg"], whole["exp_avg"])
    assert cut_rows(whole, (0, 6), (0, 6)) == whole  # a whole fragment passes unchanged
    with pytest.raises(ValueError, match=r"state fragments of parameter 0 do not join: rows \(0, 2\) then \(3, 6\)"):
        join_rows([((0, 2), top), ((3, 6), cut_rows(whole, (0, 6), (3, 6)))], 0)
    # a rank owning rows 1..5 from blocks 0..2 and 2..6: cut and joined to exactly its rows
    got = assemble([(0, (0, 2), top), (0, (2, 6), bottom)], {0: (1, 5)})
    assert torch.equal(got[0]["exp_avg"], whole["exp_avg"][1:5])
    with pytest.raises(ValueError, match=r"covers rows \(1, 2\), not the rows \(1, 5\)"):
        assemble([(0, (0, 2), top)], {0: (1, 5)})
    # sharded checkpoint keys: a gap in the saved fragments is refused before anything is read
    saved = {"0@0-2.exp_avg": (torch.Size([2, 2]), torch.float32), "0@3-6.exp_avg": (torch.Size([3, 2]), torch.float32)}
    with pytest.raises(ValueError, match=r"does not cover rows \[2, 3\) that this rank owns.*Nothing was loaded"):
        sharded_entries.template(saved, {0: (0, 6)}, (6,), {0: torch.device("cpu")})
    # a block's saved shape is checked against its rows before anything is read
    from shardopt.state_checks import check_indexed_state
    adam = torch.optim.Adam([nn.Parameter(torch.zeros(6, 2))])
    block = {"0@0-2.exp_avg": (torch.Size([2, 2]), torch.float32), "0@0-2.step": (torch.Size([]), torch.float32)}
    check_indexed_state("c", adam, [torch.Size([6, 2])], {"group_sizes": [1]}, block)
    with pytest.raises(ValueError, match=r"of rows \[0, 2\) of parameter 0 has shape \(2, 3\) in the checkpoint but those "
                                         r"rows have \(2, 2\).*Nothing was loaded"):
        check_indexed_state("c", adam, [torch.Size([6, 2])], {"group_sizes": [1]},
                            {"0@0-2.exp_avg": (torch.Size([2, 3]), torch.float32)})
    with pytest.raises(ValueError, match=r"saved for rows \[4, 9\) of parameter 0, which the optimizer does not have"):
        check_indexed_state("c", adam, [torch.Size([6, 2])], {"group_sizes": [1]},
                            {"0@4-9.exp_avg": (torch.Size([5, 2]), torch.float32)})
    whole_key = {"0.exp_avg": (torch.Size([6, 2]), torch.float32)}  # written before splitting existed
    assert list(sharded_entries.template(whole_key, {0: (2, 4)}, (6,), {0: torch.device("cpu")})) == ["0.exp_avg"]
