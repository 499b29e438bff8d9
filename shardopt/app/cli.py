"""The ``shardopt`` command: ``demo``, ``bench`` and ``estimate``, with rich output.

- ``shardopt demo`` trains the built-in GPT on the built-in corpus on N local ranks started
  with torch's elastic launcher (or, unchanged, on the ranks ``torchrun`` started: the
  command notices torchrun's environment and runs as one of its ranks). Rank 0 draws a
  progress bar and ends with a per-rank table of memory, bytes sent, step time and loss.
- ``shardopt bench`` runs several modes one after another, each in its own process group,
  on the same model, data and seed, and compares them with DDP (see
  :mod:`shardopt.app.bench`).
- ``shardopt estimate`` prints the ZeRO paper's model-state bytes per rank and, for a model
  with known shapes, the heaviest rank under shardopt's real plans (whole and row-split).

Each subcommand's ``--help`` ends with examples (:data:`EXAMPLES`; a test parses every one).
``--json -`` writes the JSON to standard output and everything else to standard error.
Bad arguments end with one line ``shardopt <command>: error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

from shardopt import __version__
from shardopt.app.env_report import report_text
from shardopt.app.launch import run_launched, under_torchrun
from shardopt.app.estimate_cmd import run_estimate
from shardopt.app.measure import add_measure_args
from shardopt.app.models import PRESETS
from shardopt.app.modes import MODES, bench_names, get_mode, resolve
from shardopt.app.precision import PRECISIONS, REDUCE_DTYPES, Precision
from shardopt.app.rehearse_cmd import EXAMPLES as REHEARSE_EXAMPLES
from shardopt.app.rehearse_cmd import add_rehearse_parser, run_rehearse
from shardopt.app.runner import DEVICE_CHOICES, TrainJob
from shardopt.app.usage import check_writable as _check_writable
from shardopt.app.usage import fail as _fail
from shardopt.hybrid import plan_tiling

__all__ = ["EXAMPLES", "build_parser", "main"]

EXAMPLES = {
    "demo": (
        ("shardopt demo", "ZeRO-2 on 2 local CPU ranks, 300 steps"),
        ("shardopt demo --mode zero3 --world-size 4 --steps 100 --checkpoint out/demo.pt",
         "ZeRO-3; run it again with --resume to continue"),
        ("torchrun --nproc-per-node 2 -m shardopt demo --json - > demo.json", "under torchrun, JSON on stdout"),
    ),
    "bench": (
        ("shardopt bench --model tiny --steps 10 --modes zero2,zero3", "a quick look at two modes against DDP"),
        ("shardopt bench --rounds 3 --plot bench.png", "every fp32 mode, 3 interleaved rounds, a plot"),
        ("shardopt bench --modes zero2-bf16m,deepspeed-zero2-bf16m --json - > bench.json",
         "mixed precision against DeepSpeed"),
    ),
    "estimate": (
        ("shardopt estimate --params 7.5e9 --world-size 64", "the ZeRO paper's example: 120 / 31.4 / 16.6 / 1.9 GB"),
        ("shardopt estimate --model llama3-8b --world-size 64 --measure --plot llama.png",
         "the heaviest rank of the real plan, whole and split, measured for N = 1 to 1024 under torch's fake group"),
        ("shardopt estimate --hf-config path/to/config.json --world-size 8 --fp32 --offload cpu --json -",
         "a Hugging Face model's shapes, fp32 Adam, device and host bytes with and without offload"),
    ),
    "rehearse": REHEARSE_EXAMPLES,
    "convert": (
        ("shardopt convert out/ckpt-sharded out/hf/model.safetensors",
         "weights for from_pretrained (config.json beside it)"),
        ("shardopt convert out/ckpt-sharded out/full.pt", "weights, optimizer state and extra in one torch.save file"),
    ),
    "env": (
        ("shardopt env", "the block to paste into a bug report"),
        ("ATEN_CPU_CAPABILITY=avx2 shardopt env", "what torch dispatches with its CPU kernels lowered to AVX2"),
    ),
}
"""Per subcommand, ``(command line, what it does)``: the examples at the end of its ``--help``."""


def _epilog(command: str) -> str:
    return "examples:\n" + "\n".join(f"  # {what}\n  {line}" for line, what in EXAMPLES[command])


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) and exits with 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _checked(
    parse: Callable[[str], Any], expected: str, rules: Sequence[tuple[Callable[[Any], bool], str]],
    result: Callable[[Any], Any] = lambda value: value,
) -> Callable[[str], Any]:
    """An argparse ``type=``: parse ``text``, check each ``(ok, rule)`` in turn, and say which rule failed.

    ``parse`` failing (or overflowing) says what was ``expected``; argparse prefixes either
    message with the option's name, and :class:`_Parser` makes it one line with exit code 2.
    """

    def convert(text: str) -> Any:
        shown = text.strip() if len(text.strip()) <= 24 else f"{text.strip()[:12]}...({len(text.strip())} chars)"
        try:
            value = parse(text)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {shown!r}") from None
        for ok, rule in rules:
            if not ok(value):
                raise argparse.ArgumentTypeError(f"must be {rule}, got {shown}")
        return result(value)

    return convert


def _int_in(low: int, high: int, expected: str) -> Callable[[str], Any]:
    """An integer option in ``[low, high]``."""
    return _checked(int, expected, [(lambda v: v >= low, f">= {low}"), (lambda v: v <= high, f"<= {high}")])


# Note [option bounds]
# Upper bounds keep every value representable where it ends up, so a typo such as
# --steps 10**30 is a usage error instead of a rank's traceback: the data seed
# ((seed * 1_000_003 + step) * 1009 + micro) * 1031 + rank (shardopt.app.models.CharBatches) must
# fit in int64, which it does with seed < 1e6, steps <= 1e9, grad-accum <= 2**20 and
# world size <= 4096 (1.04e18 < 9.2e18); threads and local ranks are processes and OS threads
# of this machine, batch sizes become tensor sizes. Floats must be finite.
_MAX_STEPS = 10**9
_steps = _int_in(1, _MAX_STEPS, "a positive integer")
_step_count = _int_in(0, _MAX_STEPS, "an integer >= 0")
_batch = _int_in(1, 2**20, "a positive integer")
_local_ranks = _int_in(1, 4096, "a positive integer")
_thread_count = _int_in(1, 1024, "a positive integer")
_seed = _int_in(0, 999_999, "an integer from 0 to 999999")
_rounds = _int_in(1, 1000, "a positive integer")
_ranks = _int_in(1, 2**31 - 1, "a positive integer")
_finite = (math.isfinite, "a finite number")
_positive_float = _checked(float, "a positive number such as 1e-3", [_finite, (lambda v: v > 0, "> 0")])
_non_negative_float = _checked(float, "a number >= 0 such as 12", [_finite, (lambda v: v >= 0, ">= 0")])
_count = _checked(float, "a number such as 7.5e9",
                  [_finite, (lambda v: v >= 1, ">= 1"), (lambda v: v <= 1e18, "<= 1e18")], result=int)


def _add_run_args(p: argparse.ArgumentParser, steps: int, batch: int, preset: str) -> None:
    p.add_argument("--model", default=preset, choices=sorted(PRESETS), help=f"model preset (default {preset})")
    p.add_argument("--steps", type=_steps, default=steps, help=f"optimizer steps (default {steps})")
    p.set_defaults(default_batch_size=batch)  # --batch-size stays None when not given (demo's --global-batch-size)
    p.add_argument("--batch-size", type=_batch, default=None, help=f"sequences per rank per micro-batch "
                   f"(default {batch})")
    p.add_argument("--world-size", type=_local_ranks, default=None,
                   help="local ranks to start (default 2; under torchrun, torchrun decides)")
    p.add_argument("--warmup-steps", type=_step_count, default=2,
                   help="steps left out of timing and bytes statistics (default 2)")
    p.add_argument("--lr", type=_positive_float, default=1e-3, help="Adam learning rate (default 1e-3)")
    p.add_argument("--seed", type=_seed, default=0, help="model and data seed, 0 to 999999 (default 0)")
    p.add_argument("--threads-per-rank", type=_thread_count, default=None,
                   help="intra-op threads per rank (default: CPU cores / ranks)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON; - writes them to "
                   "standard output (tables and progress go to standard error)")
    p.add_argument("--shard-size", type=_local_ranks, default=None,
                   help="S, ranks per shard group for the hybrid modes (zero1-hybrid, zero2-hybrid): shard inside "
                   "groups of S consecutive ranks, replicate across them; must divide the world size")
    p.add_argument("--compile", action="store_true",
                   help="compile every transformer block with torch.compile (inductor; on the CPU it needs a C++ "
                   "compiler) before the mode wraps the model, the same in every mode; the first steps include "
                   "the compile time, so count them as warm-up (docs/compile.md)")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="auto: NCCL with one GPU per local rank when there are enough GPUs, else gloo on the CPU; "
                   "cuda: GPUs even when local ranks must share them (gloo then); cpu: gloo on the CPU "
                   "(default auto)")


def build_parser() -> argparse.ArgumentParser:
    """The ``shardopt`` argument parser (exposed for documentation and tests).

    Returns:
        The parser with ``demo``, ``bench``, ``env``, ``estimate`` and ``convert`` subcommands.
    """
    parser = _Parser(prog="shardopt", description="ZeRO-style sharded training for PyTorch: demo, benchmark, "
                     "memory estimate, environment report and checkpoint conversion")
    parser.add_argument("--version", action="version", version=f"shardopt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="train the built-in GPT on the built-in corpus",
                          description="Train the built-in GPT on Python's own sources on local ranks.",
                          epilog=_epilog("demo"), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_args(demo, steps=300, batch=8, preset="small")
    demo.add_argument("--mode", default="zero2", choices=list(MODES), help="how to train (default zero2)")
    demo.add_argument("--amp", choices=["bf16", "fp16"], default=None,
                      help="autocast dtype over fp32 parameters; fp16 adds a (sharded) gradient scaler")
    demo.add_argument("--precision", choices=PRECISIONS, default="fp32",
                      help="parameter precision: fp32 (default); bf16 (the model cast to bf16, Adam state bf16 too; "
                           "ddp, zero1, zero2); bf16-master (bf16 parameters, fp32 master weights and Adam state on "
                           "the rank that owns them, bf16 re-gather; zero1, zero2, deepspeed-zero2)")
    demo.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, default=None,
                      help="with --precision bf16-master and zero2 or deepspeed-zero2: send gradients to their owner "
                           "in fp32 (default) or bf16")
    demo.add_argument("--grad-accum", type=_batch, default=1,
                      help="micro-batches per step; all but the last run under no_sync (default 1)")
    demo.add_argument("--global-batch-size", type=_batch, default=None, metavar="G",
                      help="sequences per optimizer step over all ranks, instead of --batch-size: each rank takes "
                           "G / (world size x --grad-accum). A job restarted at another world size (torchrun "
                           "--nnodes 1:2, another --nproc-per-node) then trains on the same samples per step")
    demo.add_argument("--checkpoint", metavar="PATH", default=None,
                      help="save here at the end (one file; a torch.distributed.checkpoint folder for fsdp2 modes)")
    demo.add_argument("--save-every", type=_step_count, default=0,
                      help="also save every N steps (needs --checkpoint; default 0: only at the end)")
    resume = demo.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue from --checkpoint, which must exist (a missing one is an error)")
    resume.add_argument("--resume-if-exists", action="store_true",
                        help="continue from --checkpoint when it exists, else start from step 0 (for jobs that "
                             "are restarted by a scheduler)")

    bench = sub.add_parser("bench", help="compare modes side by side",
                           description="Run modes one after another on the same model, data and seed.",
                           epilog=_epilog("bench"), formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_run_args(bench, steps=10, batch=4, preset="27m")
    bench.add_argument("--modes", default=None,
                       help="comma-separated modes (default: every shardopt mode and installed peer in fp32); "
                            "a suffix picks the precision: -bf16 (bf16 parameters, as demo's --precision bf16), "
                            "-bf16m (bf16 parameters + fp32 masters on the owner, as --precision bf16-master), "
                            "-bf16m-bf16reduce (the same, gradients reduced in bf16); known: "
                            f"{', '.join(bench_names())}. A peer whose library is missing is skipped with a note")
    bench.add_argument("--rounds", type=_rounds, default=1,
                       help="run the list of modes this many times, interleaved, and pool each mode's step "
                            "times (default 1; use 3+ on a shared or noisy machine)")
    bench.add_argument("--plot", metavar="PNG", default=None, help="draw the comparison (needs matplotlib)")

    sub.add_parser("env", help="print what a bug report needs (versions, backends, CPU, GPUs)",
                   description="Print Python, torch, the distributed backends, the CPU kernels torch "
                               "dispatches, the GPUs\nand the installed integrations, as one block to paste "
                               "into a bug report.",
                   epilog=_epilog("env"), formatter_class=argparse.RawDescriptionHelpFormatter)

    est = sub.add_parser("estimate", help="model-state bytes per rank (ZeRO formulas and shardopt's real plans)",
                         description="Model-state memory per rank for DDP and ZeRO stages 1/2/3 by the ZeRO "
                                     "paper's formulas and,\nwhen the shapes are known (--model, --hf-config), on "
                                     "the heaviest rank of shardopt's ownership plans.",
                         epilog=_epilog("estimate"), formatter_class=argparse.RawDescriptionHelpFormatter)
    what = est.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_count, help="parameter count, e.g. 7.5e9")
    what.add_argument("--model", help="a preset name (llama3-8b: shapes only; or a built-in GPT) or "
                      "package.module:factory returning an nn.Module")
    what.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json of a Llama-style decoder "
                      "(its shapes; nothing is downloaded or built)")
    est.add_argument("--world-size", type=_ranks, required=True, help="data-parallel ranks")
    est.add_argument("--shard-size", type=_ranks, default=None, help="S: also plan hybrid sharding, shard groups "
                     "of S ranks replicated N/S times (optimizer and gradient shards of 1/S); must divide "
                     "--world-size")
    est.add_argument("--fp32", action="store_true", help="fp32 params/grads (default: mixed precision: bf16 "
                     "params with fp32 masters, as --precision bf16-master)")
    est.add_argument("--offload", choices=["cpu"], default=None,
                     help="also show each stage's bytes per parameter on the device and in host memory, without and "
                     "with OSS(offload='cpu') (masters, Adam state and the gradient buffer on the host; docs/memory.md)")
    est.add_argument("--delayed-update", action="store_true",
                     help="with --offload cpu: ZeRO-1/2 offload as OSS(offload='cpu', delay_update_after=k), whose host "
                     "also keeps the copy of the gradient buffer the delayed step reads (4 bytes per owned parameter)")
    est.add_argument("--optimizer-bytes", type=_non_negative_float, default=None,
                     help="K, optimizer bytes per parameter (default 12 mixed, 8 fp32)")
    est.add_argument("--json", metavar="PATH", default=None, help="also write the result as JSON; - writes it to "
                     "standard output (the table goes to standard error)")
    est.add_argument("--plot", metavar="PNG", default=None, help="draw bytes per rank against N = 1 to 1024, mixed "
                     "precision and fp32 (needs matplotlib); with --measure, the measured points too")
    add_measure_args(est)
    add_rehearse_parser(sub, _epilog("rehearse"))
    _add_convert(sub)
    return parser


# ---------------------------------------------------------------------- convert
def _add_convert(sub: Any) -> None:
    convert = sub.add_parser("convert", help="turn a sharded checkpoint folder into one file",
                             description="Read a folder written with checkpoint='sharded' (or save_sharded) in one "
                                         "process and write OUT:\n*.safetensors (the weights; name it "
                                         "model.safetensors next to config.json for from_pretrained),\n*.bin (the "
                                         "weights, torch.save) or any other name (weights, optimizer entries and "
                                         "extra, torch.save).",
                             epilog=_epilog("convert"), formatter_class=argparse.RawDescriptionHelpFormatter)
    convert.add_argument("dir", metavar="DIR", help="the sharded checkpoint folder")
    convert.add_argument("out", metavar="OUT", help="the file to write")


def _convert(args: argparse.Namespace) -> int:
    from shardopt.integrations.checkpoints import (
        convert_sharded,  # torch.distributed.checkpoint: only here
    )

    if not os.path.isdir(args.dir):
        _fail("convert", f"DIR {args.dir!r} is not a folder; pass the folder a sharded save wrote")
    _check_writable("convert", "OUT", args.out, folder=False, why="the converted checkpoint is written there")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        names = convert_sharded(args.dir, args.out)
    except (FileNotFoundError, ValueError) as exc:
        _fail("convert", str(exc))
    print(f"wrote {len(names)} tensors to {args.out}")
    return 0


def _resolve_world(command: str, args: argparse.Namespace) -> int:
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world:
            _fail(command, f"--world-size {args.world_size} differs from torchrun's WORLD_SIZE={world}; "
                  "leave --world-size out under torchrun")
        return world
    return 2 if args.world_size is None else int(args.world_size)


def _threads_per_rank(args: argparse.Namespace, world: int) -> int:
    if args.threads_per_rank is not None:
        return int(args.threads_per_rank)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return max(1, (os.cpu_count() or 1) // local)


def _check_device(command: str, args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        _fail(command, "--device cuda: torch sees no CUDA device here (a CPU build of torch, or no GPU); "
              "use --device auto or cpu")


def _check_shard_size(command: str, shard_size: int | None, world: int, modes: Sequence[str]) -> None:
    """``--shard-size`` goes with the hybrid modes, both ways, and divides the world size."""
    hybrid = [name for name in modes if resolve(name)[0].hybrid]
    if hybrid and shard_size is None:
        _fail(command, f"mode {hybrid[0]!r} shards inside groups of --shard-size S ranks: pass --shard-size S (a "
              f"divisor of the world size {world}, e.g. the ranks per node)")
    if shard_size is not None and not hybrid:
        names = ", ".join(n for n, m in MODES.items() if m.hybrid)
        _fail(command, f"--shard-size {shard_size} applies to the hybrid modes ({names}) only; pick one of them, or "
              "drop --shard-size")
    if shard_size is not None:
        try:
            plan_tiling(world, shard_size)
        except ValueError as exc:
            _fail(command, f"--shard-size: {exc}")


def _check_mode(command: str, name: str) -> None:
    reason = get_mode(name).unavailable()
    if reason is not None:
        _fail(command, reason)


# ---------------------------------------------------------------------- demo


def _demo(args: argparse.Namespace) -> int:
    world = _resolve_world("demo", args)
    _check_device("demo", args)
    precision = _demo_precision(args)  # before _check_mode, which imports the mode's library
    _check_mode("demo", args.mode)
    _check_shard_size("demo", args.shard_size, world, [args.mode])
    _check_needs_checkpoint(args)
    mode = get_mode(args.mode)
    checkpoint_path = os.path.abspath(args.checkpoint) if args.checkpoint else None
    if args.resume and checkpoint_path and not os.path.exists(checkpoint_path):
        _fail("demo", f"--resume: no checkpoint at {checkpoint_path!r}; check the path, or use --resume-if-exists "
              "to start from step 0 when there is none")
    if args.amp is not None and mode.autocast is not None:
        _fail("demo", f"--amp {args.amp}: mode {args.mode!r} autocasts its forward in {mode.autocast} itself; drop "
              f"--amp, or use --mode ddp --amp {args.amp}")
    scaler = mode.fp16_scaler
    if args.amp == "fp16" and scaler is None:
        supported = ", ".join(name for name, m in MODES.items() if m.fp16_scaler is not None)
        _fail("demo", f"--amp fp16 is supported with {supported}, not {args.mode!r}; use --amp bf16 (no scaler "
              "needed)")
    job = TrainJob(
        mode=args.mode, preset=args.model, steps=args.steps, batch_size=_demo_batch_size(args, world),
        grad_accum_steps=args.grad_accum, lr=args.lr, seed=args.seed, amp=args.amp, precision=precision,
        warmup_steps=args.warmup_steps, checkpoint_path=checkpoint_path, resume=args.resume or args.resume_if_exists,
        save_every_steps=args.save_every, threads_per_rank=_threads_per_rank(args, world), device=args.device,
        shard_size=args.shard_size, compile=args.compile,
    )
    if job.resume and checkpoint_path and os.path.exists(checkpoint_path) and _check_checkpoint(job, args):
        return 0
    if checkpoint_path and not mode.checkpoints:
        _fail("demo", f"--checkpoint is not supported with mode {mode.name!r} (shardopt cannot consolidate its "
              f"optimizer state); use one of {', '.join(n for n, m in MODES.items() if m.checkpoints)}, or drop "
              "--checkpoint")
    if checkpoint_path:
        kind = "a folder" if mode.sharded_checkpoint else "one file"
        _check_writable("demo", "--checkpoint", checkpoint_path, folder=mode.sharded_checkpoint,
                        why=f"mode {mode.name!r} saves {kind} there")
    if args.json:
        _check_writable("demo", "--json", args.json, folder=False, why="the results are written there")
    from shardopt.app.render import demo_rank

    results = run_launched("demo", demo_rank, world, job, args.json)
    return 0 if results else 1


def _demo_batch_size(args: argparse.Namespace, world: int) -> int:
    """Sequences per rank and micro-batch: ``--batch-size``, or ``--global-batch-size`` split over the ranks."""
    if args.global_batch_size is None:
        return int(args.batch_size or args.default_batch_size)
    if args.batch_size is not None:
        _fail("demo", f"--batch-size {args.batch_size} and --global-batch-size {args.global_batch_size} both set the "
              "batch; pass one of them")
    per_step = world * args.grad_accum
    if args.global_batch_size % per_step:
        _fail("demo", f"--global-batch-size {args.global_batch_size} does not split over {world} ranks x --grad-accum "
              f"{args.grad_accum}; pass a multiple of {per_step}")
    return int(args.global_batch_size // per_step)


def _demo_precision(args: argparse.Namespace) -> Precision:
    """``--precision`` and ``--reduce-dtype``, checked against each other, ``--amp`` and ``--mode``."""
    if args.amp is not None and args.precision != "fp32":
        _fail("demo", f"--amp {args.amp} autocasts fp32 parameters, but --precision {args.precision} makes them bf16; "
              "drop --amp, or use --precision fp32")
    if args.reduce_dtype is not None and args.precision != "bf16-master":
        _fail("demo", f"--reduce-dtype {args.reduce_dtype} picks how gradients reach the owner's fp32 masters; it "
              f"needs --precision bf16-master, not {args.precision}")
    precision = Precision(args.precision, args.reduce_dtype)
    reason = get_mode(args.mode).refuses(precision)
    if reason is not None:
        option = "--reduce-dtype" if precision.name in get_mode(args.mode).precisions else "--precision"
        _fail("demo", f"{option}: {reason}")
    return precision


def _check_needs_checkpoint(args: argparse.Namespace) -> None:
    """Options that only make sense with ``--checkpoint``."""
    if args.checkpoint:
        return
    for option, given, why in (("--resume", args.resume, "where to resume from"),
                               ("--resume-if-exists", args.resume_if_exists, "where to resume from"),
                               ("--save-every", args.save_every > 0, "where to save")):
        if given:
            _fail("demo", f"{option} needs --checkpoint PATH ({why})")


def _check_checkpoint(job: TrainJob, args: argparse.Namespace) -> bool:
    """Check the checkpoint a demo resumes from; ``True`` when the job is already done.

    A job restarted by a scheduler (``--resume-if-exists``) whose checkpoint is at ``--steps``
    has nothing left to do: it says so and exits 0 on every rank, so that torchrun's agent
    (or the scheduler) sees a finished job, not a failed one. With ``--resume`` it stays an
    error: that run asked to train on.
    """
    from shardopt.app.runner import NothingToTrain, check_resumable, global_batch

    assert job.checkpoint_path is not None
    try:
        saved = check_resumable(job.checkpoint_path, job)
    except NothingToTrain as exc:
        if not (args.resume_if_exists and exc.saved_step == job.steps):
            _fail("demo", str(exc))
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"shardopt demo: checkpoint {job.checkpoint_path!r} is already at step {job.steps} of "
                             "--steps: nothing left to do\n")
        return True
    except ValueError as exc:
        _fail("demo", str(exc))
    world = _resolve_world("demo", args)
    before, now = saved.get("global_batch"), global_batch(job, world)
    if before is not None and before != now and os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"shardopt demo: note: the checkpoint was trained with {before} sequences per step over "
                         f"{saved.get('world_size')} ranks, this run takes {now} over {world}: it trains on other "
                         f"samples than the saved run would have; pass --global-batch-size {before} to keep them\n")
    return False


# ---------------------------------------------------------------------- bench


def _bench(args: argparse.Namespace) -> int:
    if under_torchrun():
        _fail("bench", "bench starts its own process groups, one per mode; run it directly, not under torchrun")
    world = _resolve_world("bench", args)
    _check_device("bench", args)
    if args.steps <= args.warmup_steps:
        _fail("bench", f"--steps {args.steps} leaves nothing to measure after --warmup-steps {args.warmup_steps}; "
              f"use --steps >= {args.warmup_steps + 8} for a median over 8 steps")
    skipped: list[tuple[str, str]] = []
    if args.modes is None:
        # the hybrid modes join the default list when --shard-size says how to shard
        names = [n for n, m in MODES.items() if "fp32" in m.precisions and m.unavailable() is None
                 and (not m.hybrid or args.shard_size is not None)]
    else:
        names, skipped = _bench_modes(args.modes)
    _check_shard_size("bench", args.shard_size, world, names)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _fail("bench", "--plot needs matplotlib, which is not installed; pip install matplotlib, or drop --plot")
        _check_writable("bench", "--plot", args.plot, folder=False, why="the plot is written there")
    if args.json:
        _check_writable("bench", "--json", args.json, folder=False, why="the results are written there")
    names = ["ddp"] + [n for n in dict.fromkeys(names) if n != "ddp"]
    from shardopt.app.bench import BenchConfig, run_bench

    return run_bench(BenchConfig(
        modes=tuple(names), model=args.model, steps=args.steps, warmup_steps=args.warmup_steps,
        batch_size=args.batch_size or args.default_batch_size, lr=args.lr, seed=args.seed, rounds=args.rounds,
        world_size=world,
        threads_per_rank=_threads_per_rank(args, world), json_path=args.json, plot_path=args.plot,
        device=args.device, skipped=tuple(skipped), shard_size=args.shard_size, compile=args.compile,
    ))


def _bench_modes(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """``--modes``: the names to run, and ``(name, reason)`` for peers skipped because their library is missing.

    Unknown names and unsupported precisions are usage errors, as is an unavailable
    shardopt mode (a broken installation); a missing peer is skipped with a note so the
    other modes still run, unless nothing but the DDP reference would be left.
    """
    names, skipped = [], []
    for name in dict.fromkeys(n.strip() for n in text.split(",") if n.strip()):
        try:
            mode, _ = resolve(name)
        except ValueError as exc:
            _fail("bench", f"--modes: {exc}")
        reason = mode.unavailable()
        if reason is None:
            names.append(name)
        elif mode.peer:
            skipped.append((name, reason))
        else:
            _fail("bench", reason)
    if skipped and not [n for n in names if n != "ddp"]:
        _fail("bench", f"none of --modes can run here: {skipped[0][1]}")
    return names, skipped


def _env(args: argparse.Namespace) -> int:
    sys.stdout.write(report_text() + "\n")  # plain text to paste, not a rich table
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardopt`` console script and ``python -m shardopt``.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The exit code (0 on success). Bad arguments raise ``SystemExit(2)`` after one line
        on stderr; Ctrl-C ends every rank and exits 130.
    """
    args = build_parser().parse_args(argv)
    handlers = {"demo": _demo, "bench": _bench, "estimate": run_estimate, "env": _env, "convert": _convert,
                "rehearse": run_rehearse}
    return handlers[args.command](args)
