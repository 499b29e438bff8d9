"""The training modes the ``shardopt`` command can run, shardopt's own and peers', by name.

Each :class:`Mode` says what it needs (a shardopt component that may not be built yet, or a
third-party peer such as fairscale) and how to wrap a freshly built model into a
:class:`Wrapped` model + optimizer. Peers are imported inside :meth:`Mode.unavailable` and
the builders, never at module import, so ``import shardopt`` never imports fairscale.

Modes: ``ddp`` (torch DDP + Adam: the reference), ``zero1`` (DDP + :class:`~shardopt.optim.
OSS`), ``zero2`` (OSS + ``shardopt.nn.ShardedDataParallel``, every parameter whole),
``zero2-split`` (the same with large parameters split across ranks), ``zero1-hybrid`` (OSS
planned over shard groups of ``--shard-size`` ranks under DDP), ``zero2-hybrid`` (hybrid
ZeRO-2, Note [zero2-hybrid mode]), ``zero3``
(``shardopt.nn.FullyShardedDataParallel``); peers ``torch-zero`` (DDP + torch's
``ZeroRedundancyOptimizer``), ``fairscale`` (fairscale OSS + ShardedDDP with
``zero_grad(set_to_none=False)``), ``fairscale-default`` (the same with the optimizer's
default ``zero_grad()``), ``fsdp2`` and ``fsdp2-reshard`` (torch ``fully_shard`` with
``reshard_after_forward`` False and True), ``deepspeed-zero2`` (DeepSpeed's ZeRO-2 engine
with bf16 parameters and fp32 masters, torch Adam). ``ddp-amp`` (DDP, bf16 autocast, fused
Adam), ``zero1-offload``, ``zero2-offload`` (``OSS(..., offload="cpu")``), ``zero3`` and
``zero3-offload`` (``cpu_offload=CPUOffload(offload_params=True)``) and the peers ``fsdp2``,
``fsdp2-reshard`` and ``fsdp2-offload`` are built in :mod:`shardopt.app.offload_modes` (Note
[offload modes]).

A mode runs at one :class:`~shardopt.app.precision.Precision` out of those it lists in
:attr:`Mode.precisions`; :func:`resolve` reads a bench mode name such as
``zero2-bf16m-bf16reduce`` as a mode and a precision and says which combinations exist.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardopt.app.offload_modes import (build_ddp_amp, build_zero1_offload, build_zero2_offload, fsdp2_builder,
                                        zero3_builder)
from shardopt.app.precision import Precision
from shardopt.app.wrapping import Builder, Setup, Wrapped, ddp_of, oss_of
from shardopt.hybrid import HybridLayout, resolve_layout

__all__ = ["MODES", "OWN_MODES", "PEER_MODES", "Mode", "Setup", "Wrapped", "bench_names", "full_parameters",
           "get_mode", "load_optimizer_state", "resolve"]




@dataclass(frozen=True)
class Mode:
    """One way to train data-parallel.

    Attributes:
        name: the CLI name.
        summary: one line for help and tables.
        requires: ``(module, attribute)`` that must import, or ``None``.
        install_hint: what to do when it is missing.
        build: ``build(module, lr, device)`` -> :class:`Wrapped`; called on every rank.
        peer: whether this is another library's implementation (benchmark comparison).
        sharded_checkpoint: the demo saves a ``torch.distributed.checkpoint`` folder (DTensor
            models) instead of one consolidated file.
        fp16_scaler: the gradient scaler fp16 autocast uses: ``"torch"`` (gradients are full
            and identical on every rank), ``"sharded"`` (ShardedGradScaler: ranks see
            different gradients and must agree on inf/nan), or ``None`` (fp16 unsupported).
        checkpoints: the demo can save and resume this mode (peers whose optimizer state
            :mod:`shardopt.checkpoint` cannot consolidate cannot).
        precisions: the :attr:`Precision.name` values this mode runs at, its default first.
        reduce_dtypes: the ``Precision.reduce_dtype`` values ``bf16-master`` may choose
            here (empty: the mode reduces in its own way and the choice is refused).
        before_import: called with the device type the ranks train on (``None`` where it is
            not known yet) before the mode's library is first imported (DeepSpeed picks its
            accelerator at import time).
        hybrid: the mode shards inside groups of :attr:`Setup.shard_size` ranks and
            replicates across them (``--shard-size``; docs/hybrid.md).
        autocast: the autocast dtype (``"bf16"``) the runner puts the forward under for a mode
            that is defined by it (``ddp-amp``; Note [offload modes] in
            :mod:`shardopt.app.offload_modes`); ``None``: only ``--amp`` autocasts.
    """

    name: str
    summary: str
    requires: tuple[str, str] | None
    install_hint: str
    build: Builder
    peer: bool = False
    sharded_checkpoint: bool = False
    fp16_scaler: str | None = None
    checkpoints: bool = True
    precisions: tuple[str, ...] = ("fp32",)
    reduce_dtypes: tuple[str, ...] = ()
    before_import: Callable[[str | None], None] | None = None
    hybrid: bool = False
    autocast: str | None = None

    def wrap(self, module: nn.Module, setup: Setup) -> Wrapped:
        """:attr:`build` after casting ``module`` to the precision's parameter dtype (and,
        with :attr:`Setup.compile`, compiling its blocks), with :attr:`Wrapped.param_names`
        read before it is wrapped.

        Args:
            module: the freshly built fp32 model (the same on every rank).
            setup: learning rate, device, precision and batch shape.

        Returns:
            The wrapped model and its optimizer.

        Raises:
            ValueError: this mode does not run at ``setup.precision`` (see :meth:`refuses`).
        """
        reason = self.refuses(setup.precision)
        if reason is not None:
            raise ValueError(reason)
        names = tuple(name for name, _ in module.named_parameters())
        if setup.precision.param_dtype != torch.float32:
            module = module.to(setup.precision.param_dtype)
        if setup.compile:  # Note [--compile in every mode]
            for block in module.get_submodule("blocks").children():
                block.compile()
        wrapped = self.build(module, setup)
        wrapped.param_names = names
        return wrapped

    def refuses(self, precision: Precision) -> str | None:
        """``None`` when this mode runs at ``precision``, else a one-line reason naming what does."""
        if precision.name not in self.precisions:
            modes = ", ".join(n for n, m in MODES.items() if precision.name in m.precisions)
            return (f"mode {self.name!r} does not run at precision {precision.name!r} ({precision.describe()}); it "
                    f"runs at {', '.join(self.precisions)}; modes with {precision.name}: {modes}")
        if precision.reduce_dtype is not None and precision.reduce_dtype not in self.reduce_dtypes:
            modes = ", ".join(n for n, m in MODES.items() if m.reduce_dtypes)
            return (f"mode {self.name!r} cannot choose the gradient reduce dtype (reduce dtype "
                    f"{precision.reduce_dtype!r}); modes that can: {modes}")
        return None

    def unavailable(self, device_type: str | None = None) -> str | None:
        """``None`` when this mode can run here, else a one-line reason with the fix.

        Args:
            device_type: where the ranks train (``"cpu"``, ``"cuda"``), when known: a
                rank passes it before its first import of the mode's library.
        """
        if self.requires is None:
            return None
        if self.before_import is not None:
            self.before_import(device_type)
        module_name, attr = self.requires
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return f"mode {self.name!r} needs {module_name}, which is not installed; {self.install_hint}"
        if not hasattr(module, attr):
            return f"mode {self.name!r} needs {module_name}.{attr}, which this installation lacks; {self.install_hint}"
        return None


# Note [--compile in every mode]
# `shardopt demo/bench --compile` compiles every transformer block in place (`block.compile()`,
# torch.compile's default inductor backend) after the precision cast and before the mode
# wraps the model: torchtitan's order (checkpointing, compile, shard), and the one recipe
# that compiles the same code in every mode. Under zero3 a graph ends at every unit, so
# compiling the whole wrapper would compile the blocks and nothing else (the GPT calls its
# block units in a loop, whose frame Dynamo then runs eagerly: Note [compiling
# FullyShardedDataParallel] in shardopt.nn.fsdp.compiling); ddp, zero1 and zero2 could compile
# the whole model into one graph, but then a bench would compare different compiled code. So
# in every mode the blocks run compiled and the embeddings, the final norm, the head and the
# loss run eagerly. Parameter names do not change (no `_orig_mod.`), so checkpoints move
# between compiled and eager runs. docs/compile.md has the recipes for user scripts.


def _build_ddp(module: nn.Module, setup: Setup) -> Wrapped:
    model = ddp_of(module, setup)
    opt = torch.optim.Adam(module.parameters(), lr=setup.lr)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))


def _build_zero1(module: nn.Module, setup: Setup) -> Wrapped:
    model = ddp_of(module, setup)
    opt = oss_of(module, setup)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))


def _zero2_builder(split_large_params: bool) -> Builder:
    """ZeRO-2 with every parameter whole (``zero2``, as before OSS could split) or with large
    ones split across ranks (``zero2-split``; Note [split parameters in buckets] in
    shardopt.nn.data_parallel.grad_buckets)."""

    def build(module: nn.Module, setup: Setup) -> Wrapped:
        from shardopt.nn import ShardedDataParallel

        opt = oss_of(module, setup, split_large_params=split_large_params)
        # reduce_dtype None: fp32 gradients travel in fp32, bf16 ones in the masters' dtype (fp32)
        model = ShardedDataParallel(module, opt, reduce_dtype=setup.precision.wire_dtype)
        return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))

    return build


def _layout(setup: Setup) -> HybridLayout:
    if setup.shard_size is None:
        raise ValueError("a hybrid mode needs Setup.shard_size (shardopt demo/bench --shard-size S)")
    return resolve_layout(shard_size=setup.shard_size)


def _build_zero1_hybrid(module: nn.Module, setup: Setup) -> Wrapped:
    """Hybrid ZeRO-1 (docs/hybrid.md): OSS planned over the shard group, DDP over the world."""
    opt = oss_of(module, setup, group=_layout(setup).shard_group)
    model = ddp_of(module, setup)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))


# Note [zero2-hybrid mode]
# Hybrid ZeRO-2 is OSS and ShardedDataParallel both given the layout as shard_size=S: ownership
# planned over the shard group, each bucket reduced inside it and the owner's part all-reduced
# across the replicate group (Note [hybrid reduction] in
# shardopt.nn.data_parallel.replicas).


def _build_zero2_hybrid(module: nn.Module, setup: Setup) -> Wrapped:
    """Hybrid ZeRO-2 (Note [zero2-hybrid mode])."""
    from shardopt.nn import ShardedDataParallel

    layout: dict[str, Any] = {"shard_size": _layout(setup).shard_size}  # checked on every rank first
    opt = oss_of(module, setup, **layout)
    model = ShardedDataParallel(module, opt, reduce_dtype=setup.precision.wire_dtype, **layout)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))


def _build_torch_zero(module: nn.Module, setup: Setup) -> Wrapped:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = ddp_of(module, setup)
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, lr=setup.lr)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))


def _fairscale_builder(set_to_none: bool | None) -> Builder:
    def build(module: nn.Module, setup: Setup) -> Wrapped:
        from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP
        from fairscale.optim import OSS as FairscaleOSS

        opt = FairscaleOSS(module.parameters(), optim=torch.optim.Adam, lr=setup.lr)
        model = FairscaleSDP(module, opt)
        zero_grad: Callable[[], None] = opt.zero_grad if set_to_none is None else (
            lambda: opt.zero_grad(set_to_none=False))
        return Wrapped(model, module, opt, model.no_sync, zero_grad)

    return build


# Note [deepspeed peer]
# deepspeed-zero2 is DeepSpeed's own ZeRO-2 (stage_1_and_2.DeepSpeedZeroOptimizer) with
# bf16 parameters and fp32 master partitions, over the same model, data, torch Adam and lr
# as the other modes, inside the process group the runner already made (deepspeed.comm
# wraps it; its collectives are torch.distributed calls, so on gloo the bench counts its
# bytes in wchar as it counts ours). Choices, each so that it runs where the others run:
# - The optimizer is a torch.optim.Adam instance ("zero_allow_untested_optimizer"): DeepSpeed
#   swaps its parameters for the fp32 partitions, so it steps the masters as ours does, and
#   no compiled DeepSpeed op (FusedAdam, CPUAdam) is needed.
# - Reduce dtype: communication_data_type is set explicitly, fp32 for deepspeed-zero2-bf16m
#   (like zero2-bf16m) and bf16 for -bf16reduce (DeepSpeed's own default with bf16).
# - Buckets: reduce and all-gather buckets of 2**23 elements, ShardedDataParallel's
#   reduce_buffer_size (DeepSpeed's default of 5e8 would allocate a 1 GB bf16 buffer);
#   overlap_comm off (no CUDA streams on CPU).
# - Nothing prints inside a step (steps_per_print None, no wall-clock breakdown): wchar
#   counts terminal writes too.
# - On CPU its TorchBackend would JIT-compile a shared-memory all-reduce op on first use
#   (about a minute of C++ on a 2-core machine, and a compiler on every machine) that only
#   its inference_all_reduce uses; the builder skips that op, so training collectives are
#   the plain torch.distributed ones either way.
# - Accumulation: DeepSpeed's stage 2 cannot skip reduction (its no_sync asserts), so
#   no_sync marks the micro-batch as not an accumulation boundary instead and the last one
#   is; the loss is already divided by the runner, so backward does not scale it again.


def _deepspeed_accelerator(device_type: str | None) -> None:
    """Pick DeepSpeed's CPU accelerator for ranks training on the CPU (``--device cpu``, or no
    CUDA): it takes CUDA whenever torch sees it, and would put the model on a GPU."""
    if device_type == "cpu" or not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _build_deepspeed_zero2(module: nn.Module, setup: Setup) -> Wrapped:
    import deepspeed

    if setup.device.type == "cpu":  # Note [deepspeed peer]: the inference-only shm op
        # by module path: the attribute deepspeed.comm.torch is the torch package itself
        ds_torch_backend: Any = importlib.import_module("deepspeed.comm.torch")
        ds_torch_backend.build_shm_op = lambda: None
    bucket = 2**23  # ShardedDataParallel's reduce_buffer_size
    config = {
        "train_micro_batch_size_per_gpu": setup.batch_size,
        "gradient_accumulation_steps": setup.grad_accum_steps,
        "bf16": {"enabled": True},
        "communication_data_type": setup.precision.reduce_dtype or "fp32",
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                              "reduce_bucket_size": bucket, "allgather_bucket_size": bucket},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": None,
        "wall_clock_breakdown": False,
    }
    opt = torch.optim.Adam(module.parameters(), lr=setup.lr)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)

    @contextlib.contextmanager
    def accumulate() -> Iterator[None]:
        engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            engine.set_gradient_accumulation_boundary(True)

    def backward(loss: torch.Tensor) -> None:
        engine.backward(loss, scale_wrt_gas=False)

    return Wrapped(engine, module, ds_optimizer, accumulate, engine.zero_grad, backward=backward, step=engine.step)


_FAIRSCALE_HINT = "install it with: pip install fairscale==0.4.13"
_DEEPSPEED_HINT = "install it with: DS_BUILD_OPS=0 pip install deepspeed"
_OWN_HINT = "update shardopt to a version that ships it, or pick another mode"
_BF16 = ("fp32", "bf16")
_MASTERS = ("fp32", "bf16", "bf16-master")
_OFFLOAD = ("fp32", "bf16-master")  # a plain bf16 model would step bf16 mirrors on the host: not offered

MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("ddp", "torch DDP + Adam (reference)", None, "", _build_ddp, fp16_scaler="torch", precisions=_BF16),
    Mode("ddp-amp", "torch DDP, fp32 parameters, bf16 autocast forward, fused Adam", None, "", build_ddp_amp,
         autocast="bf16"),
    Mode("zero1", "DDP + shardopt OSS (ZeRO-1)", None, "", _build_zero1, fp16_scaler="sharded", precisions=_MASTERS),
    Mode("zero1-offload", "DDP + shardopt OSS(offload='cpu'): masters, grads, Adam state and step on the host", None,
         "", build_zero1_offload, fp16_scaler="sharded", precisions=_OFFLOAD),
    Mode("zero2", "shardopt OSS + ShardedDataParallel (ZeRO-2), whole parameters", ("shardopt.nn", "ShardedDataParallel"),
         _OWN_HINT, _zero2_builder(False), fp16_scaler="sharded", precisions=_MASTERS, reduce_dtypes=("fp32", "bf16")),
    Mode("zero2-offload", "shardopt ZeRO-2, whole parameters, OSS(offload='cpu')", ("shardopt.nn", "ShardedDataParallel"),
         _OWN_HINT, build_zero2_offload, fp16_scaler="sharded", precisions=_OFFLOAD, reduce_dtypes=("fp32", "bf16")),
    Mode("zero2-split", "shardopt ZeRO-2, large parameters split across ranks", ("shardopt.nn", "ShardedDataParallel"),
         _OWN_HINT, _zero2_builder(True), fp16_scaler="sharded", precisions=_MASTERS, reduce_dtypes=("fp32", "bf16")),
    Mode("zero1-hybrid", "DDP + shardopt OSS over shard groups of --shard-size ranks (hybrid ZeRO-1)", None, "",
         _build_zero1_hybrid, fp16_scaler="sharded", precisions=_MASTERS, hybrid=True),
    Mode("zero2-hybrid", "shardopt ZeRO-2 sharded inside groups of --shard-size ranks, replicated across them",
         ("shardopt.nn", "ShardedDataParallel"), _OWN_HINT, _build_zero2_hybrid, fp16_scaler="sharded",
         precisions=_MASTERS, reduce_dtypes=("fp32", "bf16"), hybrid=True),
    Mode("zero3", "shardopt FullyShardedDataParallel (ZeRO-3)", ("shardopt.nn.fsdp", "FullyShardedDataParallel"),
         _OWN_HINT, zero3_builder(False), fp16_scaler="sharded"),
    Mode("zero3-offload", "shardopt ZeRO-3, cpu_offload=CPUOffload(offload_params=True)",
         ("shardopt.nn.fsdp", "CPUOffload"), _OWN_HINT, zero3_builder(True), fp16_scaler="sharded"),
    Mode("torch-zero", "DDP + torch ZeroRedundancyOptimizer", ("torch.distributed.optim", "ZeroRedundancyOptimizer"),
         "it ships with torch.distributed", _build_torch_zero, peer=True, fp16_scaler="torch", checkpoints=False),
    Mode("fairscale", "fairscale OSS + ShardedDDP, zero_grad(set_to_none=False)", ("fairscale", "__version__"),
         _FAIRSCALE_HINT, _fairscale_builder(False), peer=True, checkpoints=False),
    Mode("fairscale-default", "fairscale OSS + ShardedDDP, default zero_grad()", ("fairscale", "__version__"),
         _FAIRSCALE_HINT, _fairscale_builder(None), peer=True, checkpoints=False),
    Mode("fsdp2", "torch fully_shard, reshard_after_forward=False", ("torch.distributed.fsdp", "fully_shard"),
         "it needs torch >= 2.6", fsdp2_builder(False), peer=True, sharded_checkpoint=True),
    Mode("fsdp2-reshard", "torch fully_shard, reshard_after_forward=True", ("torch.distributed.fsdp", "fully_shard"),
         "it needs torch >= 2.6", fsdp2_builder(True), peer=True, sharded_checkpoint=True),
    Mode("fsdp2-offload", "torch fully_shard, CPUOffloadPolicy (shards, grads, Adam on the host)",
         ("torch.distributed.fsdp", "CPUOffloadPolicy"), "it needs torch >= 2.6", fsdp2_builder(True, offload=True),
         peer=True, sharded_checkpoint=True),
    Mode("deepspeed-zero2", "DeepSpeed ZeRO-2 engine, bf16 params + fp32 masters, torch Adam",
         ("deepspeed", "initialize"), _DEEPSPEED_HINT, _build_deepspeed_zero2, peer=True, checkpoints=False,
         precisions=("bf16-master",), reduce_dtypes=("fp32", "bf16"), before_import=_deepspeed_accelerator),
)}
OWN_MODES = tuple(name for name, m in MODES.items() if not m.peer)
PEER_MODES = tuple(name for name, m in MODES.items() if m.peer)


def get_mode(name: str) -> Mode:
    """The :class:`Mode` called ``name``.

    Raises:
        ValueError: no mode has that name (the message lists them).
    """
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    return MODES[name]


def bench_names() -> list[str]:
    """Every bench mode name: each mode at each precision it runs at, ``-bf16m`` modes that
    choose their reduce dtype also with ``-bf16reduce`` (what :func:`resolve` accepts)."""
    names = []
    for mode in MODES.values():
        for name in mode.precisions:
            names.append(f"{mode.name}{Precision(name).suffix}")
            if name == "bf16-master" and "bf16" in mode.reduce_dtypes:
                names.append(f"{mode.name}{Precision(name, 'bf16').suffix}")
    return names


def resolve(run_name: str) -> tuple[Mode, Precision]:
    """The mode and precision a bench mode name stands for, e.g. ``zero2-bf16m`` or ``ddp``.

    How it works: the name is a mode of :data:`MODES` followed by an optional precision
    suffix (``-bf16``, ``-bf16m``, then optionally ``-bf16reduce``; see
    :mod:`shardopt.app.precision`); without one the precision is fp32, except for a mode
    that does not run in fp32, which must name its precision.

    Args:
        run_name: the name as given to ``--modes``.

    Returns:
        ``(mode, precision)``.

    Raises:
        ValueError: no such mode, or a precision the mode does not run at (the message
            names what it runs at).
    """
    base, precision = Precision.split_name(run_name)
    if base not in MODES:
        raise ValueError(f"unknown mode {run_name!r}; choose from {', '.join(bench_names())}")
    mode = MODES[base]
    reason = mode.refuses(precision)
    if reason is not None:
        runs = ", ".join(f"{base}{Precision(name).suffix}" for name in mode.precisions)
        raise ValueError(f"unknown mode {run_name!r}: {reason}; bench names for {base}: {runs}")
    return mode, precision


def full_parameters(wrapped: Wrapped) -> dict[str, torch.Tensor]:
    """Full CPU copies of every parameter by name; a collective for sharded modes (call on all ranks).

    Args:
        wrapped: the mode's model.

    Returns:
        ``{name: tensor}`` with names as in the unwrapped model.
    """
    if not wrapped.sharded_params:
        return {n: p.detach().cpu().clone() for n, p in wrapped.module.named_parameters()}
    if wrapped.checkpoint_target is not wrapped.module:  # a wrapper whose state_dict() is full (ZeRO-3)
        assert wrapped.checkpoint_target is not None
        state = wrapped.checkpoint_target.state_dict()
        return {n: state[n].detach().cpu().clone() for n, _ in wrapped.checkpoint_target.named_parameters()}
    out = {}
    for name, param in wrapped.module.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param  # DTensor (FSDP2)
        out[name] = full.detach().cpu().clone()
    return out


# Note [two consolidated optimizer layouts]
# A consolidated checkpoint's optimizer state comes in one of two layouts, by the mode that
# saved it: ddp, zero1 and zero2 save a plain torch.optim state dict whose parameter ids are
# positions in the unwrapped model's named_parameters() (OSS consolidates to exactly that);
# zero3 saves FullyShardedDataParallel.full_optim_state_dict, the same entries keyed by
# parameter name (its optimizer sees flat shards, so only names survive a change of world
# size or wrapping). Both hold full-shaped tensors, so any consolidated mode can resume
# from either: load_optimizer_state rekeys by name through Wrapped.param_names, then zero3
# cuts the entries to its shards with shard_full_optim_state_dict and the others load the
# plain dict (OSS keeps the entries it owns).


def _by_name(state: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """``state`` in the name-keyed layout (unchanged when it already is)."""
    groups = state["param_groups"]
    if all(isinstance(p, str) for g in groups for p in g["params"]):
        return state
    if sorted(p for g in groups for p in g["params"]) != list(range(len(names))):
        raise ValueError(f"the checkpoint's optimizer state covers parameter ids "
                         f"{sorted(p for g in groups for p in g['params'])[:5]}..., not the model's {len(names)} "
                         "parameters; resume with the model that saved it")
    return {**_beside(state), "state": {names[i]: entry for i, entry in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}


def _beside(state: dict[str, Any]) -> dict[str, Any]:
    """The entries of an optimizer state dict beside ``state`` and ``param_groups`` (OSS's step
    count: Note [saved step count] in shardopt.optim.delayed_update), carried through a relayout."""
    return {k: v for k, v in state.items() if k not in ("state", "param_groups")}


def _by_position(state: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """A name-keyed ``state`` as a plain torch.optim state dict over ``names`` (ids in model order)."""
    index = {name: i for i, name in enumerate(names)}
    unknown = [p for g in state["param_groups"] for p in g["params"] if p not in index]
    if unknown:
        raise ValueError(f"the checkpoint's optimizer state has parameters {unknown[:5]} that this model lacks; "
                         "resume with the model that saved it")
    return {**_beside(state), "state": {index[name]: entry for name, entry in state["state"].items()},
            "param_groups": [{**g, "params": sorted(index[p] for p in g["params"])} for g in state["param_groups"]]}


def load_optimizer_state(wrapped: Wrapped, state: dict[str, Any]) -> None:
    """Load a consolidated optimizer state saved by any consolidated mode into ``wrapped.optimizer``.

    How it works: Note [two consolidated optimizer layouts]. Call on every rank with the same
    ``state``; no communication.

    Args:
        wrapped: the model and optimizer (built by :meth:`Mode.wrap`).
        state: the checkpoint's optimizer state, in either layout.

    Raises:
        ValueError: ``wrapped`` has no parameter names (not built by :meth:`Mode.wrap`), or
            ``state`` belongs to another model.
    """
    if not wrapped.param_names:
        raise ValueError("wrapped.param_names is empty; build the model with Mode.wrap, which records them")
    by_name = _by_name(state, wrapped.param_names)
    shard = getattr(type(wrapped.checkpoint_target), "shard_full_optim_state_dict", None)
    if shard is not None:  # ZeRO-3: its optimizer holds pieces of flat shards, keyed by name in the checkpoint
        wrapped.optimizer.load_state_dict(shard(by_name, wrapped.checkpoint_target, wrapped.optimizer))
    else:
        wrapped.optimizer.load_state_dict(_by_position(by_name, wrapped.param_names))
