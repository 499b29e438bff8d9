"""What ``shardopt rehearse`` builds for one rank: the model on the meta device, made real one
unit (ZeRO-3) or one rank's share at a time, wrapped as the chosen mode.

A :class:`ModelSpec` names a model three ways: a built-in GPT preset
(:data:`shardopt.app.models.PRESETS`), a Llama-style shape (a
:data:`shardopt.app.shapes.SHAPE_PRESETS` name or a Hugging Face ``config.json``, built as a
:class:`~shardopt.app.decoder.Decoder`), or ``package.module:factory``. Every model is first
built under ``torch.device("meta")``, which allocates nothing, then materialised (Note
[materialise what the rank holds]) and wrapped by :func:`build_rank` on the process group
that exists, real or fake; the same code builds a real gloo rank, which is how the
rehearsal is checked against real runs.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from shardopt import comm, failures
from shardopt.app.decoder import Decoder
from shardopt.app.models import GPT, PRESETS
from shardopt.app.modes import MODES, Setup
from shardopt.app.precision import Precision
from shardopt.app.shapes import SHAPE_PRESETS, DecoderShape, read_hf_config
from shardopt.nn.fsdp import CPUOffload, FullyShardedDataParallel, MixedPrecision
from shardopt.optim import OSS

__all__ = ["DELAYED_MODES", "REHEARSED_DELAY", "REHEARSED_MODES", "Built", "Checkpointed", "ModelSpec", "build_rank",
           "deferred_all_reduce", "make_batch", "materialize", "model_spec", "num_params", "refuses", "refuses_delay",
           "unit_list"]

REHEARSED_MODES = ("ddp", "zero1", "zero2", "zero2-split", "zero1-hybrid", "zero2-hybrid", "zero3", "zero1-offload",
                   "zero2-offload", "zero3-offload")
"""The modes a rehearsal builds: shardopt's own (:data:`shardopt.app.modes.OWN_MODES`); peers are not rehearsed."""
DELAYED_MODES = ("zero1-offload", "zero2-offload")
"""The modes rehearsed with ``delayed_update`` too: those that step an offloaded OSS (Note [a rehearsed delayed update])."""
REHEARSED_DELAY = 1
"""``delay_update_after`` of a rehearsed delayed update (Note [a rehearsed delayed update])."""

_ZERO3_PRECISIONS = ("fp32", "bf16-master")


@dataclass(frozen=True)
class ModelSpec:
    """A model a rehearsal can build, and how to feed it.

    Attributes:
        name: what the user gave (a preset, a config path or ``package.module:factory``).
        build: returns the fp32 model; called under ``torch.device("meta")``.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        max_seq_len: the longest sequence the model takes (a GPT's learned positions), or ``None``.
        takes_targets: ``model(tokens, targets)`` returns the loss (the built-in GPT); otherwise
            ``model(tokens)`` returns logits ``(batch, seq, vocab)`` and the loss is their
            cross-entropy.
    """

    name: str
    build: Callable[[], nn.Module]
    vocab_size: int
    max_seq_len: int | None = None
    takes_targets: bool = False

    def loss(self, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The next-token loss of ``model`` (the wrapper) on one batch."""
        if self.takes_targets:
            return model(tokens, targets)
        logits = model(tokens)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[-1] != self.vocab_size:
            got = type(logits).__name__ if not isinstance(logits, torch.Tensor) else f"shape {tuple(logits.shape)}"
            raise ValueError(f"--model {self.name!r}: model(tokens) returned {got}; rehearse needs logits of shape "
                             f"(batch, seq, {self.vocab_size}) from token ids of shape (batch, seq)")
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _decoder_spec(name: str, shape: DecoderShape) -> ModelSpec:
    return ModelSpec(name, partial(Decoder, shape), shape.vocab_size)


def model_spec(model: str | None, hf_config: str | None) -> ModelSpec:
    """The :class:`ModelSpec` of ``--model`` or ``--hf-config`` (exactly one is given).

    Raises:
        ValueError: an unknown preset, a factory that cannot be loaded, called or has no
            ``nn.Embedding`` to read the vocabulary from, or an unreadable config.
    """
    if hf_config is not None:
        return _decoder_spec(hf_config, read_hf_config(hf_config))
    assert model is not None
    if model in PRESETS:
        cfg = PRESETS[model]
        return ModelSpec(model, partial(GPT, cfg), cfg.vocab_size, cfg.seq_len, takes_targets=True)
    if model in SHAPE_PRESETS:
        return _decoder_spec(model, SHAPE_PRESETS[model])
    module_name, sep, attr = model.partition(":")
    known = ", ".join(sorted([*PRESETS, *SHAPE_PRESETS]))
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {model!r} is neither a preset ({known}) nor package.module:factory; give one of "
                         "those, or --hf-config config.json")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {model!r}: cannot load {attr!r} from {module_name!r} ({exc})") from None
    try:
        with torch.device("meta"):
            probe = factory()
    except Exception as exc:  # noqa: BLE001 - a user's factory may raise anything: one line, no traceback
        raise ValueError(f"--model {model!r}: calling {attr}() under torch.device('meta') failed "
                         f"({type(exc).__name__}: {exc}); point --model at a function that takes no arguments and "
                         "returns the model") from None
    if not isinstance(probe, nn.Module):
        raise ValueError(f"--model {model!r} returned {type(probe).__name__}, not an nn.Module")
    embeddings = [m for m in probe.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        raise ValueError(f"--model {model!r} has no nn.Embedding, so rehearse cannot tell its vocabulary; it feeds "
                         "token ids (batch, seq) and reads logits (batch, seq, vocab): give a language model")
    return ModelSpec(model, factory, embeddings[0].num_embeddings)


def unit_list(model: nn.Module) -> nn.ModuleList | None:
    """The model's repeated blocks: its largest ``nn.ModuleList`` (by parameters) of one class, or ``None``.

    These become the ZeRO-3 units and the activation-checkpointed regions.
    """
    best: tuple[int, nn.ModuleList] | None = None
    for sub in model.modules():
        if isinstance(sub, nn.ModuleList) and len(sub) and len({type(m) for m in sub}) == 1:
            numel = sum(p.numel() for p in sub.parameters())
            if best is None or numel > best[0]:
                best = (numel, sub)
    return None if best is None else best[1]


class Checkpointed(nn.Module):
    """A block whose forward activations are recomputed in backward (``torch.utils.checkpoint``, non-reentrant).

    Args:
        block: the wrapped block.
    """

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The block's forward; only its inputs are kept for backward."""
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def refuses(mode: str, precision: Precision) -> str | None:
    """``None`` when the rehearsal builds ``mode`` at ``precision``, else why not and what does.

    ZeRO-3 runs at ``fp32`` and ``bf16-master`` (fp32 flat shards, bf16 compute:
    ``MixedPrecision(param_dtype=torch.bfloat16)``); the other modes at what
    :attr:`shardopt.app.modes.Mode.precisions` lists.
    """
    if mode in ("zero3", "zero3-offload"):
        if precision.name in _ZERO3_PRECISIONS and precision.reduce_dtype is None:
            return None
        return (f"--precision {precision.name}: mode {mode!r} is rehearsed at {' or '.join(_ZERO3_PRECISIONS)} "
                "(bf16-master: fp32 shards, bf16 compute); pick one of them")
    reason = MODES[mode].refuses(precision)
    return None if reason is None else f"--precision {precision.name}: {reason}"


# Note [materialise what the rank holds]
# The model is built on the meta device (no memory), then given storage only where and
# when the rank would hold it: for the modes that replicate parameters (ddp, zero1, zero2,
# hybrid) the whole model is materialised directly in the parameter dtype (bf16 for bf16 and
# bf16-master: no fp32 copy of the model ever exists; OSS then makes fp32 masters of what
# this rank owns); for zero3 each block is materialised in fp32 and wrapped at once, so
# FullyShardedDataParallel flattens it and keeps this rank's shard before the next block
# gets storage, and the root wrapper then materialises the rest (embeddings, final norm,
# head). The peak of the build is therefore one unit (the largest: often the embedding), as
# in a real run. Values: each module's reset_parameters() where it has one, else a normal
# of std 0.02; buffers are zeros. They do not change any byte or any step time (except
# through denormals, which reset_parameters avoids), only the meaningless loss.
# The offload modes are built as the bench builds them (Note [offload modes] in
# shardopt.app.offload_modes): the model is materialised on the device as above, and OSS(offload=
# "cpu") makes this rank's masters on the host; zero3-offload's units copy each shard to the host
# as they wrap. Which storages are the host's is decided from ownership, not from `.device` (on a
# CPU-only machine both are the CPU): Note [host storages of a rehearsal].

# Note [host storages of a rehearsal]
# Built.host_tensors names what an offload mode keeps in host memory: for zero1-offload and
# zero2-offload the offloaded OSS's master buffers (mirrors or fp32 masters), their kept
# gradient buffer and, with a delayed update, the copy of it the delayed step reads (all three
# in OSS.offloaded_buffers) and the wrapped optimizer's state; for zero3-offload
# every unit's shard, the parameters' gradients (views of the host tensors the reduced shards
# land in) and the optimizer's state. Gradients a unit holds aside on the device (stash,
# accumulator) and the gathered parameters stay on the device. The rehearsal splits the live
# storages at the replayed peak into these and the rest (Note [device and host at the peak] in
# shardopt.app.rehearse).

# Note [a rehearsed delayed update]
# `shardopt rehearse --delayed-update` builds zero1-offload's or zero2-offload's OSS with
# delay_update_after=1 (REHEARSED_DELAY), not 0: the tracker counts the storages of the thread
# that entered it (Note [tracking storages] in shardopt.app.storage_trace), and Adam makes its
# state in its first step, which runs on the caller's thread only when that step is ordinary.
# From the second step on every step is delayed: its launch makes the copy of the gradient
# buffer on the caller's thread (kept from then on: a host storage), and the replayed steps are
# delayed ones. What the host step allocates and frees on its worker thread (Adam's temporaries)
# is not counted, though it runs beside the next forward and backward; the steps before the
# replayed peak decide nothing else.


def _outside_units(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its submodules, not descending into nested FullyShardedDataParallel units."""
    stack = [module]
    while stack:
        sub = stack.pop()
        yield sub
        stack.extend(c for c in reversed(list(sub.children())) if not isinstance(c, FullyShardedDataParallel))


def materialize(module: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter and buffer of ``module`` (outside nested units) storage on ``device``.

    How it works: Note [materialise what the rank holds]. Floating tensors are made in
    ``dtype``; a parameter registered in several places stays one parameter.

    Args:
        module: a module built (at least partly) on the meta device.
        device: where the storage goes.
        dtype: the dtype of floating tensors.
    """
    made: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for sub in _outside_units(module):
            fresh = []
            for name, param in list(sub._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                if id(param) not in made:
                    want = dtype if param.is_floating_point() else param.dtype
                    made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=want, device=device),
                                                   requires_grad=param.requires_grad)
                    fresh.append(made[id(param)])
                sub._parameters[name] = made[id(param)]
            for name, buf in list(sub._buffers.items()):
                if buf is not None and buf.is_meta:
                    want = dtype if buf.is_floating_point() else buf.dtype
                    sub._buffers[name] = torch.zeros(buf.shape, dtype=want, device=device)
            reset = getattr(sub, "reset_parameters", None)
            if fresh and callable(reset):
                reset()
            else:
                for param in fresh:
                    if param.is_floating_point():
                        param.normal_(0.0, 0.02)


@dataclass
class Built:
    """One rank's wrapped model and optimizer, and where its bytes live.

    Attributes:
        model: what to call for the forward pass (the wrapper).
        module: the unwrapped model.
        optimizer: the optimizer to step.
        units: the ZeRO-3 wrappers (root included), empty for the other modes.
        pending: the DDP all-reduces issued by :func:`deferred_all_reduce` and not yet
            waited (under the fake group; DDP's reducer waits its futures at the end of
            backward, and :meth:`finish_backward` does the same with these).
    """

    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    units: list[FullyShardedDataParallel] = field(default_factory=list)
    pending: list[comm.PendingWork] = field(default_factory=list)
    offloaded: bool = False

    def finish_backward(self) -> None:
        """Wait the all-reduces DDP's hook issued during the backward just run."""
        pending = list(self.pending)
        self.pending.clear()  # the same list object: DDP's hook holds it as its state
        comm.wait_all(pending)

    def _inner(self) -> torch.optim.Optimizer:
        return self.optimizer.optim if isinstance(self.optimizer, OSS) else self.optimizer

    def param_tensors(self) -> list[torch.Tensor]:
        """The parameters as this rank holds them (ZeRO-3: each unit's flat shard)."""
        if self.units:
            return [u.unit.handle.shard for u in self.units if u.unit.handle is not None]
        return list(self.module.parameters())

    def grad_tensors(self) -> list[torch.Tensor | None]:
        """Every gradient of a parameter (ZeRO-3: also those a unit holds aside while gathered)."""
        out: list[torch.Tensor | None] = [p.grad for p in self.module.parameters()]
        for u in self.units:
            out += [*u.unit.stash, u.unit.grad_accumulator]
        return out

    def master_tensors(self) -> list[torch.Tensor | None]:
        """Tensors the optimizer steps in place of parameters (fp32 masters, split rows, offloaded mirrors) and their
        gradients, with an offloaded OSS's buffers (its kept gradient buffer outlives the step unviewed)."""
        params = {id(p) for p in self.module.parameters()}
        stepped = [p for g in self._inner().param_groups for p in g["params"] if id(p) not in params]
        buffers = self.optimizer.offloaded_buffers() if isinstance(self.optimizer, OSS) else []
        return [*buffers, *(t for p in stepped for t in (p, p.grad))]

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the optimizer's state."""
        out: list[torch.Tensor] = []
        for state in self._inner().state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    def host_tensors(self) -> list[torch.Tensor | None]:
        """What an offload mode keeps in host memory (Note [host storages of a rehearsal]); ``[]`` without offload."""
        if not self.offloaded:
            return []
        if self.units:
            return [*self.param_tensors(), *(p.grad for p in self.module.parameters()), *self.optimizer_tensors()]
        assert isinstance(self.optimizer, OSS), "an offloaded mode other than zero3-offload steps an OSS"
        return [*self.optimizer.offloaded_buffers(), *self.optimizer_tensors()]

    def gather_tensors(self) -> list[torch.Tensor]:
        """ZeRO-3's full parameter buffers (gathered parameters in the compute dtype)."""
        return [u.unit.handle.full for u in self.units if u.unit.handle is not None and not u.unit.handle.full_is_shard]


def deferred_all_reduce(state: list[comm.PendingWork], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook for the fake group that issues the bucket's all-reduce and leaves it pending.

    Like :func:`shardopt.fake_ranks.fake_group_ddp_hook` it returns a completed future of
    the bucket (the fake group moves nothing), but it keeps the
    :class:`~shardopt.comm.PendingWork` in ``state`` to be waited at the end of backward,
    where DDP's reducer waits its futures, so the rehearsal's timeline shows the
    all-reduce overlapping the rest of the backward pass as it does in a real run.

    Args:
        state: the list :attr:`Built.pending`.
        bucket: the gradient bucket DDP hands over.

    Returns:
        A completed future of the bucket's flat buffer.
    """
    buffer = bucket.buffer()
    state.append(comm.all_reduce(buffer, None, label="shardopt::ddp::all_reduce"))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


# DDP reads the hook's annotations as objects; this module's future import leaves strings.
deferred_all_reduce.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


def _zero3(module: nn.Module, blocks: nn.ModuleList | None, device: torch.device, precision: Precision,
           lr: float, offload: bool) -> Built:
    mixed = MixedPrecision(param_dtype=torch.bfloat16) if precision.name == "bf16-master" else None
    init = partial(materialize, device=device, dtype=torch.float32)
    host = CPUOffload(offload_params=offload)
    units: list[FullyShardedDataParallel] = []
    for i, block in enumerate(list(blocks) if blocks is not None else []):
        # forward prefetch as shardopt demo's zero3 (and FSDP2) does
        unit = FullyShardedDataParallel(block, mixed_precision=mixed, param_init_fn=init, forward_prefetch=True,
                                        cpu_offload=host)
        blocks[i] = unit  # type: ignore[index]
        units.append(unit)
    root = FullyShardedDataParallel(module, mixed_precision=mixed, param_init_fn=init, forward_prefetch=True,
                                    cpu_offload=host)
    opt = torch.optim.Adam(root.parameters(), lr=lr)
    return Built(root, module, opt, [root, *units], offloaded=offload)


def refuses_delay(mode: str) -> str | None:
    """Why ``mode`` cannot be rehearsed with a delayed update (``--delayed-update``), or ``None``."""
    if mode in DELAYED_MODES:
        return None
    return (f"--delayed-update applies to --mode {' and '.join(DELAYED_MODES)} only (an offloaded OSS delays its "
            f"update), not --mode {mode}; pick one of them, or drop --delayed-update")


def build_rank(spec: ModelSpec, mode: str, precision: Precision, device: torch.device, *, shard_size: int | None,
               checkpointing: bool, batch_size: int, seed: int, lr: float = 1e-4, delayed_update: bool = False) -> Built:
    """Build this rank's model and optimizer for ``mode`` on the process group that exists.

    How it works: Note [materialise what the rank holds]. Under torch's fake group, DDP's
    all-reduce goes through :func:`deferred_all_reduce`; on a real group DDP keeps its own.

    Args:
        spec: the model.
        mode: one of :data:`REHEARSED_MODES`.
        precision: checked with :func:`refuses` first.
        device: where the model lives.
        shard_size: S for the hybrid modes, else ``None``.
        checkpointing: recompute each block's activations in backward.
        batch_size: sequences per step (the modes' setup records it).
        seed: the initialisation seed (the same on every rank).
        lr: Adam's learning rate.
        delayed_update: build the OSS of :data:`DELAYED_MODES` with ``delay_update_after=``
            :data:`REHEARSED_DELAY` (Note [a rehearsed delayed update]).

    Returns:
        The built rank.

    Raises:
        ValueError: a mode or precision the rehearsal does not build, checkpointing for a
            model without repeated blocks, or ``delayed_update`` with another mode.
    """
    reason = refuses(mode, precision) if mode in REHEARSED_MODES else (
        f"--mode {mode!r} is not rehearsed; modes: {', '.join(REHEARSED_MODES)}")
    if reason is None and delayed_update:
        reason = refuses_delay(mode)
    if reason is not None:
        raise ValueError(reason)
    torch.manual_seed(seed)
    with torch.device("meta"):
        module = spec.build()
    blocks = unit_list(module)
    if checkpointing:
        if blocks is None:
            raise ValueError(f"--activation-checkpointing: --model {spec.name!r} has no nn.ModuleList of repeated "
                             "blocks to checkpoint; drop the flag")
        for i, block in enumerate(list(blocks)):
            blocks[i] = Checkpointed(block)
    if mode in ("zero3", "zero3-offload"):
        return _zero3(module, blocks, device, precision, lr, offload=mode == "zero3-offload")
    materialize(module, device, precision.param_dtype)
    setup = Setup(lr, device, precision, batch_size, 1, shard_size,
                  delay_update_after=REHEARSED_DELAY if delayed_update else None)
    wrapped = MODES[mode].wrap(module, setup)
    built = Built(wrapped.model, wrapped.module, wrapped.optimizer, offloaded=wrapped.offloaded)
    if isinstance(wrapped.model, DDP) and failures.is_fake_group():
        wrapped.model.register_comm_hook(built.pending, deferred_all_reduce)
    return built


def make_batch(spec: ModelSpec, batch_size: int, seq_len: int, rank: int, seed: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids ``(batch, seq)`` and their next-token targets, different per rank, fixed by ``seed``."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    ids = torch.randint(0, spec.vocab_size, (batch_size, seq_len + 1), generator=gen)
    ids = ids.to(device)
    return ids[:, :-1], ids[:, 1:]


def num_params(spec: ModelSpec) -> tuple[int, list[tuple[int, ...]]]:
    """The model's parameter count and shapes, from a meta build (nothing allocated)."""
    with torch.device("meta"):
        module = spec.build()
    shapes = [tuple(p.shape) for p in module.parameters()]
    return sum(math.prod(s) for s in shapes), shapes
