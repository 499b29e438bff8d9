"""``OSS``: ZeRO stage 1, a sharded wrapper around any ``torch.optim`` optimizer."""

from __future__ import annotations

import hashlib
import logging
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import SGD, Optimizer

from shardopt import comm
from shardopt.buckets import DEFAULT_GATHER_BUCKET_BYTES, ParamGather
from shardopt.partition import Partition, partition_by_size

__all__ = ["OSS"]

logger = logging.getLogger(__name__)

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


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
    streams] in :mod:`shardopt.buckets`). Construction checks that every rank passed the
    same parameter list (a cheap fingerprint exchange) instead of hanging later.

    Args:
        params: parameters or param-group dicts, as for any ``torch.optim`` optimizer.
        optim: the optimizer *class* to shard (default ``torch.optim.SGD``).
        group: the process group (default: the world).
        broadcast_buffer_size: deprecated in fairscale; accepted and ignored (warns).
        broadcast_fp16: send fp32 parameters as fp16 in the post-step sync (half the bytes;
            non-owners get values rounded to fp16).
        force_broadcast_object: accepted for fairscale compatibility and ignored (warns):
            state is always exchanged as objects.
        **defaults: keyword arguments of ``optim`` (``lr``, ``momentum``, ...).

    Raises:
        TypeError: ``optim`` is not an optimizer class (e.g. an instance).
        RuntimeError: torch.distributed is not initialised.
        ValueError: the ranks passed different parameter lists, or a trainable parameter is
            not contiguous.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optim: type[Optimizer] = SGD,
        group: Any | None = None,
        broadcast_buffer_size: int = -1,
        broadcast_fp16: bool = False,
        force_broadcast_object: bool = False,
        **defaults: Any,
    ) -> None:
        if not (isinstance(optim, type) and issubclass(optim, Optimizer)):
            raise TypeError(
                f"optim must be a torch.optim.Optimizer subclass such as torch.optim.Adam, got "
                f"{optim!r}; pass the class and its arguments: OSS(params, optim=torch.optim.Adam, lr=1e-3)"
            )
        comm.require_initialized("OSS")
        if broadcast_buffer_size != -1:
            _warn_once("bbs", "OSS(broadcast_buffer_size=...) is deprecated and ignored")
        if force_broadcast_object:
            _warn_once("fbo", "OSS(force_broadcast_object=True) is ignored: state is always sent as objects")
        self._building = True
        super().__init__(params, defaults)
        self._building = False
        self._optim_cls = optim
        self._optim_defaults = defaults
        self.group = group
        self.world_size = comm.group_size(group)
        self.rank = comm.group_rank(group)
        self.broadcast_fp16 = broadcast_fp16
        self._consolidated: dict[str, Any] | None = None
        self._check_same_params_on_all_ranks()
        self.optim: Optimizer = self._optim_cls([{**_hyper(g), "params": []} for g in self.param_groups], **defaults)
        self._repartition(migrate=False)

    # ------------------------------------------------------------------ partition

    @property
    def params(self) -> tuple[torch.Tensor, ...]:
        """Every parameter of every group, in order: what :attr:`partition` indexes."""
        return tuple(p for g in self.param_groups for p in g["params"])

    @property
    def partition(self) -> Partition:
        """The read-only ownership plan over :attr:`params` (frozen params have size 0)."""
        return self._partition

    def owns(self, index: int) -> bool:
        """Whether this rank owns ``params[index]``."""
        return self._partition.owners[index] == self.rank

    def partition_parameters(self) -> list[list[dict[str, Any]]]:
        """fairscale's view: for each rank, its param groups restricted to its params."""
        params = self.params
        index = {p: i for i, p in enumerate(params)}
        return [
            [
                {**_hyper(g), "params": [p for p in g["params"] if self._partition.owners[index[p]] == r
                                         and self._partition.sizes[index[p]] > 0]}
                for g in self.param_groups
            ]
            for r in range(self.world_size)
        ]

    def refresh_trainable(self) -> None:
        """Re-partition after parameters were frozen or unfrozen. Call on every rank.

        Optimizer state moves with its parameter to the new owner; nothing is dropped.
        """
        self._repartition(migrate=True)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as ``torch.optim``) and re-partition. Call on every rank."""
        super().add_param_group(param_group)
        if self._building:
            return
        self.optim.add_param_group({**_hyper(self.param_groups[-1]), "params": []})
        self._check_same_params_on_all_ranks()
        self._repartition(migrate=True)

    def _repartition(self, migrate: bool) -> None:
        params = self.params
        for i, p in enumerate(params):
            if p.requires_grad and not p.is_contiguous():
                raise ValueError(
                    f"OSS needs contiguous parameters; parameter {i} (shape {tuple(p.shape)}) is not: "
                    "call .contiguous() on it (e.g. module.to(memory_format=torch.contiguous_format))"
                )
        sizes = [p.numel() * p.element_size() if p.requires_grad else 0 for p in params]
        old_state = self._local_state_by_index() if migrate else {}
        self._partition = partition_by_size(sizes, self.world_size)
        self._trainable_sig = tuple(p.requires_grad for p in params)
        if migrate:
            old_state = self._migrate_state(old_state)
        owned = {i for i in self._partition.indices_of(self.rank) if sizes[i] > 0}
        position = 0
        for group, shard_group in zip(self.param_groups, self.optim.param_groups):
            shard_group["params"] = [p for j, p in enumerate(group["params"], position) if j in owned]
            position += len(group["params"])
        self.optim.state.clear()
        for i, state in old_state.items():
            if i in owned:
                self.optim.state[params[i]] = state
        self.state = self.optim.state  # type: ignore[assignment]
        self._gather = ParamGather(
            list(params), self._partition, self.rank, self.group, DEFAULT_GATHER_BUCKET_BYTES, self.broadcast_fp16
        )
        self._consolidated = None

    def _local_state_by_index(self) -> dict[int, dict[str, Any]]:
        index = {p: i for i, p in enumerate(self.params)}
        return {index[p]: s for p, s in self.optim.state.items() if p in index}

    def _migrate_state(self, state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Send each state entry whose owner changed to its new owner, one rank at a time."""
        kept = {i: s for i, s in state.items() if self._partition.owners[i] == self.rank}
        for src in range(self.world_size):
            outgoing = None
            if src == self.rank:
                outgoing = {i: _to_cpu(s) for i, s in state.items() if self._partition.owners[i] != self.rank}
            incoming = comm.broadcast_object(outgoing, src, self.group)
            if src != self.rank:
                kept.update({i: s for i, s in incoming.items() if self._partition.owners[i] == self.rank})
        params = self.params
        return {i: {k: (v.to(params[i].device) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                    for k, v in s.items()} for i, s in kept.items()}

    def _check_same_params_on_all_ranks(self) -> None:
        """Compare a fingerprint of the parameter list across ranks; name the first mismatch."""
        desc = [
            (gi, tuple(p.shape), str(p.dtype), bool(p.requires_grad))
            for gi, g in enumerate(self.param_groups)
            for p in g["params"]
        ]
        digest = hashlib.sha256(repr(desc).encode()).hexdigest()
        digests = comm.all_gather_object(digest, self.group)
        if len(set(digests)) == 1:
            return
        descs = comm.all_gather_object(desc, self.group)
        other = next(r for r, d in enumerate(digests) if d != digests[0])
        a, b = descs[0], descs[other]
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                detail = (f"parameter {i} is (group, shape, dtype, requires_grad)={x} on rank 0 "
                          f"but {y} on rank {other}")
                break
        else:
            detail = f"rank 0 has {len(a)} parameters, rank {other} has {len(b)}"
        raise ValueError(
            f"OSS was given different parameter lists on different ranks: {detail}; every rank must "
            "pass the same parameters in the same order (build the model identically on all ranks)"
        )

    # ------------------------------------------------------------------ step

    def _push_hyperparams(self) -> None:
        for group, shard_group in zip(self.param_groups, self.optim.param_groups):
            shard_group.update(_hyper(group))

    def _pull_hyperparams(self) -> None:
        for group, shard_group in zip(self.param_groups, self.optim.param_groups):
            group.update(_hyper(shard_group))

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Step the local shard, then gather every rank's updated parameters.

        Args:
            closure: re-evaluates the model and returns the loss (as ``torch.optim``).
            **kwargs: passed to the wrapped optimizer's ``step``.

        Returns:
            The closure's loss, or ``None``.
        """
        if tuple(p.requires_grad for p in self.params) != self._trainable_sig:
            _warn_once("trainable", "OSS: parameters were frozen or unfrozen; call refresh_trainable() on "
                       "every rank (ShardedDataParallel does it for you)")
        self._consolidated = None
        self._push_hyperparams()
        loss = self.optim.step(closure=closure, **kwargs) if closure is not None else self.optim.step(**kwargs)
        self._pull_hyperparams()
        self._gather.gather()
        return loss

    def clip_grad_norm(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        filter_params_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Clip the gradients of the whole model by their global norm; call on every rank.

        Each rank takes the norm of the gradients of the parameters it owns, the ranks
        combine them (sum of p-th powers, or max for inf), and every owned gradient is
        scaled by ``max_norm / (total + 1e-6)`` when that is below 1, as
        ``torch.nn.utils.clip_grad_norm_`` does on the full gradients.

        Args:
            max_norm: the largest allowed total norm.
            norm_type: the p of the p-norm; ``float('inf')`` for the max norm.
            filter_params_fn: optional function selecting which owned parameters count.

        Returns:
            The total norm, as a float32 tensor on the gradients' device.
        """
        params = [p for i, p in enumerate(self.params) if self.owns(i) and p.grad is not None]
        if filter_params_fn is not None:
            params = list(filter_params_fn(params))
        norm_type = float(norm_type)
        device = params[0].grad.device if params else self.params[0].device  # type: ignore[union-attr]
        grads = [p.grad.detach() for p in params]  # type: ignore[union-attr]
        if norm_type == math.inf:
            local = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
            local = local.to(device)
            comm.all_reduce(local, self.group, op="max").wait()
            total = local
        else:
            local = (torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads])
                     .pow(norm_type).sum() if grads else torch.zeros((), device=device))
            local = local.to(device)
            comm.all_reduce(local, self.group, op="sum").wait()
            total = local.pow(1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))
        return total

    # ------------------------------------------------------------------ state dict

    def consolidate_state_dict(self, recipient_rank: int = 0) -> None:
        """Collect every rank's shard state on ``recipient_rank`` (``-1``: on every rank).

        Call on every rank. Shards travel one at a time, so no rank holds more than its
        own shard and one other in flight. Afterwards :meth:`state_dict` on the recipient
        returns a plain ``torch.optim`` state dict.

        Raises:
            ValueError: ``recipient_rank`` is not -1 or a rank of the group.
        """
        if not -1 <= recipient_rank < self.world_size:
            raise ValueError(f"recipient_rank must be -1 (all ranks) or in [0, {self.world_size}), "
                             f"got {recipient_rank}")
        local = {i: _to_cpu(s) for i, s in self._local_state_by_index().items()}
        merged: dict[int, Any] = {}
        for src in range(self.world_size):
            if recipient_rank == -1:
                shard = comm.broadcast_object(local if src == self.rank else None, src, self.group)
            elif src == recipient_rank:
                shard = local if src == self.rank else None
            elif self.rank == src:
                comm.send_object(local, recipient_rank, self.group)
                shard = None
            elif self.rank == recipient_rank:
                shard = comm.recv_object(src, self.group)
            else:
                shard = None
            if shard is not None:
                merged.update(shard)
        if recipient_rank in (-1, self.rank):
            groups, start = [], 0
            for g in self.param_groups:
                groups.append({**_hyper(g), "params": list(range(start, start + len(g["params"])))})
                start += len(g["params"])
            self._consolidated = {"state": dict(sorted(merged.items())), "param_groups": groups}
        else:
            self._consolidated = None

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:  # type: ignore[override]
        """The consolidated optimizer state, as a plain ``torch.optim`` state dict.

        Args:
            all_ranks: consolidate onto every rank now (a collective: call on every rank)
                instead of returning what :meth:`consolidate_state_dict` collected.

        Raises:
            RuntimeError: nothing was consolidated on this rank since the last step.
        """
        if all_ranks:
            self.consolidate_state_dict(recipient_rank=-1)
        if self._consolidated is None:
            raise RuntimeError(
                f"[rank {self.rank}] OSS.state_dict() has no consolidated state: call "
                "optimizer.consolidate_state_dict(recipient_rank) on every rank first (after the last "
                "step), then state_dict() on the recipient, or state_dict(all_ranks=True) on every rank"
            )
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a plain ``torch.optim`` state dict, saved at any world size or unsharded.

        Each rank keeps the state of the parameters it owns. Hyperparameters of every group
        are restored.

        Raises:
            ValueError: the dict's groups or parameter counts do not match this optimizer.
        """
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError("state_dict must be a torch.optim state dict with 'state' and 'param_groups'")
        ours = [len(g["params"]) for g in self.param_groups]
        theirs = [len(g["params"]) for g in groups]
        if ours != theirs:
            raise ValueError(
                f"state_dict has parameter groups of sizes {theirs} but this OSS has {ours}; load a state "
                "dict saved from the same model and param groups"
            )
        local_groups, index_map, start = [], {}, 0
        owned = [p for g in self.optim.param_groups for p in g["params"]]
        position = {p: i for i, p in enumerate(self.params)}
        for g, saved in zip(self.param_groups, groups):
            g.update(_hyper(saved))
            start += len(g["params"])
        local_params = []
        for p in owned:
            index_map[position[p]] = len(local_params)
            local_params.append(position[p])
        it = iter(range(len(owned)))
        for g, shard_group in zip(self.param_groups, self.optim.param_groups):
            local_groups.append({**_hyper(g), "params": [next(it) for _ in shard_group["params"]]})
        saved_state = state_dict["state"]
        local_state = {index_map[int(i)]: s for i, s in saved_state.items() if int(i) in index_map}
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.state = self.optim.state  # type: ignore[assignment]
        self._consolidated = None
