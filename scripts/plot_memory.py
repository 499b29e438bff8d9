"""Draw docs/memory.png: model-state bytes per rank against the number of ranks N (1 to 1024).

The curves are shardopt's estimator (``shardopt.memory.estimate_model_states``, the ZeRO
paper's formulas) evaluated at every N, per parameter: multiply by the parameter count for
bytes per rank (the right axis does it for ``--params``). bf16 parameters with fp32 master
weights and Adam (K = 12). In fp32 (K = 8) DDP and ZeRO-3 are the same 16 and 16/N bytes,
ZeRO-1 is 8 + 8/N and ZeRO-2 4 + 12/N. Activations, buffers and fragmentation are not counted.

    python scripts/plot_memory.py                       # writes docs/memory.png
    python scripts/plot_memory.py --params 1.3e9 --out /tmp/memory.png

Needs matplotlib (not a shardopt dependency: ``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import os

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from shardopt.memory import ModelStateEstimate, estimate_model_states

RANKS = sorted({round(2 ** (i / 8)) for i in range(0, 81)})  # 1 .. 1024, dense on a log axis


def _curve(stage: str) -> list[float]:
    """Bytes per parameter per rank of ``stage`` (a ModelStateEstimate property) at each N."""
    per: list[float] = []
    for n in RANKS:
        est: ModelStateEstimate = estimate_model_states(1_000_000, n, mixed_precision=True)
        per.append(getattr(est, stage) / est.num_params)
    return per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=7.5e9, help="parameter count for the GB axis (default 7.5e9)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "memory.png"))
    args = parser.parse_args()

    fig, ax = plt.subplots(figsize=(8, 5))
    lines = (  # label, property, colour
        ("DDP (everything on every rank)", "ddp", "#444444"),
        ("ZeRO-1: OSS", "stage1", "#e08a1e"),
        ("ZeRO-2: ShardedDataParallel + OSS", "stage2", "#2a7ab9"),
        ("ZeRO-2 during the step (fp32 master grads)", "stage2_at_step", "#8fc1e8"),
        ("ZeRO-3: FullyShardedDataParallel", "stage3", "#3a9a4a"),
    )
    for label, stage, colour in lines:
        ax.plot(RANKS, _curve(stage), color=colour, lw=2, label=label)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_yscale("log")
    ax.set_xlim(1, 1024)
    ax.set_xlabel("data-parallel ranks N")
    ax.set_ylabel("model-state bytes per parameter, per rank")
    gb = args.params / 1e9
    right = ax.secondary_yaxis("right", functions=(lambda b: b * gb, lambda g: g / gb))
    right.set_ylabel(f"GB per rank for {args.params / 1e9:g}B parameters")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title("Model states per rank: bf16 parameters, fp32 masters, Adam (shardopt.memory)", fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
