"""``shardopt rehearse``: play rank r of N of the real model at full size on this machine, and say
whether it fits and how fast it will step (docs/rehearse.md).

The options are checked first, each bad one ending the command with one line naming the
option, the value and the fix (:func:`check_args`); that includes a rank whose model states
alone (by shardopt's real ownership plan) exceed ``--device-memory``, or exceed what this
machine can hold to rehearse it. Then each rank in ``--ranks`` is rehearsed in turn under
torch's fake process group (:func:`shardopt.app.rehearse.rehearse_rank`), and the results are
printed as two rich tables (:mod:`shardopt.app.rehearse_render`) and optionally written as JSON.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console

from shardopt.app.precision import PRECISIONS, Precision
from shardopt.app.rehearse import MIN_STEPS, RankRehearsal, RehearsalConfig, heaviest_rank, rehearse_rank
from shardopt.app.rehearse_build import REHEARSED_MODES, model_spec, num_params, refuses, refuses_delay, unit_list
from shardopt.app.rehearse_render import render_rehearsal, rehearsal_json
from shardopt.app.render import JSON_TO_STDOUT, stdout_kept_for_json, write_json
from shardopt.app.step_model import Link
from shardopt.app.usage import check_writable, fail
from shardopt.hybrid import plan_tiling
from shardopt.memory import estimate_model_states, estimate_offload, estimate_plans

__all__ = ["EXAMPLES", "add_rehearse_parser", "check_args", "model_state_bound", "parse_size", "run_rehearse"]

EXAMPLES = (
    ("shardopt rehearse --model llama3-8b --world-size 64 --mode zero3 --device-memory 80GiB",
     "rank 0, the last and the heaviest rank of 64, ZeRO-3 bf16 with fp32 masters, on an 80 GiB device"),
    ("shardopt rehearse --model tinyllama-1.1b --world-size 1024 --mode zero2-split --seq-len 256 --ranks 0 "
     "--link-gbps 200 --latency-us 5", "one rank of 1024: its memory by category and its predicted step time"),
    ("shardopt rehearse --hf-config config.json --world-size 8 --activation-checkpointing --json -",
     "a Hugging Face model's shape, activations recomputed, JSON on standard output"),
)
"""``(command line, what it does)``: the examples at the end of ``--help``."""

MAX_WORLD_SIZE = 65536
DEFAULT_SEQ_LEN = 512
DEFAULT_LINK_GBPS = 100.0
DEFAULT_LATENCY_US = 10.0
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_MIN_DEVICE_BYTES = 2**20


def parse_size(text: str) -> int:
    """``--device-memory``: bytes from ``80GiB``, ``80GB``, ``80G`` (GiB), ``1.5TiB`` or a plain byte count.

    Raises:
        argparse.ArgumentTypeError: not a size, or under 1 MiB.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GiB, 80GB or 24G, got {text.strip()!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < _MIN_DEVICE_BYTES:
        raise argparse.ArgumentTypeError(f"must be at least 1MiB, got {text.strip()!r}; give the device's memory, "
                                         "e.g. 80GiB")
    return int(value)


def _int_range(low: int, high: int, example: str) -> Any:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer such as {example}, got {text.strip()!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {value}")
        return value

    return convert


def _number(strict: bool) -> Any:
    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number such as 100, got {text.strip()!r}") from None
        if not math.isfinite(value) or value < 0 or (strict and value == 0):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if strict else '>='} 0, got {text.strip()}")
        return value

    return convert


def _rank_list(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for item in (i.strip() for i in text.split(",")):
        if not item.isdigit():
            raise argparse.ArgumentTypeError(f"expected comma-separated ranks such as 0,63, got {text.strip()!r}")
        if int(item) not in out:
            out.append(int(item))
    return tuple(out)


def add_rehearse_parser(sub: Any, epilog: str) -> None:
    """Add the ``rehearse`` subcommand to the command's subparsers."""
    p = sub.add_parser("rehearse", help="play one rank of N at full size: will it fit, how fast will it step",
                       description="Build rank r of N of the real model at full size on this machine's device under "
                                   "torch's fake process group,\ntrain it on a real batch for a few steps, and report "
                                   "its peak memory by category, whether it fits\n--device-memory, its compute time, "
                                   "its bytes per step per process group, and a predicted step\ntime on --link-gbps "
                                   "and --latency-us (docs/rehearse.md).",
                       epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a preset (a Llama-style shape such as llama3-8b or tinyllama-1.1b, or a "
                      "built-in GPT such as 27m) or package.module:factory returning an nn.Module that maps token ids "
                      "(batch, seq) to logits (batch, seq, vocab)")
    what.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json of a Llama-style decoder")
    p.add_argument("--world-size", metavar="N", type=_int_range(1, MAX_WORLD_SIZE, "64"), required=True,
                   help="N, the data-parallel ranks of the run rehearsed")
    p.add_argument("--mode", choices=REHEARSED_MODES, default="zero2", help="how the run shards (default zero2)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="parameter precision (default bf16-master where the mode has it: bf16 parameters, fp32 "
                        "masters, the bench's -bf16m; zero3: fp32 shards, bf16 compute; ddp: bf16); the offload "
                        "modes take fp32 or bf16-master")
    p.add_argument("--delayed-update", action="store_true",
                   help="zero1-offload and zero2-offload: build the OSS with delay_update_after (the host also holds "
                        "the copy of the gradient buffer its delayed step reads; docs/rehearse.md)")
    p.add_argument("--shard-size", metavar="S", type=_int_range(1, MAX_WORLD_SIZE, "8"), default=None,
                   help="S, ranks per shard group of zero1-hybrid and zero2-hybrid; must divide --world-size")
    p.add_argument("--ranks", metavar="R,R,...", type=_rank_list, default=None,
                   help="the ranks to play (default: 0, the last rank and the plan's heaviest)")
    p.add_argument("--batch-size", metavar="B", type=_int_range(1, 2**20, "8"), default=1,
                   help="sequences per rank per step (default 1)")
    p.add_argument("--seq-len", metavar="T", type=_int_range(1, 2**24, "4096"), default=None,
                   help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's longest if shorter)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each block's activations in backward (torch.utils.checkpoint)")
    p.add_argument("--steps", metavar="K", type=_int_range(MIN_STEPS, 1000, "6"), default=MIN_STEPS,
                   help=f"training steps per rank: 3 tracked for memory, the rest timed (default {MIN_STEPS})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the rank runs: auto (a GPU when there is one), cpu, cuda (default auto)")
    p.add_argument("--device-memory", type=parse_size, default=None, metavar="SIZE",
                   help="the target device's memory, e.g. 80GiB (default: this machine's device: the GPU's total "
                        "memory, or the host's memory on the CPU)")
    p.add_argument("--link-gbps", metavar="GBPS", type=_number(strict=True), default=DEFAULT_LINK_GBPS,
                   help=f"the target's bandwidth per rank and direction, Gbit/s (default {DEFAULT_LINK_GBPS:g})")
    p.add_argument("--latency-us", metavar="US", type=_number(strict=False), default=DEFAULT_LATENCY_US,
                   help=f"the target's latency per message round, microseconds (default {DEFAULT_LATENCY_US:g})")
    p.add_argument("--overlap", choices=("auto", "yes", "no"), default="auto",
                   help="whether communication runs beside compute in the prediction: yes (a GPU's network "
                        "engines), no (CPU ranks, whose cores move the bytes themselves), auto (yes on a GPU, no on "
                        "the CPU; the default)")
    p.add_argument("--threads", metavar="T", type=_int_range(1, 1024, "8"), default=None,
                   help="intra-op threads (default: torch's, usually every core)")
    p.add_argument("--seed", type=_int_range(0, 999_999, "0"), default=0,
                   help="initialisation and data seed, 0 to 999999 (default 0)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="also write the results as JSON; - writes them to standard output (tables go to standard "
                        "error)")


@dataclass(frozen=True)
class Plan:
    """The checked options: what to rehearse and how to judge it.

    Attributes:
        config: the rehearsal (every rank).
        ranks: the ranks to play.
        device_memory: the target device's bytes.
        link: the target's link.
        num_params: the model's parameters.
        bounds: per rank, its model states by the plan (bytes; a lower bound of its peak).
        overlap: whether the prediction lets communication run beside compute (Note [the
            step time model] in :mod:`shardopt.app.step_model`).
    """

    config: RehearsalConfig
    ranks: tuple[int, ...]
    device_memory: int
    link: Link
    num_params: int
    bounds: dict[int, float]
    overlap: bool = True


def _device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        fail("rehearse", "--device cuda: torch sees no CUDA device here; use --device auto or cpu")
    return torch.device("cuda" if choice != "cpu" and torch.cuda.is_available() else "cpu")


def _host_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def model_state_bound(mode: str, precision: Precision, shapes: Sequence[Sequence[int]], world_size: int,
                      shard_size: int | None, rank: int) -> float:
    """Bytes of ``rank``'s model states by shardopt's ownership plan: a lower bound of its peak.

    ddp holds everything; zero1 and zero2 hold the parameters (and zero1 the gradients)
    whole and the optimizer state (zero2: and the gradients) of what the plan gives the
    heaviest rank (:func:`shardopt.memory.estimate_plans`, over S ranks for the hybrid
    modes; with masters, the owner's fp32 master gradients at the step); zero3 holds 1/N of
    everything (fp32 shards with bf16-master). Every rank is charged the heaviest rank's
    share, so the bound holds for each. The offload modes are bounded by their device side
    (:func:`shardopt.memory.estimate_offload`): the parameters (zero1-offload: and their
    gradients), nothing for zero3-offload.
    """
    mixed = precision.name != "fp32"
    k = {"fp32": 8.0, "bf16": 4.0, "bf16-master": 12.0}[precision.name]
    numel = sum(math.prod(s) for s in shapes)
    if mode.endswith("-offload"):  # the device side only (Note [offload bytes per parameter] in shardopt.memory)
        stage = {"zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}[mode.removesuffix("-offload")]
        row = next(r for r in estimate_offload(world_size, mixed) if r.stage == stage and r.offload)
        return row.device * numel
    if mode == "zero3":
        return (4 + 4 + 8) * numel / world_size
    if mode == "ddp":
        return estimate_model_states(numel, world_size, mixed, k).ddp
    ranks = shard_size if mode.endswith("hybrid") and shard_size is not None else world_size
    plan = estimate_plans(shapes, ranks, mixed, k)
    split = mode != "zero2"
    masters = precision.name == "bf16-master"
    if mode.startswith("zero1"):
        return plan.stage1_at_step(split) if masters else plan.stage1(split)
    return plan.stage2_at_step(split) if masters else plan.stage2(split)


def _gib(value: float) -> str:
    """Bytes as GiB with two decimals, or MiB below a GiB."""
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.2f} MiB"


def _ranks(args: argparse.Namespace, spec_shapes: list[tuple[int, ...]], precision: Precision) -> tuple[int, ...]:
    n = args.world_size
    if args.ranks is not None:
        bad = [r for r in args.ranks if r >= n]
        if bad:
            fail("rehearse", f"--ranks {','.join(map(str, args.ranks))}: rank {bad[0]} is not below --world-size {n}; "
                 f"give ranks from 0 to {n - 1}")
        return tuple(args.ranks)
    width = 4 if precision.name == "fp32" else 2
    heavy = heaviest_rank(args.mode, spec_shapes, n, args.shard_size, width)
    return tuple(sorted({0, n - 1} | ({heavy} if heavy is not None else set())))


def check_args(args: argparse.Namespace) -> Plan:
    """Check every option before anything is built; a bad one ends the command with one line.

    Returns:
        The plan.
    """
    if args.json:
        check_writable("rehearse", "--json", args.json, folder=False, why="the results are written there")
    hybrid = args.mode.endswith("hybrid")
    if hybrid and args.shard_size is None:
        fail("rehearse", f"--mode {args.mode} shards inside groups of --shard-size S ranks: pass --shard-size S, a "
             f"divisor of --world-size {args.world_size} (e.g. the ranks per node)")
    delay_reason = refuses_delay(args.mode) if args.delayed_update else None
    if delay_reason is not None:
        fail("rehearse", delay_reason)
    if args.shard_size is not None and not hybrid:
        fail("rehearse", f"--shard-size {args.shard_size} applies to --mode zero1-hybrid and zero2-hybrid only; pick "
             "one of them, or drop --shard-size")
    if args.shard_size is not None:
        try:
            plan_tiling(args.world_size, args.shard_size)
        except ValueError as exc:
            fail("rehearse", f"--shard-size {args.shard_size} with --world-size {args.world_size}: {exc}")
    name = args.precision or ("bf16" if args.mode == "ddp" else "bf16-master")
    precision = Precision(name)
    reason = refuses(args.mode, precision)
    if reason is not None:
        fail("rehearse", reason)
    try:
        spec = model_spec(args.model, args.hf_config)
    except ValueError as exc:
        fail("rehearse", str(exc))
    seq_len = args.seq_len or min(DEFAULT_SEQ_LEN, spec.max_seq_len or DEFAULT_SEQ_LEN)
    if spec.max_seq_len is not None and seq_len > spec.max_seq_len:
        fail("rehearse", f"--seq-len {seq_len} exceeds --model {spec.name}'s {spec.max_seq_len} positions; give "
             f"--seq-len {spec.max_seq_len} or less")
    with torch.device("meta"):
        blocks = unit_list(spec.build())
    if args.activation_checkpointing and blocks is None:
        fail("rehearse", f"--activation-checkpointing: --model {spec.name!r} has no nn.ModuleList of repeated blocks "
             "to checkpoint; drop the flag")
    count, shapes = num_params(spec)
    ranks = _ranks(args, shapes, precision)
    device = _device(args.device)
    device_memory = args.device_memory or _capacity(device)
    bounds = {r: model_state_bound(args.mode, precision, shapes, args.world_size, args.shard_size, r) for r in ranks}
    need = max(bounds.values())
    if need > device_memory:
        option = f"--device-memory {_gib(device_memory)}" if args.device_memory else \
            f"this device's memory ({_gib(device_memory)})"
        fail("rehearse", f"{option} is too small for --model {spec.name} in --mode "
             f"{args.mode} at --world-size {args.world_size}: a rank's model states alone take {_gib(need)} by the "
             "ownership plan, before activations and buffers; raise --world-size, use a mode that shards more "
             "(zero3 holds 1/N of everything), or give a larger --device-memory")
    available = _available(device)
    if available is not None and need > available:
        fail("rehearse", f"this machine cannot hold the rank to rehearse it: --model {spec.name} in --mode {args.mode} "
             f"at --world-size {args.world_size} needs {_gib(need)} for model states alone and {device.type} has "
             f"{_gib(available)} available; raise --world-size, use --mode zero3, or rehearse on a larger machine")
    config = RehearsalConfig(spec, args.mode, precision, args.world_size, args.shard_size, args.batch_size, seq_len,
                             args.activation_checkpointing, args.steps, args.seed, device.type, args.threads,
                             args.delayed_update)
    overlap = device.type != "cpu" if args.overlap == "auto" else args.overlap == "yes"
    return Plan(config, ranks, device_memory, Link(args.link_gbps, args.latency_us), count, bounds, overlap)


def _capacity(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = _host_bytes("MemTotal")
    return total if total is not None else 2**40


def _available(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return _host_bytes("MemAvailable")


def run_rehearse(args: argparse.Namespace) -> int:
    """``shardopt rehearse`` with its parsed arguments; the exit code."""
    plan = check_args(args)
    to_stdout = args.json == JSON_TO_STDOUT
    console = Console(stderr=True)
    results: list[RankRehearsal] = []
    with stdout_kept_for_json(to_stdout) as json_stream:
        with console.status("rehearsing") as status:
            for rank in plan.ranks:
                def progress(line: str, rank: int = rank) -> None:
                    status.update(f"rank {rank} of {plan.config.world_size}: {line}")

                try:
                    results.append(rehearse_rank(plan.config, rank, progress))
                except ValueError as exc:
                    fail("rehearse", str(exc))
        render_rehearsal(plan, results, stderr=to_stdout)
        if args.json:
            write_json(args.json, rehearsal_json(plan, results), json_stream)
    return 0

