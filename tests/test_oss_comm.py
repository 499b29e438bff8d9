"""OSS's post-step parameter sync: one collective per bucket, (N-1)/N of the parameter bytes
sent per rank, half of that with broadcast_fp16, and every rank ends with the owners' values.

Bytes are measured as the growth of ``wchar`` in /proc/self/io (gloo writes to its sockets
with write/writev, which the kernel counts there) around the sync.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import SGD

from shardopt import comm
from shardopt.buckets import ParamGather
from shardopt.optim import OSS
from shardopt.partition import partition_by_size
from shardopt.testing import run_ranks
from tests.oss_common import mixed_mlp

needs_proc_io = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io (Linux)")


def _wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def _count_gathers(monkey: list[int]) -> Any:
    real = comm.all_gather_into

    def counting(*args: Any, **kwargs: Any) -> comm.PendingWork:
        monkey.append(1)
        return real(*args, **kwargs)

    return real, counting


def _wide_model() -> nn.Module:
    """16 equal 256x256 fp32 matrices (4 MiB): the partition is perfectly balanced at 2 and 4."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(16)])


def _sync_bytes(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    calls: list[int] = []
    real, counting = _count_gathers(calls)
    comm.all_gather_into = counting  # type: ignore[assignment]
    try:
        for fp16 in (False, True):
            model = _wide_model()
            opt = OSS(model.parameters(), optim=SGD, lr=0.1, broadcast_fp16=fp16)
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.001 * (1 + rank))  # owners' updates differ by rank
            calls.clear()
            before = _wchar()
            opt.step()
            sent = _wchar() - before
            param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            # Every rank must now hold the owner's value (rounded to fp16 when not the owner).
            worst = 0.0
            for i, p in enumerate(model.parameters()):
                owner = opt.partition.owners[i]
                theirs = p.detach().clone()
                torch.distributed.broadcast(theirs, src=owner)
                expected = theirs if (opt.owns(i) or not fp16) else theirs.half().float()
                worst = max(worst, (p.detach() - expected).abs().max().item())
            out["fp16" if fp16 else "fp32"] = {
                "sent": sent, "param_bytes": param_bytes, "collectives": len(calls), "worst": worst,
            }
        # Mixed fp32 + bf16: one stream (and so one collective here) per dtype.
        model = mixed_mlp()
        opt = OSS(model.parameters(), optim=SGD, lr=0.1)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        calls.clear()
        opt.step()
        out["mixed_collectives"] = len(calls)
    finally:
        comm.all_gather_into = real  # type: ignore[assignment]
    return out


@needs_proc_io
def test_param_sync_sends_n_minus_1_over_n_of_param_bytes_in_one_collective_per_bucket() -> None:
    print("\nOSS post-step sync, bytes written per rank (wchar) vs (N-1)/N x parameter bytes")
    for world_size in (2, 3, 4):
        results = run_ranks(_sync_bytes, world_size, timeout_s=60)
        for wire in ("fp32", "fp16"):
            for rank, r in enumerate(results):
                rec = r[wire]
                assert rec["worst"] == 0.0, (world_size, wire, rank, rec)
                assert rec["collectives"] == 1, rec  # 4 MiB gathered fits one 16 MiB bucket
                assert r["mixed_collectives"] == 2  # an fp32 and a bf16 stream
            param_bytes = results[0][wire]["param_bytes"]
            ideal = (world_size - 1) / world_size * param_bytes * (0.5 if wire == "fp16" else 1.0)
            plan = partition_by_size([256 * 256 * 4] * 16, world_size)
            # All-gather pads every rank's stream to the longest one; that is the exact payload.
            payload = (world_size - 1) * max(plan.rank_bytes) * (0.5 if wire == "fp16" else 1.0)
            sent = [r[wire]["sent"] for r in results]
            print(f"  N={world_size} {wire}: sent {sent}, ideal {ideal:.0f}, padded payload {payload:.0f}")
            for s in sent:
                assert payload <= s <= payload * 1.02 + 16 * 1024, (world_size, wire, s, payload)
        fp32 = [r["fp32"]["sent"] for r in results]
        fp16 = [r["fp16"]["sent"] for r in results]
        ratios = [h / f for h, f in zip(fp16, fp32)]
        print(f"  N={world_size} broadcast_fp16 / fp32 bytes: {[round(x, 3) for x in ratios]}")
        assert all(0.49 <= x <= 0.51 for x in ratios), ratios


def _gather_chunks(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    params = [torch.zeros(n) for n in (70, 33, 5, 128, 1, 64)] + [torch.zeros(3, dtype=torch.bfloat16)]
    sizes = [p.numel() * p.element_size() for p in params]
    plan = partition_by_size(sizes, world_size)
    for i, p in enumerate(params):
        if plan.owners[i] == rank:
            p.copy_(torch.arange(p.numel(), dtype=p.dtype) + 1000 * i)
    calls: list[int] = []
    real, counting = _count_gathers(calls)
    comm.all_gather_into = counting  # type: ignore[assignment]
    try:
        ParamGather(params, plan, rank, None, bucket_bytes=96).gather()  # 96 bytes gathered per chunk
    finally:
        comm.all_gather_into = real  # type: ignore[assignment]
    ok = all(torch.equal(p, torch.arange(p.numel(), dtype=p.dtype) + 1000 * i) for i, p in enumerate(params))
    longest_fp32 = max(
        sum(params[i].numel() for i in plan.indices_of(r) if params[i].dtype == torch.float32)
        for r in range(world_size)
    )
    chunk = 96 // (world_size * 4)  # fp32 elements each rank contributes per collective
    return {"ok": ok, "calls": len(calls), "expected_calls": math.ceil(longest_fp32 / chunk) + 1}


def test_small_buckets_split_the_sync_into_ceil_longest_over_bucket_collectives() -> None:
    for world_size in (2, 3, 4):
        for r in run_ranks(_gather_chunks, world_size, timeout_s=60):
            assert r["ok"]
            assert r["calls"] == r["expected_calls"], r  # per chunk, never per parameter
