"""ZeRO-2 at one rank passes autograd's gradients through (Note [one rank passes gradients
through] in shardopt/nn/data_parallel/reduction_queue.py): no bucket, no copy, and the same
parameters as plain torch training, bit for bit, with every zero_grad style, accumulation with
and without no_sync, and unused parameters."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch
from tests.helpers.sdp import Branchy

pytestmark = pytest.mark.distributed


def _one_rank(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for style in ("opt_none", "opt_zeros", "module_none", "module_zeros"):
        for accumulation in ("none", "no_sync", "plain"):
            plain, sharded = Branchy(), Branchy()
            plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
            opt = OSS(sharded.parameters(), optim=torch.optim.Adam, lr=1e-2)
            sdp = ShardedDataParallel(sharded, opt)
            produced: dict[torch.nn.Parameter, int] = {}
            for p in sharded.parameters():  # registered first, so it sees autograd's own tensor
                p.register_post_accumulate_grad_hook(lambda q: produced.__setitem__(q, id(q.grad)))
            kept = True
            for step in range(4):
                for model, optimizer in ((plain, plain_opt), (sdp, opt)):
                    set_to_none = style.endswith("none")
                    (optimizer if style.startswith("opt") else model).zero_grad(set_to_none=set_to_none)
                    micro = 1 if accumulation == "none" else 3
                    for m in range(micro):
                        use_b = (step + m) % 2 == 0  # b unused in some backward passes
                        x = rank_batch(rank, 10 * step + m)
                        if accumulation == "no_sync" and m < micro - 1 and model is sdp:
                            with sdp.no_sync():
                                model(x, use_b=use_b).pow(2).mean().backward()
                        else:
                            model(x, use_b=use_b).pow(2).mean().backward()
                    if model is sdp and accumulation == "none":
                        kept = kept and all(id(p.grad) == produced[p] for p in sharded.parameters()
                                            if p.grad is not None and p in produced)
                    optimizer.step()
            key = f"{style}/{accumulation}"
            out[key] = max_abs_diff(sharded.parameters(), plain.parameters())
            out[f"{key}/autograd_tensor_kept"] = kept
            out[f"{key}/buckets"] = len(sdp.reduction_buckets)
            out[f"{key}/never_grad"] = sharded.never.weight.grad is None
            sdp.close()
    return out


def test_one_rank_keeps_autograd_gradients_and_matches_plain_torch_bitwise() -> None:
    (out,) = run_ranks(_one_rank, 1, timeout_s=120)
    for key in [k for k in out if k.count("/") == 1]:
        assert out[key] == 0.0, (key, out)
        assert out[f"{key}/buckets"] == 0 and out[f"{key}/never_grad"], (key, out)
        assert out[f"{key}/autograd_tensor_kept"], (key, out)


def _narrow_wire(rank: int, world_size: int) -> float:
    """fp32 parameters reduced in bf16: at one rank the gradient is still rounded through the
    wire dtype, as at every world size (Note [one rank passes gradients through])."""
    plain, sharded = Branchy(), Branchy()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt = OSS(sharded.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(sharded, opt, reduce_dtype=torch.bfloat16)
    for step in range(3):
        x = rank_batch(rank, step)
        plain_opt.zero_grad()
        plain(x).pow(2).mean().backward()
        for p in plain.parameters():
            if p.grad is not None:
                p.grad = p.grad.to(torch.bfloat16).to(torch.float32)
        plain_opt.step()
        opt.zero_grad()
        sdp(x).pow(2).mean().backward()
        opt.step()
    sdp.close()
    return max_abs_diff(sharded.parameters(), plain.parameters())


def test_one_rank_still_rounds_through_a_narrower_reduce_dtype() -> None:
    assert run_ranks(_narrow_wire, 1, timeout_s=120) == [0.0]
