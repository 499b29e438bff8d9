"""``OSS``: ZeRO stage 1, a sharded wrapper around any ``torch.optim`` optimizer.

Note [shard optimizer rebuild]
The wrapped optimizer is built over this rank's trainable owned parameters, and rebuilt
whenever ownership changes (``add_param_group``, ``refresh_trainable``). Rebuilding, rather
than editing ``param_groups`` of a live optimizer, lets optimizers that create state in their
constructor (``Adagrad`` fills ``sum`` there) initialise the parameters they now own; state
that already existed is then moved over by parameter index, so nothing is lost.

Note [parked state]
A frozen parameter has size 0 in the partition and is not stepped, but a torch optimizer
keeps its state (momentum, Adam moments) for when it is unfrozen. OSS does the same: the
state of a frozen parameter stays with the parameter's owner in a side table, is included in
consolidated state dicts, migrates on re-partition, and moves back into the shard optimizer
when the parameter is trainable again.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import SGD, Optimizer

from shardopt import clipping, comm
from shardopt.agreement import check_agreement, check_same_parameters
from shardopt.clipping import ClipArgs
from shardopt.hybrid import HybridLayout, resolve_group
from shardopt.optim import sharded_entries
from shardopt.optim.delayed_update import DelayedUpdate, check_delay_update_after
from shardopt.optim.elementwise import resolve_split, warn_if_unbalanced
from shardopt.optim.grad_norm import clip_for_wrapper, clip_params
from shardopt.optim.masters import MasterWeights, check_master_dtype, check_offload, needs_master
from shardopt.optim.local_shard import LocalShard, group_ranges, groups_by_rank, hyper, plan_ownership
from shardopt.optim.param_gather import DEFAULT_GATHER_BUCKET_BYTES, ParamGather
from shardopt.optim.state_transport import (Gap, Missing, Snapshot, StateByIndex, collect, cut_rows, dropped,
                                            no_snapshot_error, refuse_stale_masters, to_cpu)
from shardopt.partition import Partition, SplitPlan
from shardopt.state_checks import MASTER_KEY, check_state_dict_groups, check_state_fits

__all__ = ["OSS"]

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """Warn with ``message`` the first time ``key`` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


class OSS(Optimizer):
    """Optimizer State Sharding (ZeRO stage 1) around any ``torch.optim`` optimizer.

    Every rank keeps the full model but builds the wrapped optimizer over the parameters it
    owns only, so optimizer state is split ``world_size`` ways. After each step the owners'
    updated parameters are gathered to all ranks.

    How it works: the trainable parameters of all ``param_groups`` (in order) are assigned to
    ranks by :func:`~shardopt.partition.partition_by_size`; the plan is public as
    :attr:`partition` over :attr:`params`. ``param_groups`` on this object is the global view
    (what LR schedulers and users edit); before each step its hyperparameters are copied to
    the shard optimizer and after the step copied back. Parameters are re-synchronised by
    one all-gather per bucket of each rank's owned parameters (Note [gather by rank
    streams] in :mod:`shardopt.optim.param_gather`). Construction checks that every rank passed the
    same parameter list (a cheap fingerprint exchange) instead of hanging later. Frozen
    parameters are never stepped (even with a leftover ``.grad``); their state is kept
    (Note [parked state]). With ``master_dtype``, owners keep and step fp32 master copies of
    their low-precision parameters (Note [master weights] in :mod:`shardopt.optim.masters`).

    Args:
        params: parameters or param-group dicts, as for any ``torch.optim`` optimizer.
        optim: the optimizer *class* to shard (default ``torch.optim.SGD``).
        group: the process group (default: the world), or a hybrid ``(shard_group, replicate_group)``.
        broadcast_buffer_size: deprecated in fairscale; accepted and ignored (warns once).
        broadcast_fp16: send fp32 parameters as fp16 in the post-step sync (half the bytes;
            non-owners get values rounded to fp16, and values beyond fp16's range overflow).
        force_broadcast_object: deprecated in fairscale; accepted and ignored (warns once):
            state is always exchanged as objects.
        master_dtype: keep a master copy in this dtype (normally ``torch.float32``) of each
            owned trainable parameter narrower than it (bf16, fp16), build the wrapped
            optimizer over the masters and round them into the parameters after each step.
            Parameters already in ``master_dtype`` are stepped as themselves; if all are,
            nothing changes (warns once). ``None`` (default): no masters.
        device_mesh, shard_size: a hybrid layout as a 2-D ``("replicate", "shard")`` mesh or as S,
            ranks per shard group; ownership is then planned over the shard group (:attr:`layout`).
        offload: ``"cpu"`` keeps this rank's masters (fp32 parameters get exact fp32 ones),
            their gradients and the optimizer state in host memory and steps there (Note
            [offloaded masters] in :mod:`shardopt.optim.masters`); ``None`` (default) keeps them
            on the parameters' device.
        delay_update_after: with offload, after this many ordinary steps run each host step on a worker thread
            while the next iteration computes at parameters one update stale (changes the results: Note [delayed
            update] in :mod:`shardopt.optim.delayed_update`, :meth:`finish_update`). ``None`` (default): never.
        **defaults: keyword arguments of ``optim`` (``lr``, ``momentum``, ...).

    Raises:
        TypeError: ``optim`` is not an optimizer class (e.g. an instance), ``master_dtype`` is
            not a ``torch.dtype``, or ``delay_update_after`` is not an int.
        RuntimeError: torch.distributed is not initialised.
        ValueError: the ranks passed different parameter lists, layouts or ``master_dtype``, a bad
            layout (``resolve_layout``), a trainable parameter is not contiguous, ``master_dtype`` is not floating or
            cannot hold a parameter (narrower, or another format of the same width), ``offload`` is not None or "cpu",
            or ``delay_update_after`` is negative or given without offload.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optim: type[Optimizer] = SGD,
        group: comm.ProcessGroup | tuple[comm.ProcessGroup, comm.ProcessGroup] | None = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        master_dtype: torch.dtype | None = None,
        split_large_params: bool | None = None,
        *,
        device_mesh: DeviceMesh | None = None,
        shard_size: int | None = None,
        offload: str | None = None,
        delay_update_after: int | None = None,
        **defaults: Any,
    ) -> None:
        if not (isinstance(optim, type) and issubclass(optim, Optimizer)):
            got = f"an instance of {type(optim).__name__}" if isinstance(optim, Optimizer) else repr(optim)
            raise TypeError(
                f"optim must be a torch.optim.Optimizer subclass such as torch.optim.Adam, got {got}; "
                "pass the class and its arguments: OSS(params, optim=torch.optim.Adam, lr=1e-3)"
            )
        if master_dtype is not None:
            check_master_dtype(master_dtype, [])  # the type and kind now; the parameters below
        host = check_offload(offload)
        delay = check_delay_update_after(delay_update_after, host)
        self.split_large_params = resolve_split(split_large_params, optim)
        comm.require_initialized("OSS")
        if broadcast_buffer_size != -1:
            _warn_once("bbs", f"OSS(broadcast_buffer_size={broadcast_buffer_size}) is deprecated and ignored: "
                       "the post-step sync uses fixed-size buckets; remove the argument")
        if force_broadcast_object:
            _warn_once("fbo", "OSS(force_broadcast_object=True) is deprecated and ignored: state is always "
                       "sent as objects; remove the argument")
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        self._optim_cls = optim
        self._optim_defaults = defaults
        self.group, self._layout = resolve_group(group, device_mesh, shard_size)  # docs/hybrid.md
        self._checked_over = None if self._layout else self.group  # a layout: every rank of the world agrees
        self.world_size = comm.group_size(self.group)
        self.rank = comm.group_rank(self.group)
        self._delay = DelayedUpdate(delay, self.rank)  # Note [delayed update] in shardopt.optim.delayed_update
        self.broadcast_fp16 = broadcast_fp16
        self._consolidated: Snapshot | Missing = Missing(Gap.NEVER)  # Note [snapshot freshness] in state_transport
        self._masters = MasterWeights(master_dtype, host)
        self._plan: SplitPlan  # set by _repartition, with the rest of the plan's state
        self._shard: LocalShard
        if any(p.is_meta for p in self.params):
            raise ValueError("OSS got meta-device parameters: call module.to_empty(device=...) and re-initialise first")
        check_same_parameters("OSS", self.param_groups, self._checked_over)
        check_agreement("OSS", [("broadcast_fp16", broadcast_fp16), ("optim", optim.__qualname__),
                                ("master_dtype", str(master_dtype)), ("split_large_params", str(self.split_large_params)),
                                ("layout", self._layout.fingerprint() if self._layout else None),
                                ("offload", offload), ("delay_update_after", delay)],
                        self._checked_over,
                        "pass the same OSS arguments on every rank")  # Note [agree before the first collective] in agreement
        if check_master_dtype(master_dtype, self.params) or host:  # Note [clipping that bypasses the wrapper]
            clipping.register_sharded(self, self.params, "OSS.clip_grad_norm", clip_for_wrapper)  # grads go to masters
        elif master_dtype is not None:
            _warn_once("no-masters", f"OSS(master_dtype={master_dtype}): every parameter is already {master_dtype}, "
                       "so no master copies are kept and nothing changes; remove master_dtype, or cast the model "
                       "to torch.bfloat16 to train with fp32 masters")
        self._repartition(migrate=False)
        self.defaults = dict(self.optim.defaults)
        warn_if_unbalanced(self._plan, self.params, self.split_large_params, optim)

    # ------------------------------------------------------------------ partition

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """Every parameter of every group, in order: what :attr:`partition` indexes."""
        return tuple(p for g in self.param_groups for p in g["params"])

    @property
    def partition(self) -> Partition:
        """The read-only ownership plan over :attr:`params` (frozen params have size 0); a parameter split across
        ranks is listed with the owner of its first rows (:attr:`plan` has every block)."""
        return self._partition

    @property
    def layout(self) -> HybridLayout | None:
        """The hybrid layout (``None``: flat); :attr:`group` is then its shard group (docs/hybrid.md)."""
        return self._layout

    @property
    def plan(self) -> SplitPlan:
        """Who owns which rows of which parameter of :attr:`params` (one block per parameter
        unless :attr:`split_large_params`; Note [split plan] in :mod:`shardopt.partition`)."""
        return self._plan

    def owns(self, index: int) -> bool:
        """Whether this rank owns rows of ``params[index]`` (frozen parameters have an owner too)."""
        return self._shard.owned.owns(index)

    def owned_rows(self, param: torch.Tensor) -> tuple[int, int] | None:
        """The dim-0 rows ``[start, stop)`` of ``param`` this rank owns (all of them for one kept whole), or ``None``."""
        index = self._index_of.get(param)
        return None if index is None else self._shard.owned.rows.get(index)

    def grad_holder(self, param: torch.Tensor) -> torch.Tensor | None:
        """The tensor whose ``.grad`` the step reads for this rank's rows of a trainable ``param``: its master,
        the row view of a split parameter (Note [row views] in :mod:`shardopt.optim.owned_rows`), or ``param``
        itself; ``None`` where this rank owns none of it or it is frozen. Under offload on a GPU that ``.grad``
        lands asynchronously: read it after :meth:`wait_for_grads` (clipping and the step wait too)."""
        index = self._index_of.get(param)
        if index is None or not self._shard.owned.owns(index) or not param.requires_grad:
            return None
        return self._shard.holder(index, param)

    def add_grad(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """:meth:`add_grads` of one gradient."""
        self.add_grads([(param, grad)])

    def add_grads(self, grads: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add each ``(param, grad)`` (this rank's rows of ``param``'s reduced gradient) to what the step reads:
        masters' gradients into their buffer in one copy per run that lies end to end in ``grad``'s storage and in
        the buffer (Note [one copy per bucket] in :mod:`shardopt.optim.flat_masters`; to the host under offload, on a
        copy stream on a GPU: Note [offload copies on a side stream]), else into :meth:`grad_holder`'s ``.grad``."""
        self._shard.add_grads([(self._index_of[param], param, grad) for param, grad in grads])

    @property
    def offload(self) -> str | None:
        """``"cpu"`` when masters and state live and step there (Note [offloaded masters]), else ``None``."""
        return None if self._masters.offload is None else self._masters.offload.type

    def offloaded_buffers(self) -> list[torch.Tensor]:
        """The masters' host buffers, their kept gradients' and a delayed step's copy of those; ``[]`` without offload."""
        return self._masters.host_buffers()

    def wait_for_grads(self) -> None:
        """Wait for the gradients copied to the host to land (Note [offload copies on a side stream]); else nothing."""
        self._masters.copies.land_grads()

    @property
    def delay_update_after(self) -> int | None:
        """The ordinary steps before the update is delayed (Note [delayed update]); ``None``: never delayed."""
        return self._delay.after_steps

    @property
    def master_dtype(self) -> torch.dtype | None:
        """The dtype of the master weights (``None``: no masters; Note [master weights] in shardopt.optim.masters)."""
        return self._masters.dtype

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The master weight of ``param`` if this rank keeps one (it owns the trainable parameter and ``master_dtype``
        is wider than it), else ``None``. The optimizer steps the master; its ``.grad`` is the gradient the step uses
        (Note [master gradients] in :mod:`shardopt.optim.masters`). Do not replace the tensor."""
        index = self._index_of.get(param)
        return None if index is None else self._masters.get(index)

    def collect_master_grads(self) -> None:
        """Fold every owned parameter's ``.grad`` into its master's fp32 ``.grad`` and free it. The step does it
        itself; ``ShardedGradScaler.unscale_`` and :meth:`clip_grad_norm` call it first to work on fp32 gradients
        (Note [master gradients] in shardopt.optim.masters), landed first (:meth:`wait_for_grads`). Local: no
        collective. Without masters it does nothing."""
        self._shard.collect_grads(self.params)

    def partition_parameters(self) -> list[list[dict[str, Any]]]:
        """fairscale's view: for each rank, its param groups restricted to its trainable params.

        Returns:
            ``result[rank][group]`` is a param-group dict whose ``params`` are the trainable
            parameters of that group ``rank`` owns rows of (a split parameter is listed for
            each of its owners).
        """
        return groups_by_rank(self._plan, self.param_groups)

    def refresh_trainable(self) -> None:
        """Re-partition after parameters were frozen or unfrozen. Call on every rank.

        Optimizer state moves with its parameter to the new owner; the state of a frozen
        parameter is kept for when it is unfrozen (Note [parked state]).

        Raises:
            ValueError: the ranks froze different parameters (named), or a trainable
                parameter is not contiguous.
        """
        check_same_parameters("OSS", self.param_groups, self._checked_over)
        self._repartition(migrate=True)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as ``torch.optim``) and re-partition. Call on every rank.

        Args:
            param_group: a dict with ``params`` and optional hyperparameters.

        Raises:
            ValueError: the ranks added different parameters, or ``master_dtype`` cannot
                hold one of them.
        """
        super().add_param_group(param_group)
        if self._building:
            return
        try:
            check_same_parameters("OSS", self.param_groups, self._checked_over)
            check_master_dtype(self.master_dtype, self.params)
        except ValueError:
            self.param_groups.pop()  # leave the optimizer as it was
            raise
        self._repartition(migrate=True)

    def _repartition(self, migrate: bool) -> None:
        """Plan ownership, (re)build the shard optimizer and move state to the new owners."""
        self.finish_update()
        params = self.params
        self._plan, self._partition = plan_ownership(params, self.world_size, self.split_large_params)
        fragments = self._shard.fragments(self.params) if migrate else {}  # masters travel in them
        self._shard = LocalShard(self._plan, self.rank, self._masters)
        self._trainable_sig = tuple(p.requires_grad for p in params)
        old_state = self._shard.receive(fragments, params, self.param_groups, self.group) if migrate else {}
        self._index_of = {p: i for i, p in enumerate(params)}
        # See Note [shard optimizer rebuild].
        self.optim: Optimizer = self._shard.build(params, group_ranges(self.param_groups), self._optim_cls,
                                                  self._optim_defaults, old_state, self.group)
        self.state = self.optim.state  # type: ignore[assignment]
        self._shard.pull_hyperparams(self.param_groups)
        self._gather = ParamGather(
            list(params), self._plan, self.rank, self.group, DEFAULT_GATHER_BUCKET_BYTES, self.broadcast_fp16
        )
        self._consolidated = dropped(self._consolidated, Gap.REPARTITIONED)

    # ------------------------------------------------------------------ step

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Step the local shard, then gather every rank's updated parameters. Call on every rank.

        With masters, the step uses each master's fp32 gradient (owned ``param.grad`` folded in
        first), updates the masters, rounds them into the parameters and frees the masters'
        gradients (Note [master gradients] in shardopt.optim.masters). With ``delay_update_after``, past the
        warm-up it writes the last step's update and launches this one on a worker (Note [delayed update]).

        Args:
            closure: re-evaluates the model and returns the loss (as ``torch.optim``).
            **kwargs: passed to the wrapped optimizer's ``step``.

        Returns:
            The closure's loss, or ``None``.

        Raises:
            ValueError: a closure with ``delay_update_after``.
            RuntimeError: the last delayed update failed (:meth:`finish_update`).
        """
        clipping.check_step(self, self.params, self.rank)  # Note [torch's GradScaler on sharded gradients]
        self._delay.refuse_closure(closure)
        if tuple(p.requires_grad for p in self.params) != self._trainable_sig:
            _warn_once("trainable", "OSS: parameters were frozen or unfrozen; call refresh_trainable() on "
                       "every rank (ShardedDataParallel does it for you)")
        self.finish_update()
        self._consolidated = dropped(self._consolidated, Gap.STEPPED)
        self._shard.push_hyperparams(self.param_groups)
        params = self.params
        self._masters.follow_outside_writes(params)
        delayed = self._delay.begin_step()  # counts every step (Note [saved step count]); False with a closure
        if closure is not None:
            loss = self._shard.run_closure_step(params, closure, lambda folding: self.optim.step(closure=folding, **kwargs))
        else:
            self._shard.collect_grads(params)
            if delayed:  # Note [delayed update] in shardopt.optim.delayed_update
                self._shard.launch(params, self._delay, lambda: self.optim.step(**kwargs))
                self._shard.pull_hyperparams(self.param_groups)
                return None
            self._shard.prepare_step(params)
            loss = self._shard.run_step(lambda: self.optim.step(**kwargs))
        self._shard.release_grads(params)
        self._shard.pull_hyperparams(self.param_groups)
        self._write_update(params)
        return loss

    def _write_update(self, params: tuple[torch.Tensor, ...]) -> None:
        """Round the masters into the parameters and gather every rank's (Note [offload copies on a side stream])."""
        self._gather.gather(self._masters.write_back(params, self._gather.send_order))
        self._masters.after_gather(params)

    def finish_update(self) -> None:
        """Wait for the update the last ``step()`` left running (``delay_update_after``) and write it into the
        parameters, which lack it until then (Note [delayed update]). Call on every rank, e.g. before evaluating
        and at the end of training; saving and consolidating call it. Without a pending update: nothing.

        Raises:
            RuntimeError: the update failed on its worker thread (raised once, before this rank's gather).
        """
        if self._delay.wait():
            self._write_update(self.params)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """False; raises toward torch's GradScaler.step under ShardedDataParallel (clipping.refuse_torch_scaler_read)."""
        return clipping.refuse_torch_scaler_read(sys._getframe(1), self.params, self, self.rank)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim``'s over every parameter; also frees the masters' gradients
        whatever ``set_to_none`` says (Note [master gradients] in shardopt.optim.masters).

        Args:
            set_to_none: drop the parameters' gradients instead of zeroing them.
        """
        super().zero_grad(set_to_none=set_to_none)
        self._shard.free_grads()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0,
                       filter_params_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None) -> torch.Tensor:
        """Clip the gradients of the whole model by their global norm; call on every rank.

        How it works: each rank takes the norm of each owned gradient, the ranks exchange
        those per-parameter norms in one small all-reduce, and every rank combines them in
        the order ``torch.nn.utils.clip_grad_norm_`` would (grouped by device and dtype, then
        the module's order under ShardedDataParallel, else that of :attr:`params`), so the
        total equals torch's on the full gradients bit for bit when no parameter is split
        across ranks; a split one (:attr:`plan`) counts the norm of its blocks' norms, within
        torch's own summation error (Note [sharded norm in torch's order] in
        :mod:`shardopt.optim.grad_norm`). Owned gradients are then
        scaled by ``min(1, max_norm / (total + 1e-6))``; other ranks' gradients are left
        alone (their owners scale them). With masters, the norm is taken of and the clip
        applied to the masters' fp32 gradients (owned ``.grad`` folded in first).

        Args:
            max_norm: the largest allowed total norm.
            norm_type: the p of the p-norm; ``float('inf')`` for the max norm.
            filter_params_fn: optional function selecting which owned parameters count
                (and get clipped); it receives and returns a list of parameters.

        Returns:
            The total norm, a tensor in the promoted dtype of the trainable parameters'
            gradients (``master_dtype`` for those with masters).

        Raises:
            RuntimeError: another rank did not call it (Note [clip on some ranks only]).
        """
        ordered = clipping.in_wrapper_order(self.params, self)  # Note [sharded norm in torch's order]
        return clip_params([self], ordered, ClipArgs(float(max_norm), float(norm_type)), filter_params_fn)

    # ------------------------------------------------------------------ state dict

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Collect every rank's shard state on ``recipient_rank`` (``-1``: on every rank).

        Call on every rank, after the last step. Shards travel one at a time (point to
        point to one recipient, or one broadcast per source rank for ``-1``), so no rank
        holds more than its own shard and one other in flight. Afterwards
        :meth:`state_dict` on the recipient returns a plain ``torch.optim`` state dict. As
        with ``torch.optim``, the recipient's own entries share storage with its live state:
        save (or deep-copy) before stepping again.

        Args:
            recipient_rank: the group rank that receives the state, or ``-1`` for all.

        Raises:
            ValueError: ``recipient_rank`` is not -1 or a rank of the group.
        """
        if not isinstance(recipient_rank, int) or not -1 <= recipient_rank < self.world_size:
            raise ValueError(f"recipient_rank must be -1 (all ranks) or a rank in [0, {self.world_size}), "
                             f"got {recipient_rank!r}; pass the rank that will save the checkpoint")
        self.finish_update()
        local = {key: to_cpu(s) for key, s in self._shard.fragments(self.params).items()}
        merged = collect(local, recipient_rank, self.rank, self.world_size, self.group)
        self._consolidated = (Missing(Gap.ELSEWHERE, recipient_rank) if merged is None
                              else Snapshot(merged, tuple(p._version for p in self.params)))

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:  # type: ignore[override]
        """The consolidated optimizer state, as a plain ``torch.optim`` state dict.

        Args:
            all_ranks: consolidate onto every rank now (a collective: call on every rank)
                instead of returning what :meth:`consolidate_state_dict` collected.

        Returns:
            ``{"state": {index: {...}}, "param_groups": [...], "oss_steps": n}`` over :attr:`params`,
            loadable by this class at any world size or by the unsharded torch optimizer.
            Hyperparameters are read now (Note [snapshot freshness] in state_transport).

        Raises:
            RuntimeError: nothing consolidated on this rank since the last step (or load,
                group change): the message says which, and names shardopt's integration
                when Accelerate, the Trainer or Lightning called; or a master stale after a
                weight write.
        """
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        if isinstance(self._consolidated, Missing):  # why, and the fix: no_snapshot_error
            raise no_snapshot_error(self._consolidated, self.rank, sys._getframe(1))
        if self.master_dtype is not None:
            refuse_stale_masters(self._consolidated, self.params, self.rank)
        groups = [{**hyper(g), "params": list(indices)} for g, indices in group_ranges(self.param_groups)]
        return {"state": self._consolidated.state, "param_groups": groups, **self.state_dict_entries()}

    def state_dict_entries(self) -> dict[str, Any]:
        """The entries of :meth:`state_dict` beside ``state`` and ``param_groups``: ``{"oss_steps": step() calls
        taken}``, what ``delay_update_after`` counts (Note [saved step count] in shardopt.optim.delayed_update)."""
        return self._delay.saved_entries()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain ``torch.optim`` state dict, saved at any world size or unsharded.

        Each rank keeps the state of the parameters it owns (frozen ones parked, Note
        [parked state]); every group's hyperparameters are restored on every rank. As with
        ``torch.optim``, tensors already on the right device and dtype are not copied.
        Master weights (``state[i]["master"]``) are copied into this rank's masters; a master
        the dict lacks (saved without ``master_dtype``) restarts from its parameter, and
        masters this OSS keeps none for are ignored (each warns once). Load the model's
        weights too (before or after): a master and its parameter must agree (Note [masters
        follow outside writes] in :mod:`shardopt.optim.masters`). The step count (``"oss_steps"``)
        is taken, or restarts from 0 when the dict has none (Note [saved step count]).

        Args:
            state_dict: from :meth:`state_dict` or ``torch.optim.Optimizer.state_dict``.

        Raises:
            ValueError: the dict is not an optimizer state dict, or its groups, parameter counts, state
                indices, state shapes, master shapes or step count do not fit (checked first).
            TypeError: a state entry is not a dict.
        """
        groups, to_index = check_state_dict_groups(state_dict, [len(g["params"]) for g in self.param_groups])
        params = self.params
        check_state_fits(state_dict["state"], to_index, params)  # before anything changes
        state = {to_index[k]: dict(s) for k, s in state_dict["state"].items()}
        self._warn_ignored_masters([i for i, s in state.items() if MASTER_KEY in s])
        mine, rows = self._shard.owned.rows, self._plan.rows
        self._install({i: cut_rows(s, (0, rows[i]), mine[i]) for i, s in state.items() if i in mine}, groups, state_dict)

    def _warn_ignored_masters(self, indices: list[int]) -> None:
        """Warn once when saved masters of ``params[indices]`` have no master here to go to."""
        params = self.params
        ignored = [i for i in indices if not needs_master(params[i].dtype, self.master_dtype)]
        if ignored:
            _warn_once("masters-ignored", f"state_dict holds master weights for {len(ignored)} parameter(s) (first: "
                       f"{ignored[0]}) that this OSS (master_dtype={self.master_dtype}) keeps none for: they are "
                       "ignored and the parameters keep their values; pass master_dtype=torch.float32 to resume "
                       "from them")

    def _install(self, state: StateByIndex, groups: list[dict[str, Any]], entries: Mapping[str, Any]) -> None:
        """Take the saved hyperparameters of every group, the state of this rank's rows (``state``: by index,
        already cut to the rows this rank owns, masters included) and the saved step count (``entries``); a pending
        delayed update is dropped (Notes [delayed update], [saved step count] in shardopt.optim.delayed_update)."""
        self._delay.load(entries)
        for g, saved in zip(self.param_groups, groups, strict=False):
            g.update(hyper(saved))
        self._warn_ignored_masters([i for i, s in state.items() if MASTER_KEY in s])
        missing = self._shard.install(self.params, state, group_ranges(self.param_groups))
        if missing:
            _warn_once("masters-missing", f"state_dict has no master weights for {len(missing)} parameter(s) this "
                       f"rank steps in {self.master_dtype} (first: {missing[0]}), as when it was saved without "
                       "master_dtype: their masters restart from the parameters' values; load the model's weights "
                       "as well")
        self.state = self.optim.state  # type: ignore[assignment]
        self._consolidated = dropped(self._consolidated, Gap.LOADED)

    # ------------------------------------------------------------------ sharded checkpoint encoding

    def sharded_state_entries(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """This rank's optimizer state for a sharded checkpoint (Note [sharded optimizer layout]
        in :mod:`shardopt.checkpoint`): live and parked (frozen) entries alike.

        Returns:
            ``(tensors, values)``, both keyed ``"<index in params>.<state name>"`` (a block of a
            split parameter: ``"<index>@<start>-<stop>.<name>"``, Note [fragment keys] in
            :mod:`shardopt.optim.sharded_entries`): the tensors for
            ``torch.distributed.checkpoint`` (each written by its owner only), the other values
            for a small metadata file.
        """
        self.finish_update()
        return sharded_entries.encode(self._shard.fragments(self.params), self._plan.rows)

    def sharded_state_template(self, saved: Mapping[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
        """Empty tensors, for ``dcp.load`` to fill, for the ``saved`` entries (shape and dtype by key, as in
        :meth:`sharded_state_entries`) whose rows this rank owns now, frozen parameters included."""
        devices = {i: self._masters.offload or p.device for i, p in enumerate(self.params)}
        return sharded_entries.template(saved, self._shard.owned.rows, self._plan.rows, devices)

    def load_sharded_state_entries(self, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any],
                                   param_groups: list[dict[str, Any]], entries: Mapping[str, Any] | None = None) -> None:
        """Load this rank's entries (filled from a template), the saved hyperparameters and step count.

        Args:
            tensors: the filled template of :meth:`sharded_state_template`.
            values: every rank's non-tensor values, keyed as in :meth:`sharded_state_entries`.
            param_groups: the saved hyperparameters of every group (without ``params``).
            entries: the saved :meth:`state_dict_entries` (``None``, or without a count: steps count from 0).

        Raises:
            ValueError: as :meth:`load_state_dict`, or the saved fragments cover only part of
                the rows this rank owns.
        """
        state = sharded_entries.decode(tensors, values, self._shard.owned.rows, self._plan.rows)
        whole = {i: s for i, s in state.items() if i not in self._shard.owned.split}
        check_state_fits(whole, {i: i for i in whole}, self.params)
        self._install(state, param_groups, entries or {})
