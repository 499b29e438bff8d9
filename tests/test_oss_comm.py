"""OSS's post-step parameter sync: large parameters go straight from owner to peers (exactly
the owned bytes), small ones in packed streams (one collective per bucket), half the bytes with
broadcast_fp16, and every rank ends with the owners' values.

Bytes are measured as the growth of ``wchar`` in /proc/self/io (gloo writes to its sockets
with write/writev, which the kernel counts there) around the sync.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import SGD

from shardopt import comm
from shardopt.optim.param_gather import ParamGather
from shardopt.optim import OSS
from shardopt.partition import partition_by_size, plan_whole
from shardopt.testing import run_ranks
from tests.helpers.oss import mixed_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

needs_proc_io = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io (Linux)")


def _wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


@contextlib.contextmanager
def count_transfers() -> Iterator[list[str]]:
    """Record every bulk transfer the sync starts (an all-gather, or a point-to-point exchange)."""
    calls: list[str] = []
    saved = {name: getattr(comm, name) for name in ("all_gather_into", "exchange")}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> comm.PendingWork:
            calls.append(name)
            return saved[name](*args, **kwargs)

        return call

    for name in saved:
        setattr(comm, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(comm, name, fn)


def _wide_model() -> nn.Module:
    """16 equal 256x256 fp32 matrices (4 MiB): the partition is perfectly balanced at 2 and 4."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(16)])


def _owner_values_everywhere(opt: OSS, model: nn.Module, fp16: bool) -> float:
    """Largest |param - owner's param| (owner's rounded to fp16 off the owner when ``fp16``)."""
    worst = 0.0
    for i, p in enumerate(model.parameters()):
        theirs = p.detach().clone()
        torch.distributed.broadcast(theirs, src=opt.partition.owners[i])
        expected = theirs if (opt.owns(i) or not fp16) else theirs.half().float()
        worst = max(worst, (p.detach() - expected).abs().max().item())
    return worst


def _sync_bytes(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with count_transfers() as calls:
        # direct: every 256 KiB matrix moves owner -> peers (Note [direct parameter transfers] in param_gather);
        # streams: the same matrices packed (direct transfers off); fp16: packed, half the bytes.
        for wire, fp16, direct_min in (("direct", False, None), ("streams", False, 2**40), ("fp16", True, None)):
            model = _wide_model()
            opt = OSS(model.parameters(), optim=SGD, lr=0.1, broadcast_fp16=fp16, split_large_params=False)  # whole-parameter paths
            if direct_min is not None:
                opt._gather = ParamGather(list(opt.params), opt.plan, rank, None, direct_min_bytes=direct_min)
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.001 * (1 + rank))  # owners' updates differ by rank
            versions = [p._version for p in model.parameters()]
            calls.clear()
            before = _wchar()
            opt.step()
            sent = _wchar() - before
            out[wire] = {
                "sent": sent, "collectives": len(calls), "worst": _owner_values_everywhere(opt, model, fp16),
                "versions_bumped": all(p._version > v for p, v in zip(model.parameters(), versions)),
            }
        # Mixed fp32 + bf16 small layers (below the direct size): one stream per dtype.
        model = mixed_mlp()
        opt = OSS(model.parameters(), optim=SGD, lr=0.1)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        calls.clear()
        opt.step()
        out["mixed_collectives"] = len(calls)
        out["mixed_worst"] = _owner_values_everywhere(opt, model, False)
    return out


@needs_proc_io
def test_param_sync_sends_exactly_the_owned_bytes_to_each_peer() -> None:
    print("\nOSS post-step sync, bytes written per rank (wchar) vs the payload")
    matrix = 256 * 256 * 4
    for world_size in (2, 3, 4):
        results = run_ranks(_sync_bytes, world_size, timeout_s=60)
        plan = partition_by_size([matrix] * 16, world_size)
        for rank, r in enumerate(results):
            assert r["mixed_collectives"] == 2 and r["mixed_worst"] == 0.0, r  # an fp32 and a bf16 stream
            for wire in ("direct", "streams", "fp16"):
                rec = r[wire]
                assert rec["worst"] == 0.0, (world_size, wire, rank, rec)
                assert rec["versions_bumped"], (world_size, wire, rank)  # as an in-place update would
                # direct: one exchange for every parameter; packed: 4 MiB fits one 16 MiB chunk
                assert rec["collectives"] == 1, (wire, rec)
                # Point to point (gloo) nothing is padded: each rank sends its own bytes to each peer.
                payload = (world_size - 1) * plan.rank_bytes[rank] * (0.5 if wire == "fp16" else 1.0)
                assert payload <= rec["sent"] <= payload * 1.02 + 16 * 1024, (world_size, wire, rank, rec, payload)
        ideal = (world_size - 1) / world_size * 16 * matrix
        for wire in ("direct", "streams", "fp16"):
            print(f"  N={world_size} {wire}: sent {[r[wire]['sent'] for r in results]}, (N-1)/N x params {ideal:.0f}")


def _gather_chunks(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    real = comm.prefers_point_to_point
    # gloo's point-to-point path, then the all-gather path NCCL takes (forced here on gloo).
    for path, prefers in (("p2p", real), ("all_gather", lambda group, device: False)):
        comm.prefers_point_to_point = prefers  # type: ignore[assignment]
        try:
            torch.manual_seed(0)
            params = [torch.zeros(n) for n in (70, 33, 5, 128, 1, 64)] + [torch.zeros(3, dtype=torch.bfloat16)]
            sizes = [p.numel() * p.element_size() for p in params]
            plan = plan_whole(sizes, [p.shape[0] for p in params], world_size)
            for i, p in enumerate(params):
                if plan.blocks_of(i)[0].owner == rank:
                    p.copy_(torch.arange(p.numel(), dtype=p.dtype) + 1000 * i)
            with count_transfers() as calls:
                ParamGather(params, plan, rank, None, bucket_bytes=96).gather()  # 96 bytes gathered per chunk
        finally:
            comm.prefers_point_to_point = real  # type: ignore[assignment]
        ok = all(torch.equal(p, torch.arange(p.numel(), dtype=p.dtype) + 1000 * i) for i, p in enumerate(params))
        longest_fp32 = max(
            sum(params[b.param].numel() for b in plan.blocks_of_rank(r) if params[b.param].dtype == torch.float32)
            for r in range(world_size)
        )
        chunk = 96 // (world_size * 4)  # fp32 elements each rank contributes per collective
        out[path] = {"ok": ok, "calls": calls, "expected_calls": math.ceil(longest_fp32 / chunk) + 1}
    return out


def test_small_buckets_split_the_sync_into_ceil_longest_over_bucket_collectives() -> None:
    for world_size in (2, 3, 4):
        for r in run_ranks(_gather_chunks, world_size, timeout_s=60):
            for path, kind in (("p2p", "exchange"), ("all_gather", "all_gather_into")):
                assert r[path]["ok"], (world_size, path)
                # per chunk, never per parameter
                assert r[path]["calls"] == [kind] * r[path]["expected_calls"], (world_size, path, r[path])
