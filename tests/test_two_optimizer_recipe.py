"""The two-optimizer recipe: one ShardedDataParallel over two OSS, Muon for the hidden matrices
and AdamW for the rest (docs/partition.md), against DDP running the same two torch
optimizers over the same split.

Every configuration trains a small untied GPT (embedding, positional table, two blocks of
Linear weights with biases and LayerNorms, final norm, head) for 6 steps on different tokens
per rank, clipping by torch's ``clip_grad_norm_`` over all the model's parameters (the global
norm across both optimizers), saving both optimizers' consolidated state after step 3 and
resuming from it into a fresh model, fresh OSS and a fresh ShardedDataParallel. At 2 ranks
the arithmetic is DDP's (``a * 0.5 + b * 0.5`` in either order, each parameter stepped whole
by the same torch optimizer), so parameters, clip norms and state must be equal bit for bit.
The exception is the wide model clipped over all its parameters: AdamW's plan splits its
embedding, whose norm is then the norm of its blocks' norms, torch's within its summation
error only, and one ulp of the clip coefficient moves the parameters by ~3e-3 after 6 steps
(measured by perturbing it). There DDP clips by the sharded run's own totals (Note [fed clip
norms] in tests/helpers/clip.py), so parameters and state are still equal bit for bit, and
the totals are compared with torch's within ``total_norm_rtol``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler, split_hidden_matrices
from shardopt.testing import run_ranks
from tests.helpers.clip import clip_with_fed_norm, total_norm_rtol
from tests.helpers.data import max_abs_diff
from tests.helpers.gpt import gpt, lm_loss, tokens

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

STEPS = 6
RESUME_AFTER = 3
MAX_NORM = 0.5
MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.01}
ADAMW = {"lr": 3e-3, "weight_decay": 0.01}

# reduce_buffer_size, clip ("model": torch's clip over model.parameters(); "each": one clip per
# optimizer, OSS.clip_grad_norm against torch's clip over that optimizer's parameters), scaler
CONFIGS: tuple[tuple[int, str, bool, bool], ...] = ((2**23, "model", False, False), (0, "model", True, False),
                                                   (100, "each", False, False), (2**23, "none", False, True),
                                                   (2**23, "model", False, True))
# the last element: a wide model (vocabulary 512, width 64, head tied to the embedding) whose
# embedding AdamW's plan splits into row blocks at 2 ranks (Muon's matrices stay whole); the narrow one splits nothing
# (its 12-wide rows are far from 64-element cuts, Note [aligned cuts]).
WIDE = {"vocab": 512, "dim": 64, "tied": True}  # tied: one dominant AdamW tensor, which 2 ranks must share


def _torch_pair(model: nn.Module) -> list[torch.optim.Optimizer]:
    matrices, others = split_hidden_matrices(model, non_hidden=model.head)
    return [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(others, **ADAMW)]


def _sharded_pair(model: nn.Module) -> list[OSS]:
    matrices, others = split_hidden_matrices(model, non_hidden=model.head)
    return [OSS(matrices, optim=torch.optim.Muon, **MUON), OSS(others, optim=torch.optim.AdamW, **ADAMW)]


def _state_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |difference| between two torch.optim state dicts' tensors (inf if the entries differ)."""
    if a["state"].keys() != b["state"].keys() or any(a["state"][i].keys() != b["state"][i].keys() for i in a["state"]):
        return float("inf")
    return max((max_abs_diff([x], [b["state"][i][k]]) for i in a["state"] for k, x in a["state"][i].items()),
               default=0.0)


def _recipe_rank(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    results = {}
    for cap, clip, scaled, wide in CONFIGS:
        shape: dict[str, Any] = WIDE if wide else {"tied": False}
        ddp_model, model = gpt(**shape), gpt(**shape)
        ddp, ddp_opts = DDP(ddp_model), _torch_pair(ddp_model)
        opts = _sharded_pair(model)
        sdp = ShardedDataParallel(model, opts, reduce_buffer_size=cap)
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=scaled)
        scaler = ShardedGradScaler(init_scale=2.0**8, enabled=scaled, device="cpu")
        norm_diff, state_diff, clipped = 0.0, 0.0, 0
        sdp_norms: list[torch.Tensor] = []  # this step's, set before the DDP reference clips
        for step in range(STEPS):
            if step == RESUME_AFTER:  # save both optimizers' state, resume into fresh objects
                saved = [o.state_dict(all_ranks=True) for o in opts]
                state_diff = max(_state_diff(s, o.state_dict()) for s, o in zip(saved, ddp_opts, strict=True))
                weights = {k: v.clone() for k, v in model.state_dict().items()}
                sdp.close()
                model = gpt(seed=1, **shape)
                model.load_state_dict(weights)
                opts = _sharded_pair(model)
                for o, s in zip(opts, saved, strict=True):
                    o.load_state_dict(s)
                sdp = ShardedDataParallel(model, opts, reduce_buffer_size=cap)
            toks = tokens(rank, step)
            for wrapper, optimizers, s in ((sdp, opts, scaler), (ddp, ddp_opts, ref_scaler)):
                if step % 2 == 0 and wrapper is sdp:
                    sdp.zero_grad(set_to_none=step % 4 == 0)
                else:
                    for o in optimizers:
                        o.zero_grad(set_to_none=step % 4 == 1)
                s.scale(lm_loss(wrapper(toks), toks)).backward()
                for o in optimizers:
                    s.unscale_(o)
                if clip == "none":
                    norms = [torch.zeros(())]
                elif clip == "model" and wrapper is ddp and wide:  # torch's total; clip by the sharded one
                    norms = [torch.nn.utils.get_total_norm([p.grad for p in ddp_model.parameters() if p.grad is not None])]
                    clip_with_fed_norm(ddp_model.parameters(), MAX_NORM, sdp_norms[0])
                elif clip == "model":
                    norms = [torch.nn.utils.clip_grad_norm_(wrapper.module.parameters(), MAX_NORM)]
                elif wrapper is sdp:
                    norms = [o.clip_grad_norm(MAX_NORM) for o in opts]
                else:
                    norms = [torch.nn.utils.clip_grad_norm_(o.param_groups[0]["params"], MAX_NORM) for o in optimizers]
                if wrapper is sdp:
                    sdp_norms = norms
                else:
                    norm_diff = max([norm_diff] + [abs(float(a) - float(b)) / (float(b) or 1.0)  # clip none: 0
                                                   for a, b in zip(sdp_norms, norms, strict=True)])
                    clipped += sum(float(n) > MAX_NORM for n in norms)
                for o in optimizers:
                    s.step(o)
                s.update()
        key = f"cap={cap}/clip={clip}/scaler={scaled}" + ("/wide" if wide else "")
        results[key] = {
            "adamw_split": float(len(opts[1].plan.split_params)),
            "params_vs_ddp": max_abs_diff(model.parameters(), ddp_model.parameters()),
            "clip_norms_vs_ddp": norm_diff,  # relative
            "numel": float(sum(p.numel() for p in model.parameters())),
            "state_at_save_vs_ddp": state_diff,
            "final_state_vs_ddp": max(_state_diff(o.state_dict(all_ranks=True), d.state_dict())
                                      for o, d in zip(opts, ddp_opts, strict=True)),
            "clipped_steps": clipped,
            "scale": scaler.get_scale() if scaled else 0.0,
            "ref_scale": ref_scaler.get_scale() if scaled else 0.0,
        }
        sdp.close()
    results["owned_numel"] = {f"{name}_rank{rank}": sum(p.numel() for i, p in enumerate(o.params) if o.owns(i))
                              for name, o in zip(("muon", "adamw"), opts, strict=True)}
    return results


def test_muon_and_adamw_under_one_sharded_ddp_match_ddp_bit_for_bit_with_clipping_and_resume() -> None:
    results = run_ranks(_recipe_rank, 2, timeout_s=120)
    print(f"\n2 ranks, {STEPS} steps, resumed after step {RESUME_AFTER}; max over ranks:")
    for key in results[0]:
        if key != "owned_numel":
            print(f"  {key:32s} " + "  ".join(f"{k}={max(r[key][k] for r in results):.3g}" for k in results[0][key]))
    print("  owned elements: " + str({k: v for r in results for k, v in r["owned_numel"].items()}))
    for r in results:
        for key, row in r.items():
            if key == "owned_numel":
                continue
            assert (row["adamw_split"] > 0) == key.endswith("/wide"), (key, row)  # AdamW's embedding cut
            assert row["params_vs_ddp"] == 0.0, (key, row)
            # A clip over the split embedding: torch's total within its summation error (module docstring).
            split_clip = key.endswith("clip=model/scaler=False/wide")
            assert row["clip_norms_vs_ddp"] <= (total_norm_rtol(int(row["numel"])) if split_clip else 0.0), (key, row)
            assert row["state_at_save_vs_ddp"] == 0.0 and row["final_state_vs_ddp"] == 0.0, (key, row)
            assert row["clipped_steps"] > 0 or "clip=none" in key, (key, row)  # the clip did scale gradients
            assert row["scale"] == row["ref_scale"], (key, row)
