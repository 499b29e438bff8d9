"""``shardopt estimate --measure``: the real wrappers, built for sampled ranks of N under torch's fake group.

The estimate command's shapes (``--model llama3-8b`` or ``--hf-config``) are scaled down by
``--measure-scale`` in every width and in the vocabulary (:func:`shardopt.app.decoder.scaled`:
each matrix keeps its share of the model), built as a :class:`~shardopt.app.decoder.Decoder`
and measured by :func:`shardopt.fake_ranks.measure` for each mode and world size (``zero2-split``:
ShardedDataParallel over ``OSS(split_large_params=True)``, large parameters owned in row blocks).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from rich.console import Console

from shardopt.app.render import render_measured
from shardopt.app.decoder import Decoder, DecoderLayer, decoder_loss, scaled
from shardopt.app.shapes import SHAPE_PRESETS, DecoderShape, read_hf_config
from shardopt.fake_ranks import Measured, Mode, Workload, measure

__all__ = ["DEFAULT_SCALE", "DEFAULT_WORLD_SIZES", "MAX_WORLD_SIZE", "Measurement", "add_measure_args",
           "check_measure_args", "decoder_shape", "measure_for_args", "mode_list", "run_measure", "world_size_list"]

DEFAULT_WORLD_SIZES = (1, 8, 64, 256, 1024)
"""``--measure-world-sizes`` when not given."""
DEFAULT_SCALE = 16
"""``--measure-scale`` when not given: Llama-3-8B becomes 31.4M parameters (500 MB per DDP rank in fp32)."""
MAX_WORLD_SIZE = 65536
"""The largest N accepted (each world size is one process playing one rank at a time)."""


def world_size_list(text: str) -> tuple[int, ...]:
    """``--measure-world-sizes``: comma-separated world sizes, each in ``[1, MAX_WORLD_SIZE]``, kept in order without repeats.

    Raises:
        argparse.ArgumentTypeError: an item that is not an integer, or out of range.
    """
    items = [item.strip() for item in text.split(",")]
    out: list[int] = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,8,64, got "
                                             f"{text.strip()!r} ({item!r} is not an integer)") from None
        if not 1 <= value <= MAX_WORLD_SIZE:
            raise argparse.ArgumentTypeError(f"world sizes must be from 1 to {MAX_WORLD_SIZE}, got {value} in "
                                             f"{text.strip()!r}; e.g. 1,8,64,256,1024")
        if value not in out:
            out.append(value)
    return tuple(out)


def mode_list(text: str) -> tuple[Mode, ...]:
    """``--measure-modes``: comma-separated :class:`~shardopt.fake_ranks.Mode` values, kept in order.

    Raises:
        argparse.ArgumentTypeError: an unknown mode.
    """
    known = {m.value: m for m in Mode}
    out: list[Mode] = []
    for item in (i.strip() for i in text.split(",")):
        if item not in known:
            raise argparse.ArgumentTypeError(f"unknown mode {item!r} in {text.strip()!r}; modes: {', '.join(known)}")
        if known[item] not in out:
            out.append(known[item])
    return tuple(out)


def _scale(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer such as 16, got {text.strip()!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}; e.g. 16 divides every width by 16")
    return value


def add_measure_args(parser: argparse.ArgumentParser) -> None:
    """The ``--measure`` options of ``shardopt estimate``."""
    parser.add_argument("--measure", action="store_true",
                        help="also build the real DDP / OSS / ShardedDataParallel / FullyShardedDataParallel for "
                             "sampled ranks of each N under torch's fake process group on a scaled-down copy of the "
                             "model (--model llama3-8b or --hf-config), and report each rank's bytes")
    parser.add_argument("--measure-world-sizes", metavar="N,N,...", type=world_size_list, default=None,
                        help=f"the N to measure (default {','.join(map(str, DEFAULT_WORLD_SIZES))}; N = 1 is always "
                             "measured, as the ideal share's reference)")
    parser.add_argument("--measure-modes", metavar="MODE,...", type=mode_list, default=None,
                        help=f"the modes to measure (default all: {', '.join(m.value for m in Mode)})")
    parser.add_argument("--measure-scale", metavar="K", type=_scale, default=None,
                        help=f"divide every width and the vocabulary by K (default {DEFAULT_SCALE}); each matrix keeps "
                             "its share of the model")


def check_measure_args(args: argparse.Namespace) -> DecoderShape | None:
    """The full-size shape ``--measure`` will scale and build, or ``None`` without ``--measure``.

    Args:
        args: the estimate command's arguments.

    Returns:
        The shape.

    Raises:
        ValueError: a ``--measure-*`` option without ``--measure``; ``--measure`` without a
            decoder shape (``--params``, or a ``--model`` that is not a shape preset); a
            scale that leaves a width at 0; an unreadable ``--hf-config``.
    """
    given = [f"--measure-{name}" for name in ("world-sizes", "modes", "scale")
             if getattr(args, f"measure_{name.replace('-', '_')}") is not None]
    if not args.measure:
        if given:
            raise ValueError(f"{given[0]} needs --measure; add --measure, or drop {given[0]}")
        return None
    shape = decoder_shape(args.model, args.hf_config)
    if shape is None:
        got = f"--params {args.params:g}" if args.params is not None else f"--model {args.model!r}"
        raise ValueError(f"--measure builds a scaled-down Llama-style decoder, so it needs --model (one of "
                         f"{', '.join(sorted(SHAPE_PRESETS))}) or --hf-config config.json; got {got}")
    scaled(shape, DEFAULT_SCALE if args.measure_scale is None else args.measure_scale)
    return shape


def decoder_shape(model: str | None, hf_config: str | None) -> DecoderShape | None:
    """The decoder shape ``--model``/``--hf-config`` name, or ``None`` (a bare count or a built module).

    Raises:
        ValueError: the config cannot be read (as :func:`~shardopt.app.shapes.read_hf_config`).
    """
    if hf_config is not None:
        return read_hf_config(hf_config)
    return SHAPE_PRESETS.get(model) if model is not None else None


@dataclass(frozen=True)
class Measurement:
    """What ``--measure`` measured.

    Attributes:
        shape: the scaled shape built.
        scale: the divisor applied to every width and the vocabulary.
        results: one per (mode, precision, world size).
        num_params: the scaled model's parameters.
    """

    shape: DecoderShape
    scale: int
    results: tuple[Measured, ...]
    num_params: int


def run_measure(shape: DecoderShape, scale: int, modes: Sequence[Mode] | None, world_sizes: Sequence[int] | None,
                mixed: Sequence[bool], stderr: bool) -> Measurement:
    """Scale ``shape``, measure each mode at each world size and precision, with a progress line on the console.

    Args:
        shape: the full-size shape.
        scale: the divisor (:func:`~shardopt.app.decoder.scaled`).
        modes: the modes, or ``None`` for all.
        world_sizes: the N, or ``None`` for :data:`DEFAULT_WORLD_SIZES`.
        mixed: the precisions (``True``: bf16 + fp32 masters).
        stderr: draw the progress on standard error.

    Returns:
        The results.

    Raises:
        ValueError: a bad scale (as :func:`~shardopt.app.decoder.scaled`).
    """
    small = scaled(shape, scale)
    chosen = list(Mode) if modes is None else list(modes)
    workload = Workload(partial(Decoder, small), partial(decoder_loss, vocab_size=small.vocab_size), DecoderLayer)
    console = Console(stderr=stderr)
    with console.status("measuring") as status:
        update: Callable[[str], None] = lambda line: status.update(f"measuring {line}")  # noqa: E731
        results = measure(workload, small.shapes(), chosen, mixed,
                          tuple(DEFAULT_WORLD_SIZES if world_sizes is None else world_sizes), progress=update)
    num_params = sum(math.prod(s) for s in small.shapes())
    return Measurement(small, scale, tuple(results), num_params)


def measure_for_args(shape: DecoderShape, args: argparse.Namespace, stderr: bool) -> Measurement:
    """:func:`run_measure` with the estimate command's options, then its table.

    The precision is the estimate's (bf16 + fp32 masters, or ``--fp32``); with ``--plot``
    both, as the plot has a panel for each.

    Args:
        shape: the full-size shape (:func:`check_measure_args`).
        args: the estimate command's arguments.
        stderr: print on standard error.

    Returns:
        The measurement.
    """
    mixed = (True, False) if args.plot else (not args.fp32,)
    measured = run_measure(shape, DEFAULT_SCALE if args.measure_scale is None else args.measure_scale,
                           args.measure_modes, args.measure_world_sizes, mixed, stderr)
    render_measured(measured, stderr=stderr)
    return measured
