"""``OSS(..., offload="cpu")`` on a GPU (skipped without one): the device holds no master and
no optimizer state, its peak is lower by their bytes, a model that does not fit the device
without offload trains with it, and offloaded training stays within the arithmetic's
distance of the same run without offload (the host steps with CPU kernels, the device with
CUDA ones: not bit for bit). NCCL at world size 1, the one layout one GPU gives.

The copies on a side stream (Note [offload copies on a side stream]): training with them equals
training with blocking copies bit for bit (AdamW), and training without offload where the step's
arithmetic rounds alike on both kernels (SGD at a power-of-two rate), at NCCL world size 1 and
two gloo ranks sharing the GPU (the post-step gather waits per chunk there), under
ShardedDataParallel (ZeRO-2) and under DDP (ZeRO-1: the fold's downloads, a mirror's gradient
handed back); and under ``torch.cuda.set_sync_debug_mode("error")`` backward and step make no
host sync but the one documented event wait per step (blocking copies, the control, are refused),
and no copy on the copy stream casts (an fp32 master goes up through its bf16 rounding buffer).

Not run on this project's CPU machines: written without a GPU, to be checked on the first
session that has one.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

from torch.nn.parallel import DistributedDataParallel as DDP

import shardopt.optim.offload_copies as offload_copies
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.streams import CudaStreams, HostStreams
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


# ---------------------------------------------------------------------- copies on a side stream
# Note [offload copies on a side stream] in shardopt/optim/offload_copies.py. Written on a CPU
# machine; its protocol is checked there against a simulated device (tests/test_offload_streams.py).

F32, BF16 = torch.float32, torch.bfloat16
COPY_MODES = ("plain", "accumulate", "three", "carry", "delayed")
ZERO1_COPY_MODES = ("plain", "accumulate", "no_sync", "carry", "clip", "delayed")
SGD_EXACT: dict[str, Any] = {"lr": 2.0**-6}
"""SGD without momentum or decay at a power-of-two rate: p - lr * g rounds once, the same on CPU and
CUDA kernels (an exact product, fused or not), so offload on and off agree bit for bit."""


def _mlp(dev: torch.device, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 4)).to(dev, dtype)


def _copy_run(rank: int, dev: torch.device, dtype: torch.dtype, mode: str, offload: str | None, copies: str,
              optim: type[torch.optim.Optimizer], kwargs: dict[str, Any],
              stage: str = "zero2") -> list[list[torch.Tensor]]:
    """Five steps under ShardedDataParallel (``stage="zero2"``) or DDP (``"zero1"``);
    ``copies="blocking"`` makes every offload copy synchronous (the path before the copy stream).
    Returns the parameters (on the CPU) after each step."""
    saved = offload_copies.copy_streams_for
    if copies == "blocking":
        offload_copies.copy_streams_for = lambda device: HostStreams()  # type: ignore[assignment]
    try:
        model = _mlp(dev, dtype)
        opt = OSS(model.parameters(), optim=optim, offload=offload, master_dtype=F32 if dtype != F32 else None,
                  delay_update_after=1 if mode == "delayed" and offload else None, **kwargs)
        wrapped: nn.Module = DDP(model) if stage == "zero1" else ShardedDataParallel(model, opt)
        out = []
        for step in range(STEPS):
            if mode != "carry" or step % 2 == 0:
                opt.zero_grad(set_to_none=step % 2 == 0)
            for k in range({"accumulate": 2, "three": 3, "no_sync": 2}.get(mode, 1)):
                x = _batch(rank, 10 * step + k).to(dev, dtype)
                with wrapped.no_sync() if mode == "no_sync" and k == 0 else contextlib.nullcontext():
                    wrapped(x).float().pow(2).mean().backward()
            if mode == "clip":
                opt.clip_grad_norm(0.05)
            opt.step()
            out.append([p.detach().cpu() for p in model.parameters()])
        opt.finish_update()
        out.append([p.detach().cpu() for p in model.parameters()])
        if isinstance(wrapped, ShardedDataParallel):
            wrapped.close()
        return out
    finally:
        offload_copies.copy_streams_for = saved  # type: ignore[assignment]


def _batch(rank: int, step: int) -> torch.Tensor:
    """Different inputs per (rank, step), the same on every run."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=gen)


def _equal_runs(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(torch.equal(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def _copies_exact(rank: int, world_size: int, backend: str) -> dict[str, bool]:
    dev = torch.device("cuda", rank if backend == "nccl" else 0)  # gloo ranks share GPU 0
    out: dict[str, bool] = {}
    adamw = {"lr": 1e-2, "weight_decay": 0.1}
    for stage, modes in (("zero2", COPY_MODES), ("zero1", ZERO1_COPY_MODES)):
        for dtype in (F32, BF16):
            for mode in modes:
                side = _copy_run(rank, dev, dtype, mode, "cpu", "side", torch.optim.AdamW, adamw, stage)
                blocking = _copy_run(rank, dev, dtype, mode, "cpu", "blocking", torch.optim.AdamW, adamw, stage)
                out[f"{stage}/{dtype}/{mode}/side=blocking"] = _equal_runs(side, blocking)
                if mode not in ("delayed", "clip"):  # the delay changes the results by design; the norm's kernels differ
                    side = _copy_run(rank, dev, dtype, mode, "cpu", "side", torch.optim.SGD, SGD_EXACT, stage)
                    plain = _copy_run(rank, dev, dtype, mode, None, "side", torch.optim.SGD, SGD_EXACT, stage)
                    out[f"{stage}/{dtype}/{mode}/side=offload-off"] = _equal_runs(side, plain)
    return out


@pytest.mark.parametrize(("world_size", "backend"), [(1, "nccl"), (2, "gloo")])
def test_offload_copies_on_a_side_stream_equal_blocking_copies_and_offload_off_bit_for_bit(
        world_size: int, backend: str) -> None:
    for rank, out in enumerate(run_ranks(_copies_exact, world_size, backend, backend=backend, timeout_s=300)):
        assert out and all(out.values()), (rank, {k: v for k, v in out.items() if not v})


def _host_syncs(rank: int, world_size: int) -> dict[str, Any]:
    """Backward and step under ``torch.cuda.set_sync_debug_mode("error")`` after two warm-up
    steps (the first step compares each master with its parameter once: Note [masters follow
    outside writes]), counting the copy stream's host waits; then the blocking copies as the
    control that the mode sees a synchronous copy."""
    dev = torch.device("cuda", 0)
    waits: list[int] = []
    original = CudaStreams.host_wait

    def counted(self: CudaStreams, event: Any) -> None:
        waits.append(1)
        original(self, event)

    casts: list[str] = []  # copies on the copy stream that cast (through pageable memory): none expected
    original_copy = CudaStreams.copy

    def checked(self: CudaStreams, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.dtype != src.dtype:
            casts.append(f"{src.dtype}@{src.device} -> {dst.dtype}@{dst.device}")
        original_copy(self, dst, src)

    CudaStreams.host_wait = counted  # type: ignore[method-assign]
    CudaStreams.copy = checked  # type: ignore[method-assign]
    saved = offload_copies.copy_streams_for
    out: dict[str, Any] = {}
    try:
        for copies in ("side", "blocking"):
            if copies == "blocking":
                offload_copies.copy_streams_for = lambda device: HostStreams()  # type: ignore[assignment]
            # zero2, micro 2: the second backward's gradients go through the staging buffer; zero1 (DDP):
            # bf16 gradients through a pinned bf16 buffer, fp32 ones straight, a mirror's handed back
            for stage, dtype, micro in (("zero2", BF16, 1), ("zero2", BF16, 2), ("zero1", BF16, 1), ("zero1", F32, 2)):
                model = _mlp(dev, dtype)
                opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2,
                          master_dtype=F32 if dtype != F32 else None, offload="cpu")
                wrapped: nn.Module = DDP(model) if stage == "zero1" else ShardedDataParallel(model, opt)
                batches = [_batch(0, s).to(dev, dtype) for s in range(4 * micro)]
                per_step, error = [], None
                for step in range(4):
                    opt.zero_grad(set_to_none=step % 2 == 0)
                    before = len(waits)
                    try:
                        if step >= 2:
                            torch.cuda.set_sync_debug_mode("error")
                        for k in range(micro):
                            quiet = stage == "zero1" and k < micro - 1  # DDP: no_sync, then the reducing pass
                            with wrapped.no_sync() if quiet else contextlib.nullcontext():
                                wrapped(batches[micro * step + k]).float().pow(2).mean().backward()
                        opt.step()
                    except RuntimeError as exc:
                        error = str(exc)
                        break
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                    per_step.append(len(waits) - before)
                out[f"{copies}/{stage}/{dtype}/{micro}"] = {"host_waits": per_step, "error": error, "casts": casts[:]}
                casts.clear()
                if isinstance(wrapped, ShardedDataParallel):
                    wrapped.close()
                torch.cuda.synchronize()
    finally:
        CudaStreams.host_wait = original  # type: ignore[method-assign]
        CudaStreams.copy = original_copy  # type: ignore[method-assign]
        offload_copies.copy_streams_for = saved  # type: ignore[assignment]
    return out


def test_an_offloaded_step_waits_on_the_host_once_and_syncs_nowhere_else() -> None:
    out = run_ranks(_host_syncs, 1, backend="nccl", timeout_s=300)[0]
    for key, side in out.items():
        if key.startswith("side/"):
            assert side["error"] is None and side["host_waits"] == [1, 1, 1, 1], (key, side)
            assert side["casts"] == [], (key, side)  # bf16 masters rounded on the host, bf16 gradients cast there
        else:  # the control: a synchronous copy to the host is what the debug mode refuses
            assert side["error"] is not None, (key, out)
