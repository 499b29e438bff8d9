"""``FullyShardedDataParallel``: ZeRO stage 3 on flat-parameter units.

The wrapper is thin: it owns one :class:`~shardopt.nn.fsdp.unit.Unit`, whose pre/post
forward and backward steps do the work (Note [hook order] in ``unit``), and the public API
(state dicts, ``summon_full_params``, ``no_sync``, clipping). The outermost wrapper that runs
a forward first becomes the *root*: it creates the one
:class:`~shardopt.nn.fsdp.context.StepContext` that every unit of its tree shares
(recorded execution order, reductions in flight, the end-of-backward callback guard,
``no_sync``).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shardopt import clipping, comm
from shardopt.nn.fsdp import grad_norm, optim_state_dict
from shardopt.nn.fsdp.compiling import keep_out_of_graphs
from shardopt.nn.fsdp.construction import prepare
from shardopt.nn.fsdp.context import StepContext
from shardopt.nn.fsdp.flat_param import FlatParamHandle
from shardopt.nn.fsdp.options import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, UnitConfig, make_config
from shardopt.nn.fsdp.records import ForwardKind, TrainingState
from shardopt.nn.fsdp.state_dict import WRAPPED, ParentLoad, WrappedStateDict, check_loadable, clean_name
from shardopt.nn.fsdp.state_dict import load_sharded, sharded_state, under_prefix
from shardopt.nn.fsdp.unit import Unit, summon_units
from shardopt.nn.fsdp.wrap import AutoWrapPolicy, auto_wrap, claim_params, owner_of, registrations

__all__ = ["FullyShardedDataParallel"]

logger = logging.getLogger(__name__)

class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state over ranks (ZeRO-3).

    How it works: the parameters of the wrapped module that no nested unit owns are flattened
    into one buffer padded to a multiple of the shard group size; each rank keeps its
    ``1/N`` of every parameter's rows (Note [flat parameter layout] in ``flat_param``). The
    original parameters stay registered under their original names and are views: of this
    rank's rows between steps (so ``p.dim()`` is unchanged and shape-based optimizer groups
    work; ``p.numel()`` counts this rank's rows), of the gathered parameters during forward
    and backward. Gradients are multiplied
    by ``1/N`` and reduce-scattered after each unit's backward, so every rank holds only its
    gradient slice (Note [hook order] in ``unit``). ``parameters()`` therefore yields the sharded fp32
    master rows, and any ``torch.optim`` optimizer built on them steps only this rank's
    shard with sharded state. Shared parameters are owned by the lowest unit enclosing
    all their users (Note [shared parameters] in ``wrap``).

    Args:
        module: the module to wrap (not already a ``FullyShardedDataParallel``).
        process_group: the group to shard over (default: the world); for HYBRID_SHARD a
            ``(shard_group, replicate_group)`` pair.
        sharding_strategy: see :class:`ShardingStrategy`.
        mixed_precision: see :class:`MixedPrecision`; ``None`` computes in the parameters' dtype.
        auto_wrap_policy: ``policy(module, qualified_name, unwrapped_numel) -> bool`` deciding
            which submodules become nested units (see ``shardopt.nn.fsdp.wrap``).
        device_mesh: alternative to ``process_group``: 1-D, or 2-D ``(replicate, shard)`` for
            HYBRID_SHARD.
        sync_module_states: broadcast the parameters and buffers of rank 0 (of the model's
            groups) to all its ranks before sharding, as DDP does. Default ``False`` (torch's
            and fairscale's signature): no broadcast, but ranks whose weights differ are
            refused (Note [same weights at construction] in ``construction``).
        param_init_fn: materialises a module created on the meta device; without it such a
            module is moved with ``to_empty`` and each submodule's ``reset_parameters()`` runs
            (a meta tensor no ``reset_parameters()`` would initialise is refused).
        ignored_modules: modules whose parameters FSDP neither shards nor reduces.
        forward_prefetch: gather the next unit (recorded forward order) during a forward.
        backward_prefetch: when to gather the next unit during backward, or ``None``.
        limit_all_gathers: hold at most one prefetched, not yet used unit at a time.
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps every unit's shard and sharded
            gradients in host memory, so the optimizer steps on the CPU (see :class:`CPUOffload`).

    Raises:
        ValueError: ``module`` is already wrapped, a shared parameter crosses units wrapped
            by hand, inconsistent process groups for the strategy, ranks' weights differ
            without ``sync_module_states``, meta tensors remain, or
            (without ``param_init_fn``) a meta tensor belongs to a module without ``reset_parameters()``.
        TypeError: wrong argument types, or one unit's parameters of several dtypes.
        RuntimeError: torch.distributed is not initialised.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: comm.ProcessGroup | tuple[comm.ProcessGroup, comm.ProcessGroup] | None = None,
        sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
        mixed_precision: MixedPrecision | None = None,
        auto_wrap_policy: AutoWrapPolicy | None = None,
        device_mesh: Any = None,
        sync_module_states: bool = False,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        forward_prefetch: bool = False,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers: bool = True,
        cpu_offload: CPUOffload | None = None,
    ) -> None:
        super().__init__()
        comm.require_initialized("FullyShardedDataParallel")
        # Note [compiling FullyShardedDataParallel] in compiling
        keep_out_of_graphs(FullyShardedDataParallel, "forward", ("_enter_forward", "_leave_forward"))
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(
                "module is already a FullyShardedDataParallel; wrapping it again would shard a flat "
                "shard. Wrap the plain module once (nest units by wrapping submodules first, or use auto_wrap_policy)"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if auto_wrap_policy is not None and not callable(auto_wrap_policy):
            raise TypeError(
                f"auto_wrap_policy must be callable(module, name, unwrapped_numel) -> bool, got {auto_wrap_policy!r}"
            )
        config = make_config(
            sharding_strategy, process_group, device_mesh, mixed_precision,
            forward_prefetch, backward_prefetch, limit_all_gathers, cpu_offload,
        )
        ignored = {id(m) for top in (ignored_modules or ()) for m in top.modules()}
        arguments: list[tuple[str, object]] = [
            ("sharding_strategy", config.strategy.name), ("mixed_precision", config.mixed_precision),
            ("forward_prefetch", forward_prefetch), ("backward_prefetch", backward_prefetch),
            ("limit_all_gathers", limit_all_gathers), ("sync_module_states", sync_module_states),
            ("auto_wrap_policy", type(auto_wrap_policy).__qualname__), ("cpu_offload", config.cpu_offload),
        ]
        prepare(module, config, arguments, sync_module_states, param_init_fn,  # Note [same weights at
                lambda p: owner_of(p) is None)  # construction] in construction
        if auto_wrap_policy is not None:
            auto_wrap(
                module, "", auto_wrap_policy, registrations(module), ignored,
                is_unit=lambda m: isinstance(m, FullyShardedDataParallel),
                make_unit=lambda child, name, excluded: FullyShardedDataParallel._nested(
                    child, name, config, excluded, ignored),
            )
        self._setup(module, "", config, set(), ignored)
        if config.shard_size > 1:  # Note [clipping that bypasses the wrapper] in shardopt.clipping
            clipping.register_sharded(self, self.parameters(), "FullyShardedDataParallel.clip_grad_norm_")

    @classmethod
    def _nested(cls, module: nn.Module, name: str, config: UnitConfig, excluded: set[int],
                ignored: set[int]) -> FullyShardedDataParallel:
        unit = cls.__new__(cls)
        nn.Module.__init__(unit)
        unit._setup(module, name, config, excluded, ignored)
        return unit

    def _setup(self, module: nn.Module, name: str, config: UnitConfig, excluded: set[int], ignored: set[int]) -> None:
        self._fsdp_wrapped_module = module
        self._config = config
        self._unit = Unit(name, None, config)
        params = claim_params(
            module,
            self._unit,
            is_unit=lambda m: isinstance(m, FullyShardedDataParallel),
            unit_of=lambda m: m.unit,
            excluded=excluded,
            ignored=ignored,
        )
        if params:
            self._unit.handle = FlatParamHandle(
                params, config.shard_rank, config.shard_size, config.mixed_precision.param_dtype,
                config.cpu_offload.offload_params,
            )
        # Note [state dict through a parent] in state_dict
        parent_load = ParentLoad(self._unit, lambda: self.summon_full_params(recurse=True, writeback=True))
        self._register_load_state_dict_pre_hook(parent_load.pre, with_module=True)
        self.register_load_state_dict_post_hook(parent_load.post)
        # Note [state dict of the wrapped module] in state_dict
        own = WrappedStateDict(weakref.ref(self))
        self._wrapped_state_dict_handles = (  # functions: torch sets an attribute on a post-hook
            module.register_state_dict_pre_hook(lambda *args: own.pre(*args)),
            module.register_state_dict_post_hook(lambda *args: own.post(*args)),
        )
        logger.debug("FSDP unit %r: %d parameters", name, len(params))

    # ------------------------------------------------------------------ plumbing
    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def unit(self) -> Unit:
        """The flat-parameter unit this wrapper drives (its runtime state and phase methods)."""
        return self._unit

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(self._modules[WRAPPED], name)

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every ``FullyShardedDataParallel`` in ``module``'s tree (module order).

        Args:
            module: any module.
            root_only: only the outermost ones.

        Returns:
            The wrappers, ``module`` itself included when it is one.
        """
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if root_only:
            nested = {id(n) for m in found for n in m.modules()
                      if n is not m and isinstance(n, FullyShardedDataParallel)}
            found = [m for m in found if id(m) not in nested]
        return found

    def _units(self) -> list[FullyShardedDataParallel]:
        return FullyShardedDataParallel.fsdp_modules(self)

    def _lazy_init(self) -> None:
        """At the outermost wrapper's first forward: one step context for every unit of its tree."""
        if self._unit.context is None:
            units = [m.unit for m in self._units()]
            context = StepContext(units)
            for unit in units:
                unit.attach(context, is_root=unit is self._unit)

    def _require_root(self, what: str) -> None:
        if self._unit.is_root is False:
            raise ValueError(
                f"{what} must be called on the root FullyShardedDataParallel (the outermost wrapper), "
                f"not on the nested unit {self._unit.name!r}"
            )

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward on gathered parameters (Note [hook order] in ``unit``).

        Under ``torch.compile`` this frame and the unit's steps run eagerly and the wrapped
        module's forward is compiled (Note [compiling FullyShardedDataParallel] in ``compiling``).

        Args:
            *args, **kwargs: the wrapped module's inputs; floating point tensors are cast to
                the mixed precision ``param_dtype`` when one is set.

        Returns:
            The wrapped module's output (its tensors carry the pre-backward hook).

        Raises:
            ValueError: called inside ``summon_full_params``, or a previous backward never
                reached FSDP's hooks (an output type FSDP cannot look into).
        """
        args, kwargs, kind = self._enter_forward(args, kwargs)
        out = self._fsdp_wrapped_module(*args, **kwargs)
        self._leave_forward(out, kind)
        return out

    def _enter_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any, ForwardKind]:
        self._lazy_init()
        return self._unit.pre_forward(args, kwargs)

    def _leave_forward(self, out: Any, kind: ForwardKind) -> None:
        self._unit.post_forward(out, kind)

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (unsharded, full size) without communicating.

        The next backward outside the context reduces the accumulated sum. Must be used on
        the root; the optimizer must not step inside it.

        Raises:
            ValueError: called on a nested unit.
        """
        self._require_root("no_sync()")
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch: while ``False`` backwards accumulate locally, as inside :meth:`no_sync`
        (which sets and restores it); the next backward with ``True`` reduces the sum.
        Setting it raises ``ValueError`` on a nested unit, ``TypeError`` for a non-bool."""
        context = self._unit.context
        return context is None or not context.no_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"require_backward_grad_sync must be a bool, got {value!r}")
        self._require_root("setting require_backward_grad_sync")
        self._lazy_init()
        assert self._unit.context is not None
        self._unit.context.no_sync = not value

    def full_parameter_shapes(self) -> dict[str, torch.Size]:
        """``{original name: full torch.Size}`` in ``named_parameters()`` order (local).

        Between steps ``p.numel()`` counts this rank's rows (Note [flat parameter layout]);
        the model's count is ``sum(s.numel() for s in model.full_parameter_shapes().values())``.
        """
        slots = {id(p): slot for m in self._units() if m.unit.handle is not None
                 for p, slot in zip(m.unit.handle.params, m.unit.handle.layout.slots, strict=True)}
        return {n: slots[id(p)].shape if id(p) in slots else p.shape for n, p in self.named_parameters()}

    @contextlib.contextmanager
    def summon_full_params(
        self,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Show the full, original-shaped parameters (master dtype) inside the context.

        How it works: each unit all-gathers its shard into a temporary buffer and points its
        parameters at views of it; on exit this rank's rows are copied back (``writeback``).

        Args:
            recurse: also the nested units (else only this unit's own parameters).
            writeback: keep changes made to the parameters inside the context.
            rank0_only: only rank 0 sees full parameters (others still take part).
            offload_to_cpu: keep the gathered copy in CPU memory.
            with_grads: also show full gradients (read-only: they are not written back).

        Raises:
            ValueError: ``rank0_only`` with ``writeback``.
        """
        if rank0_only and writeback:
            raise ValueError(
                "summon_full_params(rank0_only=True, writeback=True) is not supported: ranks other than 0 "
                "hold no full copy to write back; pass writeback=False"
            )
        units = [m.unit for m in (self._units() if recurse else [self])]
        visible = not rank0_only or comm.group_rank(None) == 0
        with summon_units(units, with_grads, visible, offload_to_cpu, writeback):
            yield

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """Apply ``fn`` to every submodule with full parameters (written back to the shards).

        Args:
            fn: called on every submodule, as ``nn.Module.apply`` does (e.g. weight init).

        Returns:
            ``self``.
        """
        if self._unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
            return super().apply(fn)
        with self.summon_full_params(recurse=True, writeback=True):
            return super().apply(fn)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Original parameters with their original names (wrapper levels removed).

        Between steps each is this rank's rows (what an optimizer steps, same ``dim()``, see
        :meth:`full_parameter_shapes`); inside ``summon_full_params`` it has its full shape.

        Args:
            prefix, recurse, remove_duplicate: as for ``nn.Module.named_parameters``.

        Returns:
            An iterator of ``(name, parameter)``.
        """
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield clean_name(name), param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Buffers with their original names (wrapper levels removed).

        Args:
            prefix, recurse, remove_duplicate: as for ``nn.Module.named_buffers``.

        Returns:
            An iterator of ``(name, buffer)``.
        """
        for name, buf in super().named_buffers(prefix, recurse, remove_duplicate):
            yield clean_name(name), buf

    def state_dict(  # type: ignore[override]
        self,
        *args: Any,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
    ) -> dict[str, Any]:
        """The full (unsharded) state dict with original names, cloned.

        Args:
            *args, destination, prefix, keep_vars: as for ``nn.Module.state_dict``; when a
                parent module's ``state_dict`` recurses into this wrapper, it gets the same
                full, clean-named entries under its prefix (a collective, like this call).
            rank0_only: only rank 0 returns the tensors (others return ``{}``).
            offload_to_cpu: return CPU tensors.

        Returns:
            ``{name: tensor}`` with original parameter and buffer names.
        """
        if args or destination is not None or prefix:
            if self._unit.training_state is TrainingState.SUMMON_FULL_PARAMS:
                # inside an enclosing unit's gather: raw entries, the caller cleans the names
                return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
            # Note [state dict through a parent] in state_dict
            return under_prefix(self.state_dict(), args, destination, prefix)
        out: dict[str, Any] = OrderedDict()
        with self.summon_full_params(recurse=True, writeback=False, rank0_only=rank0_only,
                                     offload_to_cpu=offload_to_cpu):
            if not rank0_only or comm.group_rank(None) == 0:
                for name, value in super().state_dict(keep_vars=True).items():
                    value = value.detach().clone()
                    out[clean_name(name)] = value.cpu() if offload_to_cpu else value
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a full state dict (original names) into the shards.

        Args:
            state_dict: as returned by :meth:`state_dict` (every rank passes it).
            strict: as for ``nn.Module.load_state_dict``.
            assign: must be False (the parameters are views into the flat shard).

        Returns:
            ``nn.Module.load_state_dict``'s missing/unexpected keys, with original names.

        Raises:
            ValueError: ``assign=True``, or a name, shape or dtype that does not fit (nothing is written).
        """
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace parameters that are views into the flat "
                             "shard; use assign=False")
        raw = {clean_name(k): k for k in super().state_dict(keep_vars=True)}
        translated = OrderedDict((raw.get(k, k), v) for k, v in state_dict.items())
        with self.summon_full_params(recurse=True, writeback=True):
            check_loadable(super().state_dict(keep_vars=True), translated, strict)
            result = super().load_state_dict(translated, strict=strict)
        result.missing_keys[:] = [clean_name(k) for k in result.missing_keys]
        result.unexpected_keys[:] = [clean_name(k) for k in result.unexpected_keys]
        return result

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the sharded gradients by their global norm, like ``torch.nn.utils.clip_grad_norm_``.

        How it works: see :func:`shardopt.nn.fsdp.grad_norm.clip_grad_norm` (one all-reduce
        of the ranks' power sums; ignored modules' parameters add their local terms).

        Args:
            max_norm: the largest allowed total norm.
            norm_type: the p of the p-norm; ``float("inf")`` for the max norm.

        Returns:
            The total norm before clipping (fp32 scalar).

        Raises:
            ValueError: called on a nested unit, or ``max_norm``/``norm_type`` not positive.
        """
        self._require_root("clip_grad_norm_()")
        handles = [m.unit.handle for m in self._units() if m.unit.handle is not None]
        others = [p for p in self.parameters() if owner_of(p) is None]
        return grad_norm.clip_grad_norm(handles, others, self._config, max_norm, norm_type)

    def sharded_state_dict(self) -> dict[str, Any]:
        """Parameters as 1-D ``ShardedTensor`` pieces, buffers as tensors (Note [sharded state dict]).

        Save it with ``torch.distributed.checkpoint.save``; to load (any world size), fill
        this model's own ``sharded_state_dict()`` with ``dcp.load`` and pass it to
        :meth:`load_sharded_state_dict`.

        Returns:
            ``{original name: ShardedTensor | Tensor}``; sharded entries view the live shards.

        Raises:
            ValueError: called on a nested unit.
        """
        return sharded_state(_resharded(self, "sharded_state_dict()"), dict(self.named_parameters()),
                             dict(self.named_buffers()))

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a sharded state dict in this model's layout into the shards (Note [sharded state dict]).

        Raises:
            ValueError: called on a nested unit, names missing, or pieces of another layout.
        """
        units = _resharded(self, "load_sharded_state_dict()")
        load_sharded(units, dict(self.named_parameters()), dict(self.named_buffers()), state_dict)

    # ------------------------------------------------------------------ optimizer state
    @staticmethod
    def full_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, rank0_only: bool = True
    ) -> dict[str, Any]:
        """Consolidate a sharded optimizer's state into a plain full state dict.

        Collective over the model's ranks. Each 1-D state piece (``exp_avg``, ...) is
        all-gathered into its parameter's full shape; scalars are kept; entries are keyed by
        original parameter name (see :mod:`shardopt.nn.fsdp.optim_state_dict`).

        Args:
            model: the FSDP-wrapped model (or a module containing FSDP units).
            optim: the optimizer built on ``model.parameters()``.
            rank0_only: only global rank 0 gets the result; others get ``{}``.

        Returns:
            ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``,
            independent of world size and strategy.

        Raises:
            ValueError: the optimizer holds a foreign parameter, or ranks hold different keys.
        """
        units, named = _units_named(model)
        return optim_state_dict.full_optim_state_dict(units, named, optim, rank0_only)

    @staticmethod
    def shard_full_optim_state_dict(full_osd: dict[str, Any], model: nn.Module,
                                    optim: torch.optim.Optimizer) -> dict[str, Any]:
        """Cut a full optimizer state dict to this rank's pieces (any world size or strategy).

        Args:
            full_osd: from :meth:`full_optim_state_dict`, or a plain index-keyed torch.optim one (by position).
            model: this FSDP-wrapped model.
            optim: the optimizer that will ``load_state_dict`` the result, built on
                ``model.parameters()`` with the same param groups as the consolidated one.

        Returns:
            A ``torch.optim`` state dict for ``optim``.

        Raises:
            ValueError: not a full optimizer state dict, or its groups/names do not match.
        """
        units, named = _units_named(model)
        return optim_state_dict.shard_full_optim_state_dict(full_osd, units, named, optim)

    @staticmethod
    def sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state as ``ShardedTensor`` pieces for ``torch.distributed.checkpoint``.

        Each rank's state pieces become 1-D ``ShardedTensor`` entries keyed by original
        parameter name, so ``dcp.save`` has every rank write only its shard of the
        optimizer state (Note [sharded optimizer state dict] in ``optim_state_dict``). To
        load at any world size, build this dict for the new model and optimizer, fill it
        with ``dcp.load`` and pass it to :meth:`load_sharded_optim_state_dict`. Collective.

        Args:
            model: the FSDP-wrapped model.
            optim: the optimizer built on ``model.parameters()``; a fresh one first gets its
                state from one step with zero gradients and learning rate 0.

        Returns:
            ``{"state": {name: {key: ShardedTensor | value}}, "param_groups": [...]}``.

        Raises:
            ValueError: a foreign parameter in ``optim``, or a fresh optimizer whose
                parameters hold gradients.
        """
        units, named = _units_named(model)
        return optim_state_dict.sharded_optim_state_dict(units, named, optim)

    @staticmethod
    def load_sharded_optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer,
                                      osd: dict[str, Any]) -> None:
        """Load a sharded optimizer state dict in this model's layout (filled by ``dcp.load``).

        Args:
            model: the FSDP-wrapped model.
            optim: the optimizer the target was built with.
            osd: :meth:`sharded_optim_state_dict` of ``model`` and ``optim``, filled by ``dcp.load``.

        Raises:
            ValueError: not such a dict, or groups, names or pieces that do not match.
        """
        units, named = _units_named(model)
        optim_state_dict.load_sharded_optim_state_dict(units, named, optim, osd)


def _units_named(model: nn.Module) -> tuple[list[Unit], dict[str, nn.Parameter]]:
    units = [m.unit for m in FullyShardedDataParallel.fsdp_modules(model)]
    return units, {clean_name(n): p for n, p in model.named_parameters()}


def _resharded(root: FullyShardedDataParallel, what: str) -> list[Unit]:
    root._require_root(what)
    units = [m.unit for m in root._units()]
    for unit in units:
        unit.reshard_()  # e.g. SHARD_GRAD_OP after a forward whose backward never came
    return units
