"""Every accumulation pattern DDP allows, with a parameter split across ranks (OSS's default
plan) against the same run with every parameter whole and against DDP: ZeRO-2 (OSS +
ShardedDataParallel) and ZeRO-1 (OSS under DDP).

The model is :class:`tests.helpers.sdp.VocabModel`, whose head OSS splits at 2 and 3 ranks
(asserted). Patterns, 4 steps each with different data per rank and step:

* ``carry``: no ``zero_grad`` at all, so DDP sums every step's gradient into ``.grad`` and each
  step uses the running sum (some scripts rely on it);
* ``carry_every_other``: ``zero_grad`` only before even steps;
* ``optimizer_zero``/``optimizer_zero_keep``: ``optimizer.zero_grad()`` with ``set_to_none``
  True / False before each step;
* ``module_zero``/``module_zero_keep``: the user's *inner* module's ``zero_grad`` likewise;
* ``two_backward``: two backward passes per step without ``no_sync``;
* ``no_sync``: two micro-batches, the first under ``no_sync``;
* ``zero_between``: backward, module ``zero_grad``, backward, step (the first pass discarded);
* ``scaled_loss``: the loss is scaled by 4 before backward.

Exactness: at 2 ranks every comparison is bit for bit: the sum of two fp32 terms commutes,
so DDP's gloo ring and our reduction produce the same bits, and the division by 2 is exact
(tests/test_sharded_ddp_split.py measures 0.0 likewise). Accumulating across backward passes adds the same terms in the same
order in every run. At 3 ranks split and whole ZeRO-2 sum the same rows in rank order and
stay bit-exact with each other; against DDP (gloo's ring order) the bound is
:func:`tests.helpers.sdp.tolerance`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff
from tests.helpers.sdp import VocabModel, rel_diff, tolerance, vocab_loss

pytestmark = pytest.mark.distributed  # starts processes

STEPS = 4
LR = 0.05

# (zero before this step?, how, set_to_none)
Zeroing = Callable[[int], tuple[bool, str, bool]]
PATTERNS: dict[str, Zeroing] = {
    "carry": lambda s: (False, "optimizer", True),
    "carry_every_other": lambda s: (s % 2 == 0, "optimizer", True),
    "optimizer_zero": lambda s: (True, "optimizer", True),
    "optimizer_zero_keep": lambda s: (True, "optimizer", False),
    "module_zero": lambda s: (True, "module", True),
    "module_zero_keep": lambda s: (True, "module", False),
    "two_backward": lambda s: (True, "optimizer", s % 2 == 0),
    "no_sync": lambda s: (True, "module", s % 2 == 0),
    "zero_between": lambda s: (True, "optimizer", True),
    "scaled_loss": lambda s: (True, "optimizer", True),
}


class _Run:
    """One model, its wrapper and optimizer, driven through a pattern."""

    def __init__(self, kind: str, split: bool | None) -> None:
        masters = kind.endswith("_masters")  # bf16 parameters, fp32 masters: split against whole only
        self.model = VocabModel(torch.bfloat16 if masters else torch.float32)
        extra: dict[str, Any] = {"master_dtype": torch.float32} if masters else {}
        if kind == "ddp":
            self.net: nn.Module = DDP(self.model)
            self.opt: torch.optim.Optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)
        elif kind == "zero1":
            self.net = DDP(self.model)
            self.opt = OSS(self.model.parameters(), optim=torch.optim.SGD, lr=LR, momentum=0.9,
                           split_large_params=split, **extra)
        else:
            self.opt = OSS(self.model.parameters(), optim=torch.optim.SGD, lr=LR, momentum=0.9,
                           split_large_params=split, **extra)
            self.net = ShardedDataParallel(self.model, self.opt)

    def split_names(self) -> list[str]:
        if not isinstance(self.opt, OSS):
            return []
        index = {id(p): i for i, p in enumerate(self.opt.params)}
        return [n for n, p in self.model.named_parameters() if index[id(p)] in self.opt.plan.split_params]

    def zero(self, how: str, set_to_none: bool) -> None:
        (self.opt if how == "optimizer" else self.model).zero_grad(set_to_none=set_to_none)

    def step(self, pattern: str, rank: int, step: int) -> None:
        zero, how, set_to_none = PATTERNS[pattern](step)
        if zero:
            self.zero(how, set_to_none)
        if pattern == "two_backward":
            vocab_loss(self.net, rank, 2 * step).backward()
            vocab_loss(self.net, rank, 2 * step + 1).backward()
        elif pattern == "no_sync":
            sync = getattr(self.net, "no_sync", contextlib.nullcontext)
            with sync():
                vocab_loss(self.net, rank, 2 * step).backward()
            vocab_loss(self.net, rank, 2 * step + 1).backward()
        elif pattern == "zero_between":
            vocab_loss(self.net, rank, 2 * step).backward()
            self.model.zero_grad(set_to_none=step % 2 == 0)
            vocab_loss(self.net, rank, 2 * step + 1).backward()
        elif pattern == "scaled_loss":
            (vocab_loss(self.net, rank, step) * 4.0).backward()
        else:
            vocab_loss(self.net, rank, step).backward()
        self.opt.step()

    def close(self) -> None:
        if isinstance(self.net, ShardedDataParallel):
            self.net.close()


def _sweep(rank: int, world_size: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message="OSS: the heaviest rank")  # the whole plans are unbalanced on purpose
    out: dict[str, Any] = {}
    finals: dict[str, list[torch.Tensor]] = {}
    for kind in kinds:
        for pattern in PATTERNS:
            ddp, split, whole = _Run("ddp", None), _Run(kind, None), _Run(kind, False)
            out[f"{kind}/{pattern}/split"] = split.split_names()
            out[f"{kind}/{pattern}/whole_split"] = whole.split_names()
            for step in range(STEPS):
                for run in (ddp, split, whole):
                    run.step(pattern, rank, step)
            out[f"{kind}/{pattern}/split_vs_whole"] = max_abs_diff(split.model.parameters(), whole.model.parameters())
            out[f"{kind}/{pattern}/split_vs_ddp"] = rel_diff(split.model, ddp.model)
            out[f"{kind}/{pattern}/whole_vs_ddp"] = rel_diff(whole.model, ddp.model)
            if kind.endswith("_masters") and pattern in ("carry", "optimizer_zero"):
                finals[pattern] = [p.detach().clone() for p in split.model.parameters()]
            for run in (split, whole):
                run.close()
            del ddp, split, whole
    if finals:  # with fp32 masters a step consumes the gradients, as DeepSpeed's does (docs/mixed-precision.md)
        out["masters_carry_vs_zeroed"] = max_abs_diff(finals["carry"], finals["optimizer_zero"])
    return out


# DDP reduces whatever ``.grad`` holds, so a gradient carried into another backward (``carry``,
# ``two_backward``) is averaged again with the new local ones: ``((c + g0) + (c + g1)) / 2``, where
# ShardedDataParallel adds the carried average to the new one, ``c + (g0 + g1) / 2``. The two
# round differently: each reduced element by at most one rounding of a sum of at most 4 carried
# gradients, 2**-24 * 4 * max|g|. SGD (lr 0.05, momentum 0.9) moves a parameter by lr times
# those differences weighted by at most 1 + 0.9 + 0.81 + 0.729 over the 4 steps, about 3.6e-8 *
# max|g| in all, far below one ulp of a parameter here (|g| < |p|); what remains is a parameter
# rounded to the other neighbour: one ulp of its magnitude, at most 2**-23 of the largest. So at
# 2 ranks those patterns get 2**-22 relative to the largest parameter (measured 3.3e-9); at 3
# ranks gloo's ring order adds the bound the 3-rank tests use (1e-6). Split and whole ZeRO-2
# carry in the same way and stay bit-exact with each other.
REDUCES_CARRIED = {"carry", "carry_every_other", "two_backward"}
CARRIED_AT_TWO = 2.0**-22


def _ddp_bound(pattern: str, world_size: int) -> float:
    if pattern not in REDUCES_CARRIED:
        return tolerance(world_size)
    return CARRIED_AT_TWO if world_size == 2 else tolerance(world_size)


def _check(results: list[dict[str, Any]], world_size: int, kinds: tuple[str, ...]) -> None:
    bad = []
    for rank, out in enumerate(results):
        for kind in kinds:
            for pattern in PATTERNS:
                key = f"{kind}/{pattern}"
                assert out[f"{key}/split"] == ["head.weight"], (rank, key, out[f"{key}/split"])  # really split
                assert out[f"{key}/whole_split"] == [], (rank, key)
                if out[f"{key}/split_vs_whole"] != 0.0:  # the same sums in the same order: bit for bit
                    bad.append((rank, key, "split_vs_whole", out[f"{key}/split_vs_whole"]))
                if kind.endswith("_masters"):
                    assert out["masters_carry_vs_zeroed"] == 0.0, (rank, out["masters_carry_vs_zeroed"])
                    continue  # DDP has no fp32 masters to compare with
                bound = tolerance(world_size) if kind == "zero1" else _ddp_bound(pattern, world_size)
                for which in ("split_vs_ddp", "whole_vs_ddp"):
                    if out[f"{key}/{which}"] > bound:
                        bad.append((rank, key, which, out[f"{key}/{which}"]))
    assert not bad, bad


def test_a_split_parameter_accumulates_like_a_whole_one_and_like_ddp_in_every_pattern_at_two_ranks() -> None:
    kinds = ("zero2", "zero1", "zero2_masters")
    _check(run_ranks(_sweep, 2, kinds, timeout_s=300), 2, kinds)


def test_a_split_parameter_accumulates_like_a_whole_one_in_every_pattern_at_three_ranks() -> None:
    kinds = ("zero2", "zero2_masters")
    _check(run_ranks(_sweep, 3, kinds, timeout_s=300), 3, kinds)
