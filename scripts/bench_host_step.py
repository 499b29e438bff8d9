"""The host (CPU) Adam step over an fp32 shard of P parameters: torch's three forms over one
tensor per parameter and over one flat tensor, shardopt's flat masters (``OSS.step`` whole:
gradient fold, the wrapped optimizer's step, rounding into bf16 parameters), the same with
``offload="cpu"`` (over fp32 parameters, whose masters are then exact mirrors, and bf16), and DeepSpeed's
``DeepSpeedCPUAdam`` (ZeRO-Offload's host optimizer, over tensors allocated as DeepSpeed allocates its
fp32 partition and state) when it is importable. Two rows run torch's fused Adam and DeepSpeed's
CPUAdam over the placed host buffers OSS steps in (Note [host buffer placement] in
shardopt.host_memory), which shows how much of OSS's host step speed is the placement and how
much the kernel.

Usage (from the repository root)::

    python scripts/bench_host_step.py [--params 50000000] [--threads 2] [--tensors 294] [--steps 10]

DeepSpeed is a benchmark peer only (never imported by the library); its CPUAdam is built with
ninja on first use (``DS_BUILD_OPS=0``), which takes minutes. Each row is the median wall
time of ``step()`` over ``--steps`` steps after ``--warmup`` ones, pooled over ``--rounds``
interleaved rounds (a shared machine's speed drifts; interleaving spreads the drift over
every row). The gradients are set before each step, outside the timing. Every row runs Adam
with lr 1e-3, betas (0.9, 0.999), eps 1e-8 and no weight decay (Adam and AdamW agree there).
The machine's load average is printed: on a loaded machine the numbers are slower and noisier.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--params", type=int, default=50_000_000, help="parameters in the shard (P)")
ARGS.add_argument("--threads", type=int, default=2, help="intra-op (OpenMP) threads")
ARGS.add_argument("--tensors", type=int, default=294, help="tensors of the per-parameter layout")
ARGS.add_argument("--steps", type=int, default=10, help="timed steps per row and round")
ARGS.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one creates the state)")
ARGS.add_argument("--rounds", type=int, default=2, help="interleaved rounds")
ARGS.add_argument("--rows", default="", help="comma-separated row names to run (default: all)")

if __name__ == "__main__":
    _threads = ARGS.parse_known_args()[0].threads
    os.environ["OMP_NUM_THREADS"] = str(_threads)  # DeepSpeed's extension has its own OpenMP runtime

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shardopt.host_memory import host_empty, place_state  # noqa: E402
from shardopt.optim import OSS  # noqa: E402

HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
Setup = Callable[[], tuple[Callable[[], None], Callable[[], object]]]
"""Builds a row's tensors; returns (set the gradients, one step)."""


def sizes(params: int, tensors: int) -> list[int]:
    """``tensors`` sizes summing to ``params``, each a multiple of 64 but the last (a model's
    matrices and biases: Note [aligned segments] in shardopt.optim.flat_masters)."""
    each = max(64, params // tensors // 64 * 64)
    out = [each] * (params // each)
    if params % each:
        out.append(params % each)
    return out


def _tensor(numel: int, gen: torch.Generator, slot: int | None) -> torch.Tensor:
    """Random fp32 values, in torch's allocation or (``slot``) a placed host buffer (Note [host
    buffer placement] in shardopt.host_memory)."""
    values = torch.randn(numel, generator=gen)
    return values if slot is None else host_empty(numel, torch.float32, slot).copy_(values)


def _placing(step: Callable[[], object], state: dict[torch.Tensor, dict[str, object]], placed: bool
             ) -> Callable[[], object]:
    """``step``, then (``placed``) the optimizer state moved into placed buffers as OSS does."""
    def run() -> object:
        out = step()
        for p, entry in state.items():
            if placed and entry:
                place_state(entry, p, 2)  # type: ignore[arg-type]
        return out
    return run


def torch_row(numels: list[int], placed: bool = False, **form: bool) -> Setup:
    """torch.optim.Adam in one of its forms (``foreach``/``fused``) over fp32 tensors of ``numels``."""
    def setup() -> tuple[Callable[[], None], Callable[[], object]]:
        gen = torch.Generator().manual_seed(0)
        ps = [_tensor(n, gen, 0 if placed else None).requires_grad_() for n in numels]
        grads = [_tensor(n, gen, 1 if placed else None) for n in numels]
        opt = torch.optim.Adam(ps, **HYPER, **form)  # type: ignore[arg-type]

        def set_grads() -> None:
            for p, g in zip(ps, grads, strict=True):
                p.grad = g
        return set_grads, _placing(opt.step, opt.state, placed)  # type: ignore[arg-type]
    return setup


def deepspeed_row(params: int, placed: bool = False) -> Setup:
    """DeepSpeed's CPUAdam over one flat fp32 tensor (ZeRO-Offload's partition); ``placed``: its
    tensors moved into shardopt's placed host buffers (what the placement does for any kernel)."""
    def setup() -> tuple[Callable[[], None], Callable[[], object]]:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # a benchmark peer only
        gen = torch.Generator().manual_seed(0)
        p = _tensor(params, gen, 0 if placed else None).requires_grad_()
        g = _tensor(params, gen, 1 if placed else None)
        opt = DeepSpeedCPUAdam([p], adamw_mode=False, **HYPER)  # type: ignore[arg-type]

        def set_grads() -> None:
            p.grad = g
        return set_grads, _placing(opt.step, opt.state, placed)  # type: ignore[arg-type]
    return setup


INNER: list[float] = []
"""The wrapped optimizer's step times (ms) within the last ``OSS.step`` calls of an inner row."""


def shardopt_row(numels: list[int], inner: bool = False, offload: bool = False, dtype: torch.dtype = torch.bfloat16,
                 **form: bool) -> Setup:
    """``OSS.step`` (world size 1) over ``dtype`` parameters with fp32 flat masters: folds each
    gradient into the flat fp32 gradient buffer (without offload allocated at each step and
    freed after it; with ``offload`` kept between steps, and fp32 parameters get fp32 mirrors:
    Note [offloaded masters] in shardopt.optim.masters), steps the wrapped torch Adam over the
    flat tensor, copies (rounds) the masters into the parameters. With ``inner``, the row
    times the wrapped optimizer's step inside it only."""
    def setup() -> tuple[Callable[[], None], Callable[[], object]]:
        gen = torch.Generator().manual_seed(0)
        ps = [nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in numels]
        grads = [torch.randn(n, generator=gen).to(dtype) for n in numels]
        masters = torch.float32 if dtype != torch.float32 else None
        opt = OSS(ps, optim=torch.optim.Adam, master_dtype=masters, offload="cpu" if offload else None, **HYPER, **form)
        if inner:
            wrapped_step = opt.optim.step

            def timed(*args: object, **kwargs: object) -> object:
                start = time.perf_counter()
                out = wrapped_step(*args, **kwargs)
                INNER.append((time.perf_counter() - start) * 1e3)
                return out
            opt.optim.step = timed  # type: ignore[method-assign]

        def set_grads() -> None:
            for p, g in zip(ps, grads, strict=True):
                p.grad = g  # folded and freed by each step
        return set_grads, opt.step
    return setup


def time_row(setup: Setup, steps: int, warmup: int, inner: bool) -> list[float]:
    set_grads, step = setup()
    times = []
    for k in range(warmup + steps):
        set_grads()
        INNER.clear()
        start = time.perf_counter()
        step()
        if k >= warmup:
            times.append(INNER[-1] if inner else (time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    args = ARGS.parse_args()
    torch.set_num_threads(args.threads)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0,
                                         world_size=1)
    numels = sizes(args.params, args.tensors)
    n = len(numels)
    rows: dict[str, Setup] = {
        f"torch Adam for-loop, {n} tensors": torch_row(numels, foreach=False),
        f"torch Adam foreach, {n} tensors": torch_row(numels, foreach=True),
        f"torch Adam fused, {n} tensors": torch_row(numels, fused=True),
        "torch Adam for-loop, 1 flat tensor": torch_row([args.params], foreach=False),
        "torch Adam fused, 1 flat tensor": torch_row([args.params], fused=True),
        "torch Adam fused, 1 flat tensor, placed buffers": torch_row([args.params], placed=True, fused=True),
        f"shardopt OSS.step flat masters, Adam for-loop, {n} bf16 params": shardopt_row(numels, foreach=False),
        f"shardopt OSS.step flat masters, Adam fused, {n} bf16 params": shardopt_row(numels, fused=True),
        "  its wrapped optimizer's step only (Adam fused)": shardopt_row(numels, inner=True, fused=True),
        f"shardopt OSS.step offload, Adam fused, {n} fp32 params": shardopt_row(numels, offload=True,
                                                                                  dtype=torch.float32, fused=True),
        "  its wrapped optimizer's step only (offload fp32, Adam fused)": shardopt_row(
            numels, inner=True, offload=True, dtype=torch.float32, fused=True),
        f"shardopt OSS.step offload, Adam fused, {n} bf16 params": shardopt_row(numels, offload=True, fused=True),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: F401
        rows["DeepSpeed CPUAdam, 1 flat tensor"] = deepspeed_row(args.params)
        rows["DeepSpeed CPUAdam, 1 flat tensor, placed buffers"] = deepspeed_row(args.params, placed=True)
    except Exception as exc:  # noqa: BLE001 - any failure to import or build: report it, run the rest
        print(f"DeepSpeed CPUAdam not available: {type(exc).__name__}: {exc}")
    if args.rows:
        wanted = args.rows.split(",")
        rows = {k: v for k, v in rows.items() if any(w.strip() in k for w in wanted)}
    results: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(args.rounds):
        for name, setup in rows.items():
            try:
                results[name].extend(time_row(setup, args.steps, args.warmup, name.startswith("  ")))
            except Exception as exc:  # noqa: BLE001 - e.g. DeepSpeed's JIT build failing: say so exactly
                print(f"{name}: failed: {type(exc).__name__}: {exc}")
                results[name] = []
    load = os.getloadavg()
    print(f"P={args.params:,} parameters, {args.threads} threads, {os.cpu_count()} CPUs, load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, torch {torch.__version__}")
    medians = {k: statistics.median(v) for k, v in results.items() if v}
    ds = medians.get("DeepSpeed CPUAdam, 1 flat tensor")  # as DeepSpeed's ZeRO-Offload allocates it
    print(f"{'row':62} {'median ms':>10} {'min ms':>9} {'vs DeepSpeed':>13}")
    for name, median in medians.items():
        ratio = f"{median / ds:.2f}x" if ds else "-"
        print(f"{name:62} {median:10.1f} {min(results[name]):9.1f} {ratio:>13}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
