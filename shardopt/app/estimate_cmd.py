"""``shardopt estimate``: model-state bytes per rank by the ZeRO paper's formulas, on the
heaviest rank of shardopt's real ownership plans when the shapes are known, and with
``--shard-size S`` for hybrid sharding (optimizer and gradient shards planned over the S
ranks of a shard group, so 1/S of the model per rank instead of 1/N), and with ``--offload cpu``
the bytes per parameter on the device and in host memory with and without offload (Note
[offload bytes per parameter] in :mod:`shardopt.memory`; ``--delayed-update``: with the delayed
update's host copy of the gradient buffer)."""

from __future__ import annotations

import argparse
import importlib

import torch

from shardopt.app.measure import check_measure_args, measure_for_args
from shardopt.app.models import PRESETS, GPT
from shardopt.app.render import (JSON_TO_STDOUT, estimate_rows, hybrid_rows, measured_rows, offload_rows,
                                 render_estimate, render_hybrid, render_offload, render_plan, write_json)
from shardopt.app.shapes import SHAPE_PRESETS, read_hf_config
from shardopt.app.usage import check_writable, fail
from shardopt.hybrid import plan_tiling
from shardopt.memory import ModelStateEstimate, PlanEstimate, estimate_model_states, estimate_offload, estimate_plans

__all__ = ["load_factory", "run_estimate"]


def load_factory(command: str, spec: str) -> torch.nn.Module:
    """The model ``--model`` names: a built-in GPT preset or ``package.module:factory``
    (called with no arguments); any failure ends the command with one line."""
    if spec in PRESETS:
        return GPT(PRESETS[spec])
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        fail(command, f"--model {spec!r} must be a preset ({', '.join(sorted([*PRESETS, *SHAPE_PRESETS]))}) or "
             "package.module:factory, e.g. torchvision.models:resnet50")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        fail(command, f"--model {spec!r}: cannot load {attr!r} from {module_name!r} ({exc})")
    try:
        model = factory() if callable(factory) else factory
    except Exception as exc:  # noqa: BLE001 - a user's factory may raise anything: one usage line, no traceback
        fail(command, f"--model {spec!r}: calling {attr}() with no arguments failed ({type(exc).__name__}: {exc}); "
             "point --model at a function that takes no arguments and returns the model (e.g. "
             "mymodels:build_small), or use --params N")
    if not isinstance(model, torch.nn.Module):
        fail(command, f"--model {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model


def _estimate_shapes(args: argparse.Namespace) -> list[tuple[int, ...]] | None:
    """The parameter shapes ``estimate`` plans with, or ``None`` for a bare ``--params`` count."""
    if args.hf_config is not None:
        try:
            return read_hf_config(args.hf_config).shapes()
        except ValueError as exc:
            fail("estimate", str(exc))
    if args.model is None:
        return None
    if args.model in SHAPE_PRESETS:
        return SHAPE_PRESETS[args.model].shapes()
    with torch.device("meta"):
        model = load_factory("estimate", args.model)
    shapes = [tuple(p.shape) for p in model.parameters()]
    if not shapes:
        fail("estimate", f"--model {args.model!r} has no parameters")
    return shapes


def _estimates(args: argparse.Namespace, shapes: list[tuple[int, ...]] | None,
               world_size: int) -> tuple[ModelStateEstimate, PlanEstimate | None]:
    """The formula estimate at ``world_size`` ranks, and the real plans over them when the shapes are known."""
    if shapes is None:
        return estimate_model_states(args.params, world_size, mixed_precision=not args.fp32,
                                     optimizer_bytes_per_param=args.optimizer_bytes), None
    plan = estimate_plans(shapes, world_size, mixed_precision=not args.fp32,
                          optimizer_bytes_per_param=args.optimizer_bytes)
    return plan.formula, plan


def run_estimate(args: argparse.Namespace) -> int:
    """``shardopt estimate`` with its parsed arguments; the exit code.

    With ``--shard-size S`` the sharded terms are also planned over S ranks (ownership is
    planned over the shard group; the R = N / S groups hold equal copies), shown in a
    hybrid table next to the flat rows and kept under ``"hybrid"`` in the JSON.
    """
    if args.json:
        check_writable("estimate", "--json", args.json, folder=False, why="the result is written there")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("estimate", "--plot needs matplotlib, which is not installed; pip install matplotlib, or drop "
                 "--plot")
        check_writable("estimate", "--plot", args.plot, folder=False, why="the plot is written there")
    if args.delayed_update and args.offload is None:
        fail("estimate", "--delayed-update counts the host copy of OSS(offload='cpu', delay_update_after=k): pass "
             "--offload cpu with it, or drop --delayed-update")
    if args.shard_size is not None:
        try:
            plan_tiling(args.world_size, args.shard_size)
        except ValueError as exc:
            fail("estimate", f"--shard-size: {exc}")
    try:
        to_measure = check_measure_args(args)
    except ValueError as exc:
        fail("estimate", str(exc))
    shapes = _estimate_shapes(args)
    try:
        est, plan = _estimates(args, shapes, args.world_size)
        hybrid = None if args.shard_size is None else _estimates(args, shapes, args.shard_size)
    except ValueError as exc:
        fail("estimate", str(exc))
    stderr = args.json == JSON_TO_STDOUT
    render_estimate(est, stderr=stderr)
    if plan is not None:
        render_plan(plan, stderr=stderr)
    if hybrid is not None:
        render_hybrid(est, *hybrid, stderr=stderr)
    offload = None if args.offload is None else estimate_offload(args.world_size, not args.fp32, args.optimizer_bytes,
                                                                 delayed_update=args.delayed_update)
    if offload is not None:
        render_offload(offload, est.num_params, not args.fp32, stderr=stderr)
    measured = None if to_measure is None else measure_for_args(to_measure, args, stderr=stderr)
    if args.plot:
        from shardopt.app.estimate_plot import plot_estimate

        what = args.model or args.hf_config or f"{args.params:.3g} parameters"
        plot_estimate(args.plot, shapes if shapes is not None else args.params, what,
                      optimizer_bytes_per_param=args.optimizer_bytes, measured=measured)
    if args.json:
        write_json(args.json, {
            "command": "estimate", **est.as_dict(), "rows": estimate_rows(est), "unit": "bytes",
            "plan": None if plan is None else plan.as_dict(),
            "hybrid": None if hybrid is None else {"shard_size": args.shard_size,
                                                   "num_replicas": args.world_size // args.shard_size,
                                                   "rows": hybrid_rows(est, *hybrid)},
            "measured": None if measured is None else measured_rows(measured),
            "offload": None if offload is None else offload_rows(offload, est.num_params, not args.fp32)})
    return 0
