"""The training modes the ``shardopt`` command can run, shardopt's own and peers', by name.

Each :class:`Mode` says what it needs (a shardopt component that may not be built yet, or a
third-party peer such as fairscale) and how to wrap a freshly built model into a
:class:`Wrapped` model + optimizer. Peers are imported inside :meth:`Mode.unavailable` and
the builders, never at module import, so ``import shardopt`` never imports fairscale.

Modes: ``ddp`` (torch DDP + Adam: the reference), ``zero1`` (DDP + :class:`~shardopt.optim.
OSS`), ``zero2`` (OSS + ``shardopt.nn.ShardedDataParallel``), ``zero3``
(``shardopt.nn.FullyShardedDataParallel``); peers ``torch-zero`` (DDP + torch's
``ZeroRedundancyOptimizer``), ``fairscale`` (fairscale OSS + ShardedDDP with
``zero_grad(set_to_none=False)``), ``fairscale-default`` (the same with the optimizer's
default ``zero_grad()``), ``fsdp2`` and ``fsdp2-reshard`` (torch ``fully_shard`` with
``reshard_after_forward`` False and True).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.optim import OSS

__all__ = ["MODES", "OWN_MODES", "PEER_MODES", "Mode", "Wrapped", "full_parameters", "get_mode", "load_optimizer_state"]


@dataclass
class Wrapped:
    """A model wrapped for one mode, with its optimizer and the calls that differ per mode.

    Attributes:
        model: what to call for the forward pass.
        module: the unwrapped model (its parameters are full unless the mode shards them).
        optimizer: the optimizer to step.
        no_sync: a context manager factory that skips gradient reduction (accumulation).
        zero_grad: clears gradients the way this mode must.
        sharded_params: whether ``module``'s parameters are shards (ZeRO-3 / FSDP2), so
            full values need :func:`full_parameters`.
        checkpoint_target: the object whose state a checkpoint saves: the unwrapped module
            when its parameters are full, else the sharding wrapper.
        param_names: the unwrapped model's parameter names in ``named_parameters()`` order,
            read before wrapping (set by :meth:`Mode.wrap`); position ``i`` is parameter id
            ``i`` of a plain ``torch.optim`` state dict over the model.
    """

    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    no_sync: Callable[[], ContextManager[Any]]
    zero_grad: Callable[[], None]
    sharded_params: bool = False
    checkpoint_target: nn.Module | None = None
    param_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.checkpoint_target is None:
            self.checkpoint_target = self.module


Builder = Callable[[nn.Module, float, Any], Wrapped]


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

    def wrap(self, module: nn.Module, lr: float, device: Any) -> Wrapped:
        """:attr:`build`, with :attr:`Wrapped.param_names` read from ``module`` before it is wrapped.

        Args:
            module: the freshly built model (the same on every rank).
            lr: the learning rate.
            device: the device it trains on.

        Returns:
            The wrapped model and its optimizer.
        """
        names = tuple(name for name, _ in module.named_parameters())
        wrapped = self.build(module, lr, device)
        wrapped.param_names = names
        return wrapped

    def unavailable(self) -> str | None:
        """``None`` when this mode can run here, else a one-line reason with the fix."""
        if self.requires is None:
            return None
        module_name, attr = self.requires
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return f"mode {self.name!r} needs {module_name}, which is not installed; {self.install_hint}"
        if not hasattr(module, attr):
            return f"mode {self.name!r} needs {module_name}.{attr}, which this installation lacks; {self.install_hint}"
        return None


def _plain_no_sync() -> ContextManager[Any]:
    return contextlib.nullcontext()


def _build_ddp(module: nn.Module, lr: float, device: Any) -> Wrapped:
    model = DDP(module, device_ids=[device] if device.type == "cuda" else None)
    opt = torch.optim.Adam(module.parameters(), lr=lr)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))


def _build_zero1(module: nn.Module, lr: float, device: Any) -> Wrapped:
    model = DDP(module, device_ids=[device] if device.type == "cuda" else None)
    opt = OSS(module.parameters(), optim=torch.optim.Adam, lr=lr)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))


def _build_zero2(module: nn.Module, lr: float, device: Any) -> Wrapped:
    from shardopt.nn import ShardedDataParallel

    opt = OSS(module.parameters(), optim=torch.optim.Adam, lr=lr)
    model = ShardedDataParallel(module, opt)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))


def _build_zero3(module: nn.Module, lr: float, device: Any) -> Wrapped:
    from shardopt.nn.fsdp import FullyShardedDataParallel, ModuleClassPolicy

    blocks = getattr(module, "blocks", None)  # one unit per transformer block of the built-in GPT
    policy = ModuleClassPolicy((type(blocks[0]),)) if isinstance(blocks, nn.ModuleList) and len(blocks) else None
    # Forward prefetch, as FSDP2 does by default: the like-for-like comparison.
    model = FullyShardedDataParallel(module, auto_wrap_policy=policy, forward_prefetch=True)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True), sharded_params=True,
                   checkpoint_target=model)


def _build_torch_zero(module: nn.Module, lr: float, device: Any) -> Wrapped:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = DDP(module, device_ids=[device] if device.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
    return Wrapped(model, module, opt, model.no_sync, lambda: opt.zero_grad(set_to_none=True))


def _fairscale_builder(set_to_none: bool | None) -> Builder:
    def build(module: nn.Module, lr: float, device: Any) -> Wrapped:
        from fairscale.nn.data_parallel import ShardedDataParallel as FairscaleSDP
        from fairscale.optim import OSS as FairscaleOSS

        opt = FairscaleOSS(module.parameters(), optim=torch.optim.Adam, lr=lr)
        model = FairscaleSDP(module, opt)
        zero_grad: Callable[[], None] = opt.zero_grad if set_to_none is None else (
            lambda: opt.zero_grad(set_to_none=False))
        return Wrapped(model, module, opt, model.no_sync, zero_grad)

    return build


def _fsdp2_builder(reshard_after_forward: bool) -> Builder:
    def build(module: nn.Module, lr: float, device: Any) -> Wrapped:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # fully_shard's default mesh is on CUDA whenever CUDA exists, which breaks gloo ranks
        # training on the CPU of a GPU machine: name the device the ranks train on.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for child in getattr(module, "blocks", []):
            fully_shard(child, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
        opt = torch.optim.Adam(module.parameters(), lr=lr)
        return Wrapped(module, module, opt, _plain_no_sync, lambda: opt.zero_grad(set_to_none=True),
                       sharded_params=True)

    return build


_FAIRSCALE_HINT = "install it with: pip install fairscale==0.4.13"
_OWN_HINT = "update shardopt to a version that ships it, or pick another mode"

MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("ddp", "torch DDP + Adam (reference)", None, "", _build_ddp, fp16_scaler="torch"),
    Mode("zero1", "DDP + shardopt OSS (ZeRO-1)", None, "", _build_zero1, fp16_scaler="sharded"),
    Mode("zero2", "shardopt OSS + ShardedDataParallel (ZeRO-2)", ("shardopt.nn", "ShardedDataParallel"),
         _OWN_HINT, _build_zero2, fp16_scaler="sharded"),
    Mode("zero3", "shardopt FullyShardedDataParallel (ZeRO-3)", ("shardopt.nn.fsdp", "FullyShardedDataParallel"),
         _OWN_HINT, _build_zero3, fp16_scaler="sharded"),
    Mode("torch-zero", "DDP + torch ZeroRedundancyOptimizer", ("torch.distributed.optim", "ZeroRedundancyOptimizer"),
         "it ships with torch.distributed", _build_torch_zero, peer=True, fp16_scaler="torch", checkpoints=False),
    Mode("fairscale", "fairscale OSS + ShardedDDP, zero_grad(set_to_none=False)", ("fairscale", "__version__"),
         _FAIRSCALE_HINT, _fairscale_builder(False), peer=True, checkpoints=False),
    Mode("fairscale-default", "fairscale OSS + ShardedDDP, default zero_grad()", ("fairscale", "__version__"),
         _FAIRSCALE_HINT, _fairscale_builder(None), peer=True, checkpoints=False),
    Mode("fsdp2", "torch fully_shard, reshard_after_forward=False", ("torch.distributed.fsdp", "fully_shard"),
         "it needs torch >= 2.6", _fsdp2_builder(False), peer=True, sharded_checkpoint=True),
    Mode("fsdp2-reshard", "torch fully_shard, reshard_after_forward=True", ("torch.distributed.fsdp", "fully_shard"),
         "it needs torch >= 2.6", _fsdp2_builder(True), peer=True, sharded_checkpoint=True),
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
    return {"state": {names[i]: entry for i, entry in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in groups]}


def _by_position(state: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """A name-keyed ``state`` as a plain torch.optim state dict over ``names`` (ids in model order)."""
    index = {name: i for i, name in enumerate(names)}
    unknown = [p for g in state["param_groups"] for p in g["params"] if p not in index]
    if unknown:
        raise ValueError(f"the checkpoint's optimizer state has parameters {unknown[:5]} that this model lacks; "
                         "resume with the model that saved it")
    return {"state": {index[name]: entry for name, entry in state["state"].items()},
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
