"""``OSS(..., offload="cpu")`` on a GPU (skipped without one): the device holds no master and
no optimizer state, its peak is lower by their bytes, a model that does not fit the device
without offload trains with it, and offloaded training stays within the arithmetic's
distance of the same run without offload (the host steps with CPU kernels, the device with
CUDA ones: not bit for bit). NCCL at world size 1, the one layout one GPU gives.

Not run on this project's CPU machines: written without a GPU, to be checked on the first
session that has one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.gpt import gpt, lm_loss, tokens

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]

LR = 1e-3
STEPS = 5
VOCAB = 32000


def _train(offload: str | None, steps: int = STEPS) -> tuple[torch.nn.Module, OSS, int]:
    """A bf16 GPT with fp32 masters under ZeRO-2 on cuda:0; returns the model, its OSS and the
    device's peak bytes over the steps."""
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = gpt(vocab=VOCAB, dim=1024, depth=8).to(dev, torch.bfloat16)  # 33M embedding + the blocks
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, master_dtype=torch.float32, offload=offload, lr=LR)
    sdp = ShardedDataParallel(model, opt)
    torch.cuda.reset_peak_memory_stats(dev)
    for step in range(steps):
        opt.zero_grad()
        batch = tokens(0, step, batch=8, seq=8, vocab=VOCAB).to(dev)
        lm_loss(sdp(batch), batch).backward()
        opt.step()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    sdp.close()
    return model, opt, peak


def _on_device(rank: int, world_size: int) -> dict[str, Any]:
    off_model, off_opt, off_peak = _train("cpu")
    state = [v for s in off_opt.optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    masters = [m for m in (off_opt.master_of(p) for p in off_opt.params) if m is not None]
    host_bytes = sum(t.numel() * t.element_size() for t in [*state, *masters] if t.dim() > 0)
    dev_model, _, dev_peak = _train(None)
    # Each step's update lr * m / (sqrt(v) + eps) is rounded by CPU kernels on one side and CUDA
    # ones on the other: a few fp32 ulps of a quantity below lr in magnitude, then rounded to
    # bf16 in the parameter, so after STEPS steps each parameter is within STEPS bf16 ulps.
    worst = max(float(((a.float() - b.float()).abs() / (b.float().abs() * 2**-7 + 1e-12)).max())
                for a, b in zip(off_model.parameters(), dev_model.parameters(), strict=True))
    return {"state_on_host": all(t.device.type == "cpu" for t in [*state, *masters]),
            "pinned": all(t.is_pinned() for t in masters), "host_bytes": host_bytes,
            "peak_saving": dev_peak - off_peak, "worst_bf16_ulps": worst}


def test_offloaded_masters_and_state_live_on_the_host_and_lower_the_device_peak() -> None:
    r = run_ranks(_on_device, 1, backend="nccl", timeout_s=300)[0]
    assert r["state_on_host"] and r["pinned"], r
    # The masters and Adam's moments (12 bytes per parameter) left the device; the fp32 gradient
    # buffer too, which was on the device during the step only (so it lowers the peak as well).
    assert r["peak_saving"] >= 0.9 * r["host_bytes"], r
    assert r["worst_bf16_ulps"] <= STEPS, r


def _fits_only_with_offload(rank: int, world_size: int) -> dict[str, Any]:
    _, _, off_peak = _train("cpu", steps=2)
    _, _, dev_peak = _train(None, steps=2)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    budget = (off_peak + dev_peak) // 2  # between the two peaks
    torch.cuda.set_per_process_memory_fraction(budget / total, 0)
    out: dict[str, Any] = {"off_peak": off_peak, "dev_peak": dev_peak}
    try:
        _train(None, steps=2)
        out["without"] = "trained"
    except torch.OutOfMemoryError:
        out["without"] = "out of memory"
    torch.cuda.empty_cache()
    _train("cpu", steps=2)
    out["with"] = "trained"
    return out


def test_a_model_that_does_not_fit_without_offload_trains_with_it() -> None:
    r = run_ranks(_fits_only_with_offload, 1, backend="nccl", timeout_s=300)[0]
    assert r["without"] == "out of memory" and r["with"] == "trained", r
