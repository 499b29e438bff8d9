"""OSS state: consolidated state dicts across world sizes, clip_grad_norm, state bytes, warnings.

The state-dict tests save at 2 ranks after 3 steps and resume at 1, 2, 3 and 4 ranks and in a
plain (unsharded) torch optimizer; resumed training must match uninterrupted training (bit for
bit where the arithmetic is identical) and a torch optimizer loaded from the same dict.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import SGD, Adagrad, Adam, Optimizer

from shardopt import comm
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.clip import clip_with_fed_norm, norms_within
from tests.helpers.data import rank_batch, seeded_mlp
from tests.helpers.ddp_arithmetic import ddp_average_grads
from tests.helpers.oss import loss_fn, mixed_mlp, relative_diff

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

OPTIMS: tuple[tuple[str, type[Optimizer], dict[str, Any]], ...] = (
    ("sgd_momentum", SGD, {"lr": 0.05, "momentum": 0.9}),
    ("adam", Adam, {"lr": 1e-2, "weight_decay": 0.01}),
    ("adagrad", Adagrad, {"lr": 0.1}),
)
SAVE_AT, STEPS = 3, 6


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [{"params": params[:2], "lr": 3e-3}, {"params": params[2:]}]


def _train(model: nn.Module, opt: Optimizer, rank: int, steps: range) -> None:
    ddp = DDP(model)
    for step in steps:
        opt.zero_grad(set_to_none=step % 2 == 0)
        loss_fn(ddp, rank_batch(rank, step)).backward()
        opt.step()


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _load_weights(model: nn.Module, weights: list[torch.Tensor]) -> nn.Module:
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    return model


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal torch optimizer state dicts (tensors compared exactly)."""
    if a["param_groups"] != b["param_groups"] or sorted(a["state"]) != sorted(b["state"]):
        return False
    for i, sa in a["state"].items():
        sb = b["state"][i]
        if sorted(sa) != sorted(sb):
            return False
        for k, v in sa.items():
            if isinstance(v, torch.Tensor) and not torch.equal(v.cpu(), sb[k].cpu()):
                return False
            if not isinstance(v, torch.Tensor) and v != sb[k]:
                return False
    return True


def _save_at_two(rank: int, world_size: int) -> dict[str, Any]:
    """Train, save at step 3 by each consolidation route, resume at 2 ranks, train on."""
    out: dict[str, Any] = {}
    sent: list[tuple[int, list[int]]] = []
    real_send = comm.send_object

    def recording_send(obj: Any, dst: int, group: Any) -> None:
        sent.append((dst, sorted(key[0] for key in obj)))  # keys are (index, row start, row stop)
        real_send(obj, dst, group)

    comm.send_object = recording_send  # type: ignore[assignment]
    for name, cls, kwargs in OPTIMS:
        model = seeded_mlp()
        opt = OSS(_groups(model), optim=cls, **kwargs)
        _train(model, opt, rank, range(SAVE_AT))
        sent.clear()
        opt.consolidate_state_dict(recipient_rank=1)
        on_one = copy.deepcopy(opt.state_dict()) if rank == 1 else None
        owned = sorted(i for i in range(len(opt.params)) if opt.owns(i))
        # Rank 0 sent its own shard only, once, to the recipient; rank 1 sent nothing.
        assert sent == ([(1, owned)] if rank == 0 else []), sent
        opt.consolidate_state_dict()  # recipient 0
        if rank == 0:
            saved = copy.deepcopy(opt.state_dict())
        else:
            with pytest.raises(RuntimeError, match="has no consolidated state"):
                opt.state_dict()
        everywhere = copy.deepcopy(opt.state_dict(all_ranks=True))
        if rank == 0:
            assert _same_state(saved, everywhere)
        else:
            assert on_one is not None and _same_state(on_one, everywhere)
        weights = _weights(model)
        _train(model, opt, rank, range(SAVE_AT, STEPS))
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            opt.state_dict()  # stale after a step
        resumed = _load_weights(seeded_mlp(seed=1), weights)
        opt2 = OSS(_groups(resumed), optim=cls, **kwargs)
        opt2.load_state_dict(copy.deepcopy(everywhere))
        _train(resumed, opt2, rank, range(SAVE_AT, STEPS))
        out[name] = {
            "state": everywhere,
            "weights": weights,
            "final": _weights(model),
            "resume_diff": relative_diff(_weights(resumed), _weights(model))[0],
        }
    comm.send_object = real_send  # type: ignore[assignment]
    return out


def _resume(rank: int, world_size: int, saved: dict[str, Any]) -> dict[str, Any]:
    """Load the 2-rank checkpoint at this world size; compare with a torch optimizer loaded alike."""
    out = {}
    for name, cls, kwargs in OPTIMS:
        ckpt = saved[name]
        model = _load_weights(seeded_mlp(seed=1), ckpt["weights"])
        opt = OSS(_groups(model), optim=cls, **kwargs)
        opt.load_state_dict(copy.deepcopy(ckpt["state"]))
        round_trip = _same_state(opt.state_dict(all_ranks=True), ckpt["state"])
        ref = _load_weights(seeded_mlp(seed=2), ckpt["weights"])
        ref_opt = cls(_groups(ref), **kwargs)
        ref_opt.load_state_dict(copy.deepcopy(ckpt["state"]))
        _train(model, opt, rank, range(SAVE_AT, STEPS))
        for step in range(SAVE_AT, STEPS):
            ddp_average_grads(ref, world_size, step)
            ref_opt.step()
        out[name] = (round_trip, relative_diff(_weights(model), _weights(ref)))
    return out


def test_state_dict_saved_at_two_ranks_resumes_identically_at_1_2_3_4_ranks_and_unsharded() -> None:
    saved = run_ranks(_save_at_two, 2, timeout_s=60)
    assert _same_state(saved[0]["adam"]["state"], saved[1]["adam"]["state"])
    print("\nOSS state dict saved at 2 ranks after 3 steps, resumed for 3 more: max|diff| (relative)")
    for name, _, _ in OPTIMS:
        assert all(s[name]["resume_diff"] == 0.0 for s in saved), name
        print(f"  {name:13s} resumed at 2 ranks vs uninterrupted: 0")
    for world_size in (1, 3, 4):
        results = run_ranks(_resume, world_size, saved[0], timeout_s=60)
        for name, _, _ in OPTIMS:
            assert all(r[name][0] for r in results), f"{name}: load -> consolidate changed the state"
            diff = max(r[name][1][0] for r in results)
            rel = max(r[name][1][1] for r in results)
            print(f"  {name:13s} resumed at {world_size} ranks vs torch optimizer loaded alike: {diff:.3g} ({rel:.2g})")
            assert (diff == 0.0) if world_size == 1 else (rel <= 1e-6), (name, world_size, diff, rel)
    # The plain torch optimizer continues from the dict exactly as OSS at 2 ranks did.
    for name, cls, kwargs in OPTIMS:
        ckpt = saved[0][name]
        model = _load_weights(seeded_mlp(), ckpt["weights"])
        opt = cls(_groups(model), **kwargs)
        opt.load_state_dict(copy.deepcopy(ckpt["state"]))
        for step in range(SAVE_AT, STEPS):
            ddp_average_grads(model, 2, step)
            opt.step()
        assert relative_diff(_weights(model), ckpt["final"])[0] == 0.0, name


def _clip(rank: int, world_size: int) -> list[dict[str, Any]]:
    """OSS.clip_grad_norm against torch.nn.utils.clip_grad_norm_ on the full (DDP) grads, with
    the default plan (which splits seeded_mlp()'s 32 x 16 weight from 2 ranks up) and with
    every parameter whole. The reference is torch's clip of the full grads by OSS's total
    (Note [fed clip norms] in tests/helpers/clip.py); torch's own total is returned beside it."""
    rows = []
    configs = [
        (seeded_mlp, 2.0, 0.05, None),
        (seeded_mlp, 2.0, 1e3, None),  # no clipping: grads unchanged
        (seeded_mlp, math.inf, 0.01, None),
        (seeded_mlp, 2.0, 0.05, lambda ps: [p for p in ps if p.dim() > 1]),
        (seeded_mlp, math.inf, 0.01, lambda ps: [p for p in ps if p.dim() > 1]),
        (mixed_mlp, 2.0, 0.05, None),
    ]
    for make, norm_type, max_norm, filter_fn in configs:
        for split_large_params in (None, False):
            model, ref = make(), make()
            opt = OSS(model.parameters(), optim=SGD, lr=0.1, split_large_params=split_large_params)
            ddp = DDP(model)  # kept alive: the reducer must exist through backward
            loss_fn(ddp, rank_batch(rank, 0)).backward()
            for p, q in zip(model.parameters(), ref.parameters(), strict=True):
                q.grad = p.grad.clone()  # type: ignore[union-attr]
            counted = [q for q in ref.parameters() if filter_fn is None or q.dim() > 1]
            expected = torch.nn.utils.get_total_norm([q.grad for q in counted if q.grad is not None], norm_type)
            total = opt.clip_grad_norm(max_norm, norm_type=norm_type, filter_params_fn=filter_fn)
            clip_with_fed_norm(counted, max_norm, total)
            owned = [(p, q, opt.owned_rows(p)) for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters(), strict=True))
                     if opt.owns(i) and (filter_fn is None or p.dim() > 1)]
            # An owner scales the rows it owns (all of a whole parameter's); the others scale theirs.
            grad_diff = max((float((p.grad[a:b] - q.grad[a:b]).abs().max()) for p, q, (a, b) in owned),  # type: ignore[index]
                            default=0.0)
            names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
            rows.append({"label": f"{make.__name__} p={norm_type} max_norm={max_norm} filtered={filter_fn is not None} "
                                  f"split_large_params={split_large_params}",
                         "split": [names[opt.params[i]] for i in opt.plan.split_params], "norm_type": norm_type,
                         "numel": sum(q.numel() for q in counted), "expected": float(expected), "total": float(total),
                         "grad_diff": grad_diff})
    return rows


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_clip_grad_norm_equals_torch_on_full_grads(world_size: int) -> None:
    results = run_ranks(_clip, world_size, timeout_s=60)
    print(f"\nclip_grad_norm at {world_size} ranks: split, |total - torch| / torch, max|clipped grad - torch|")
    for rows in results:
        # From 2 ranks up the default plan splits the 32 x 16 weight (a rank's share is 410 of 820 elements).
        assert any(row["split"] == ["2.weight"] for row in rows) == (world_size > 1), rows
        for row in rows:
            # The clip scales exactly as torch's by the same total (the rest of the arithmetic is torch's).
            assert row["grad_diff"] == 0.0, row
            if row["split"] and row["norm_type"] != math.inf:
                # A split parameter's norm is the norm of its blocks' norms: torch's within its
                # summation error (Note [fed clip norms]); a max of maxes stays exact.
                assert norms_within([(row["expected"], row["total"])], row["numel"]), row
            else:  # nothing split: torch's total bit for bit
                assert row["total"] == row["expected"], row
    for row in results[0]:
        rel = abs(row["total"] - row["expected"]) / row["expected"]
        print(f"  {row['label']:76s} {row['split']} {rel:.2g} {row['grad_diff']:.3g}")


def _state_bytes(rank: int, world_size: int) -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 48), nn.Linear(48, 48), nn.Linear(48, 10))
    opt = OSS(model.parameters(), optim=Adam, lr=1e-3)
    full = Adam(copy.deepcopy(model).parameters(), lr=1e-3)
    for o, m in ((opt, model), (full, full.param_groups[0]["params"])):
        for p in (m.parameters() if isinstance(m, nn.Module) else m):
            p.grad = torch.ones_like(p)
        o.step()

    def nbytes(state: dict[Any, dict[str, Any]]) -> list[int]:
        # Per-element state only: every block of a split parameter keeps its own 0-dim ``step``.
        return [sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor) and v.dim())
                for s in state.values()]

    return sum(nbytes(opt.optim.state)), sum(nbytes(full.state)), max(nbytes(full.state))


def test_per_rank_state_bytes_at_most_full_over_n_plus_largest_param() -> None:
    print("\nAdam state bytes per rank: (this rank, bound = full/N + largest param's state)")
    for world_size in (2, 3, 4):
        results = run_ranks(_state_bytes, world_size, timeout_s=60)
        full, largest = results[0][1], results[0][2]
        bound = full / world_size + largest
        mine = [r[0] for r in results]
        print(f"  N={world_size}: per rank {mine}, full {full}, bound {bound:.0f}")
        assert sum(mine) == full  # every parameter's state lives on exactly one rank
        assert max(mine) <= bound, (mine, bound)


def _hyper_and_warnings(rank: int, world_size: int) -> dict[str, Any]:
    model = seeded_mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            OSS(model.parameters(), optim=SGD, lr=0.1, broadcast_buffer_size=2**20, force_broadcast_object=True)
    messages = [str(w.message) for w in caught]
    opt = OSS(model.parameters(), optim=Adam, lr=1e-3)
    return {
        "messages": messages,
        "betas_before_step": opt.param_groups[0].get("betas"),
        "defaults_lr": opt.defaults.get("lr"),
    }


def test_deprecated_kwargs_warn_once_and_optimizer_defaults_are_visible() -> None:
    (result,) = run_ranks(_hyper_and_warnings, 1, timeout_s=60)
    messages = result["messages"]
    assert len(messages) == 2, messages  # one per deprecated kwarg, not one per construction
    assert any("broadcast_buffer_size=1048576) is deprecated and ignored" in m for m in messages)
    assert any("force_broadcast_object=True) is deprecated and ignored" in m for m in messages)
    assert result["betas_before_step"] == (0.9, 0.999)  # the shard optimizer's defaults, pulled back
    assert result["defaults_lr"] == 1e-3


def _migration(rank: int, world_size: int) -> dict[str, Any]:
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=Adam, lr=1e-2)
    _train(model, opt, rank, range(2))
    before = copy.deepcopy(opt.state_dict(all_ranks=True))
    owners_before = opt.partition.owners
    biggest = max(range(len(opt.params)), key=lambda i: opt.params[i].numel())
    opt.params[biggest].requires_grad_(False)
    opt.params[biggest].grad = None
    opt.refresh_trainable()
    frozen = copy.deepcopy(opt.state_dict(all_ranks=True))
    owners_frozen = opt.partition.owners
    opt.params[biggest].requires_grad_(True)
    opt.refresh_trainable()
    thawed = copy.deepcopy(opt.state_dict(all_ranks=True))
    extra = nn.Linear(4, 3)
    opt.add_param_group({"params": list(extra.parameters()), "lr": 1e-3})
    added = copy.deepcopy(opt.state_dict(all_ranks=True))
    return {
        "moved": sum(a != b for a, b in zip(owners_before, owners_frozen)),
        "frozen_same": _same_state(before, frozen),
        "thawed_same": _same_state(before, thawed),
        "added_keeps_old": all(_same_state({"state": {i: s}, "param_groups": []},
                                           {"state": {i: added["state"][i]}, "param_groups": []})
                               for i, s in before["state"].items()),
        "added_groups": len(added["param_groups"]),
    }


def test_state_follows_parameters_when_ownership_moves() -> None:
    for world_size in (2, 3):
        for r in run_ranks(_migration, world_size, timeout_s=60):
            assert r["moved"] > 0, "the test must move at least one parameter to another rank"
            assert r["frozen_same"] and r["thawed_same"] and r["added_keeps_old"], r
            assert r["added_groups"] == 2


def _freshness(rank: int, world_size: int) -> dict[str, Any]:
    """Note [snapshot freshness]: hyperparameters read at state_dict() time, a step or a
    changed parameter refuses the snapshot."""
    out: dict[str, Any] = {}
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=2e-3)
    opt.consolidate_state_dict(recipient_rank=-1)  # before the scheduler exists
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 2))  # warm-up from 0
    out["lr_seen"] = opt.state_dict()["param_groups"][0]["lr"]
    opt.load_state_dict(opt.state_dict())  # Accelerate's prepare round trip
    out["lr_after_round_trip"] = opt.param_groups[0]["lr"]
    _train(model, opt, rank, range(1))
    try:
        opt.state_dict()
        out["after_step"] = ""
    except RuntimeError as e:
        out["after_step"] = str(e)
    low = seeded_mlp(dtype=torch.bfloat16)
    masters = OSS(low.parameters(), optim=torch.optim.AdamW, lr=2e-3, master_dtype=torch.float32)
    low(rank_batch(rank, 0).to(torch.bfloat16)).sum().backward()
    masters.step()
    masters.consolidate_state_dict(recipient_rank=-1)
    with torch.no_grad():
        for p in low.parameters():
            p.copy_(p.clone())  # the same values (as DDP's broadcast at construction)
    out["same_values_ok"] = bool(masters.state_dict()["state"])
    with torch.no_grad():
        next(iter(low.parameters())).add_(1.0)  # a weight load after the consolidation
    try:
        masters.state_dict()
        out["written"] = ""
    except RuntimeError as e:
        out["written"] = str(e)
    return out


def test_state_dict_reads_hyperparameters_now_and_refuses_a_snapshot_older_than_a_step_or_a_weight_write() -> None:
    for out in run_ranks(_freshness, 2):
        assert out["lr_seen"] == 0.0 and out["lr_after_round_trip"] == 0.0, out
        assert "has no consolidated state (step() ran after the last consolidate_state_dict()): call " \
            "optimizer.consolidate_state_dict" in out["after_step"], out
        assert out["same_values_ok"], out
        assert "parameter 0 was written after consolidate_state_dict()" in out["written"], out
        assert "call optimizer.consolidate_state_dict(recipient_rank) on every rank again" in out["written"], out
