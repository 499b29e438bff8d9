"""Matrix-wise optimizers (torch.optim.Muon, torch.optim.Adafactor) through OSS, whole
parameters per owner: ZeRO-2 (OSS + ShardedDataParallel) and ZeRO-1 (OSS under DDP) against
DDP + the same torch optimizer, and against a single-process reference.

Each owner runs the torch optimizer on whole parameters, so the update of a parameter is the
torch optimizer's own arithmetic on the same gradient; the only difference can come from the
gradient average. ZeRO-1 takes DDP's averaged gradients, so it is exact at any world size.
ZeRO-2's owner sums ``g * (1/N)`` in rank order, as the single-process reference does: exact
against that reference at any world size, and against DDP at 2 ranks (``a + b`` commutes);
at 3 ranks gloo's ring sums in another order, and a one-ulp gradient difference goes through
Muon's bf16 Newton-Schulz iteration, so there the difference to DDP is only reported.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp
from tests.helpers.ddp_arithmetic import reference_backward

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

STEPS = 5


def _matrices_only(seed: int = 0) -> nn.Module:
    """Bias-free Linears (Muon takes 2-D parameters only): tall 16x8, 32x16, wide 4x32."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 32, bias=False), nn.ReLU(),
                         nn.Linear(32, 4, bias=False))


# name, optimizer, its arguments, model, ShardedDataParallel's reduce_buffer_size
CASES: tuple[tuple[str, type[torch.optim.Optimizer], dict[str, Any], Any, int], ...] = (
    ("muon_defaults", torch.optim.Muon, {}, _matrices_only, 2**23),
    ("muon_lr0.02_no_nesterov_match_rms_adamw", torch.optim.Muon,
     {"lr": 0.02, "nesterov": False, "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.01}, _matrices_only, 0),
    ("adafactor_defaults", torch.optim.Adafactor, {}, seeded_mlp, 100),
    ("adafactor_foreach_weight_decay", torch.optim.Adafactor, {"lr": 0.02, "foreach": True, "weight_decay": 0.01},
     seeded_mlp, 2**23),
)


EXACT_AT_ANY_SIZE = frozenset({"zero1_vs_ddp", "zero1_state_vs_ddp", "zero2_vs_reference", "zero2_state_vs_reference"})
"""The comparisons whose gradients are summed in the same order at any world size (module docstring)."""


def _state_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest |difference| between two torch.optim state dicts' tensors (inf if their keys differ)."""
    if a["state"].keys() != b["state"].keys():
        return float("inf")
    worst = 0.0
    for i in a["state"]:
        if a["state"][i].keys() != b["state"][i].keys():
            return float("inf")
        worst = max([worst] + [max_abs_diff([x], [b["state"][i][k]]) for k, x in a["state"][i].items()])
    return worst


def _matrix_rank(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    results = {}
    for name, cls, kwargs, make, cap in CASES:
        ddp_model, zero1_model, zero2_model, ref = make(), make(), make(), make()
        ddp, zero1 = DDP(ddp_model), DDP(zero1_model)
        ddp_opt, ref_opt = cls(ddp_model.parameters(), **kwargs), cls(ref.parameters(), **kwargs)
        zero1_opt = OSS(zero1_model.parameters(), optim=cls, **kwargs)
        zero2_opt = OSS(zero2_model.parameters(), optim=cls, **kwargs)
        zero2 = ShardedDataParallel(zero2_model, zero2_opt, reduce_buffer_size=cap)
        for step in range(STEPS):
            for o in (ddp_opt, ref_opt, zero1_opt, zero2_opt):
                o.zero_grad(set_to_none=step % 2 == 0)
            x = rank_batch(rank, step)
            for model, opt in ((ddp, ddp_opt), (zero1, zero1_opt), (zero2, zero2_opt)):
                model(x).pow(2).mean().backward()
                opt.step()
            reference_backward(ref, world_size, lambda m, r, s=step: m(rank_batch(r, s)).pow(2).mean())
            ref_opt.step()
        torch_state = ddp_opt.state_dict()
        results[name] = {
            "zero2_vs_ddp": max_abs_diff(zero2_model.parameters(), ddp_model.parameters()),
            "zero1_vs_ddp": max_abs_diff(zero1_model.parameters(), ddp_model.parameters()),
            "zero2_vs_reference": max_abs_diff(zero2_model.parameters(), ref.parameters()),
            "ddp_vs_reference": max_abs_diff(ddp_model.parameters(), ref.parameters()),
            "zero1_state_vs_ddp": _state_diff(zero1_opt.state_dict(all_ranks=True), torch_state),
            "zero2_state_vs_ddp": _state_diff(zero2_opt.state_dict(all_ranks=True), torch_state),
            "zero2_state_vs_reference": _state_diff(zero2_opt.state_dict(), ref_opt.state_dict()),
        }
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_and_adafactor_through_zero1_and_zero2_match_ddp_bit_for_bit(world_size: int) -> None:
    results = run_ranks(_matrix_rank, world_size, timeout_s=120)
    print(f"\nworld size {world_size}, {STEPS} steps, max |diff| over ranks (parameters; consolidated state):")
    failures = []
    for name, *_ in CASES:
        worst = {k: max(r[name][k] for r in results) for k in results[0][name]}
        print(f"  {name:42s} " + "  ".join(f"{k}={v:.3g}" for k, v in worst.items()))
        for key, value in worst.items():
            exact = world_size <= 2 or key in EXACT_AT_ANY_SIZE
            if exact and value != 0.0:
                failures.append(f"{name} {key}: {value}")
    assert not failures, failures
