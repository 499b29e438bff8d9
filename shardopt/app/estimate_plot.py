"""``shardopt estimate --plot``: model-state bytes per rank against the number of ranks.

Two panels (bf16 parameters with fp32 masters and Adam, K = 12; fp32 Adam, K = 8), N from 1
to 1024 on a log axis: DDP, ZeRO-1, ZeRO-2 and ZeRO-3 by the ZeRO paper's formulas
(:func:`shardopt.memory.estimate_model_states`), and, when the shapes are known, the heaviest
rank under the real plans (:func:`shardopt.memory.estimate_plans`): ZeRO-1 and ZeRO-2 with
whole parameters (as OSS plans for a matrix-wise optimizer) and ZeRO-2 with large parameters
split by rows (OSS's default for an elementwise one).
With ``--measure``, the heaviest measured rank of each mode is drawn as a marker on the same
axes: measured on a scaled-down copy and multiplied by the full model's parameters over the
copy's (every category the count includes grows with the parameter count, as the copy keeps
each matrix's share). Needs matplotlib; the command checks for it before calling here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from shardopt.memory import GB, estimate_model_states, estimate_plans

if TYPE_CHECKING:
    from shardopt.app.measure import Measurement

__all__ = ["RANKS", "plot_estimate"]

RANKS: tuple[int, ...] = tuple(sorted({round(2 ** (i / 4)) for i in range(41)}))  # 1 .. 1024 on a log axis
"""The world sizes each curve is evaluated at."""


def _curves(model: Sequence[tuple[int, ...]] | int, mixed: bool,
            optimizer_bytes_per_param: float | None) -> dict[str, list[float]]:
    """Bytes per rank at each of :data:`RANKS`, per curve label."""
    curves: dict[str, list[float]] = {}
    for n in RANKS:
        if isinstance(model, int):
            formula, plan = estimate_model_states(model, n, mixed, optimizer_bytes_per_param), None
        else:
            plan = estimate_plans(model, n, mixed, optimizer_bytes_per_param)
            formula = plan.formula
        points = {"DDP": formula.ddp, "ZeRO-1 (formula)": formula.stage1, "ZeRO-2 (formula)": formula.stage2,
                  "ZeRO-3 (formula)": formula.stage3}
        if plan is not None:
            points.update({"ZeRO-1, whole parameters (matrix-wise optimizers)": plan.stage1(False),
                           "ZeRO-2, whole parameters (split_large_params=False)": plan.stage2(False),
                           "ZeRO-2, large parameters split by rows (OSS default)": plan.stage2(True)})
        for label, value in points.items():
            curves.setdefault(label, []).append(value)
    return curves


_STYLE = {  # label: (colour, line style)
    "DDP": ("#444444", "-"), "ZeRO-1 (formula)": ("#e08a1e", ":"), "ZeRO-2 (formula)": ("#2a7ab9", ":"),
    "ZeRO-3 (formula)": ("#3a9a4a", "-"), "ZeRO-1, whole parameters (matrix-wise optimizers)": ("#e08a1e", "-"),
    "ZeRO-2, whole parameters (split_large_params=False)": ("#c0392b", "-"),
    "ZeRO-2, large parameters split by rows (OSS default)": ("#2a7ab9", "--"),
}


_MEASURED = {  # mode: (label, colour, marker)
    "ddp": ("DDP", "#444444", "o"), "zero1": ("ZeRO-1, whole", "#e08a1e", "s"),
    "zero2": ("ZeRO-2, whole", "#c0392b", "^"), "zero2-split": ("ZeRO-2, split", "#2a7ab9", "v"),
    "zero3": ("ZeRO-3", "#3a9a4a", "D"),
}


def _draw_measured(ax: plt.Axes, measured: Measurement, mixed: bool, full_params: int) -> None:
    """The heaviest measured rank of each mode at each N, scaled to the full model."""
    factor = full_params / measured.num_params
    for mode, (label, colour, marker) in _MEASURED.items():
        points = sorted((m.world_size, m.heaviest.total * factor) for m in measured.results
                        if m.mode.value == mode and m.mixed is mixed)
        if points:
            ax.plot([n for n, _ in points], [b / GB for _, b in points], color=colour, marker=marker, ms=7,
                    mfc="none", mew=1.6, linestyle="none", clip_on=False, label=f"measured: {label}")


def plot_estimate(path: str, model: Sequence[tuple[int, ...]] | int, what: str,
                  optimizer_bytes_per_param: float | None = None, measured: Measurement | None = None) -> None:
    """Draw bytes per rank against N (1 to 1024) for mixed precision and fp32 and write a PNG.

    Args:
        path: the PNG (missing folders are created).
        model: every parameter's shape, or a bare parameter count (formula curves only).
        what: the model's name for the title.
        optimizer_bytes_per_param: K for both panels (default 12 mixed, 8 fp32).
        measured: ``estimate --measure``'s results, drawn as markers (scaled to ``model``'s
            parameter count); ``None`` draws the curves only.
    """
    full_params = model if isinstance(model, int) else sum(math.prod(s) for s in model)
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, mixed in zip(axes, (True, False), strict=True):
        for label, values in _curves(model, mixed, optimizer_bytes_per_param).items():
            colour, style = _STYLE[label]
            ax.plot(RANKS, [v / GB for v in values], color=colour, linestyle=style, lw=2, label=label)
        if measured is not None:
            _draw_measured(ax, measured, mixed, full_params)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_yscale("log")
        ax.set_xlim(1, 1024)
        ax.set_xlabel("data-parallel ranks N")
        ax.set_title("bf16 parameters, fp32 masters + Adam" if mixed else "fp32 parameters, Adam", fontsize=10)
        ax.grid(True, which="both", alpha=0.25)
    axes[0].set_ylabel("model-state GB on the heaviest rank")
    axes[0].legend(fontsize=7, loc="lower left")
    title = f"Model states per rank: {what} (shardopt estimate; activations and buffers not counted)"
    if measured is not None:
        title += (f"\nmarkers: the heaviest rank measured under torch's fake process group on a "
                  f"1/{measured.scale}-width copy, times {full_params / measured.num_params:.0f} (its parameter ratio)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
