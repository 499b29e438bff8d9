"""ShardedDataParallel and ShardedGradScaler under the usage a demanding user throws at them:
shared parameters, several forwards or backwards per step, higher-order gradients, sparse
gradients, odd accumulation, trainability changes at awkward moments, degenerate world sizes
and partitions, mixed dtypes, subgroups, and the scaler with several optimizers.

Each case compares against DDP (``find_unused_parameters=True`` where relevant) and/or a
single-process reference with the same seeded weights and different data per rank: exact at
one and two ranks in fp32, 1e-6 relative beyond. Every run has a short timeout, so a hang is
a failure."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler
from shardopt.testing import RankFailure, run_ranks
from tests.common import max_abs_diff, rank_batch, seeded_mlp
from tests.test_sharded_ddp import Branchy, rel_diff, tolerance

LossOf = Callable[[nn.Module, int], torch.Tensor]


class TiedLM(nn.Module):
    """An embedding tied to the LM head, and one block applied twice per forward."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8, sparse=sparse)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(self.emb(tokens)))
        return self.head(torch.tanh(self.block(h)))


def lm_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1))


def penalised(model: nn.Module, params: list[nn.Parameter], rank: int, step: int) -> torch.Tensor:
    """The LM loss plus the squared norm of its parameter gradient (a second-order term)."""
    loss = lm_loss(model, rank, step)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    return loss + 0.1 * sum(g.pow(2).sum() for g in grads)


def reference_backward(model: nn.Module, world_size: int, loss_of: LossOf) -> None:
    """One data-parallel backward in one process: each rank's gradient times 1/N, summed in
    rank order, added to ``.grad`` (a parameter no rank used keeps its ``.grad``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total: list[torch.Tensor | None] = [None] * len(params)
    for r in range(world_size):
        grads = torch.autograd.grad(loss_of(model, r), params, allow_unused=True)
        for i, g in enumerate(grads):
            if g is not None:
                scaled = g * (1.0 / world_size)
                total[i] = scaled if total[i] is None else total[i] + scaled  # type: ignore[operator]
    for p, g in zip(params, total):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


# ---------------------------------------------------------------------- usage patterns


def _usage(rank: int, world_size: int) -> dict[str, float]:
    """Several forwards/backwards per step against a single-process reference doing the same."""
    results: dict[str, float] = {}
    patterns = ("tied_and_reused", "two_forwards_one_backward", "retain_graph_twice",
                "autograd_grad_after_backward", "zero_grad_between_forward_and_backward", "step_twice",
                "gradient_penalty_on_params")
    for pattern in patterns:
        for cap in (0, 50, 2**23):
            ref, sharded = TiedLM(), TiedLM()
            ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
            opt = OSS(sharded.parameters(), optim=torch.optim.Adam, lr=1e-2)
            sdp = ShardedDataParallel(sharded, opt, reduce_buffer_size=cap)
            for step in range(5):
                opt.zero_grad(set_to_none=step % 2 == 0)
                ref_opt.zero_grad(set_to_none=step % 2 == 0)
                if pattern == "two_forwards_one_backward":
                    (lm_loss(sdp, rank, step) + lm_loss(sdp, rank, step + 50)).backward()
                    reference_backward(ref, world_size, lambda m, r, s=step: lm_loss(m, r, s) + lm_loss(m, r, s + 50))
                elif pattern == "retain_graph_twice":
                    loss = lm_loss(sdp, rank, step)
                    loss.backward(retain_graph=True)
                    loss.backward()
                    for _ in range(2):
                        reference_backward(ref, world_size, lambda m, r, s=step: lm_loss(m, r, s))
                elif pattern == "gradient_penalty_on_params":
                    penalised(sdp, list(sharded.parameters()), rank, step).backward()
                    reference_backward(ref, world_size, lambda m, r, s=step: penalised(m, list(m.parameters()), r, s))
                elif pattern == "zero_grad_between_forward_and_backward":
                    loss = lm_loss(sdp, rank, step)
                    sdp.zero_grad(set_to_none=step % 2 == 1)
                    loss.backward()
                    reference_backward(ref, world_size, lambda m, r, s=step: lm_loss(m, r, s))
                else:
                    lm_loss(sdp, rank, step).backward()
                    reference_backward(ref, world_size, lambda m, r, s=step: lm_loss(m, r, s))
                if pattern == "autograd_grad_after_backward":
                    # e.g. a metric on another loss's gradient: must not touch .grad
                    torch.autograd.grad(lm_loss(sdp, rank, step + 70), list(sharded.parameters()))
                opt.step()
                ref_opt.step()
                if pattern == "step_twice":
                    opt.step()
                    ref_opt.step()
            results[f"{pattern}/cap={cap}"] = rel_diff(sharded, ref)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_tied_reused_and_repeated_backward_patterns_match_reference(world_size: int) -> None:
    results = run_ranks(_usage, world_size, timeout_s=60)
    print(f"\nworld_size={world_size}: {results[0]}")
    for key in results[0]:
        worst = max(r[key] for r in results)
        assert worst <= tolerance(world_size), (key, worst)


# ---------------------------------------------------------------------- refused inputs


class FunctionalSparse(nn.Module):
    """A sparse gradient from a functional call, invisible to a scan of the submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(11, 4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.table, sparse=True)


def _refusals(rank: int, world_size: int) -> list[str]:
    """Each case must raise the same clear error on every rank (so none is left waiting)."""
    messages = []
    tokens = torch.arange(6).view(2, 3)
    sparse = TiedLM(sparse=True)
    with pytest.raises(TypeError) as info:
        ShardedDataParallel(sparse, OSS(sparse.parameters(), lr=0.1))
    messages.append(str(info.value))
    functional = FunctionalSparse()
    sdp = ShardedDataParallel(functional, OSS(functional.parameters(), lr=0.1))
    with pytest.raises(TypeError) as info:
        sdp(tokens).sum().backward()
    messages.append(str(info.value))
    model = seeded_mlp()
    sdp = ShardedDataParallel(model, OSS(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's reference-cycle warning for create_graph
        with pytest.raises(ValueError) as info:
            sdp(rank_batch(rank, 0)).pow(2).mean().backward(create_graph=True)
    messages.append(str(info.value))
    return messages


def test_sparse_gradients_and_create_graph_are_refused_by_name_on_every_rank() -> None:
    expected = ["module 'emb' (Embedding) has sparse=True", "parameter 'table' got a torch.sparse_coo gradient",
                "backward(create_graph=True) reached parameter"]
    for messages in run_ranks(_refusals, 2, timeout_s=20):
        for fragment, message in zip(expected, messages, strict=True):
            assert fragment in message, (fragment, message)
