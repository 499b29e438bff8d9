"""What one rank of OSS steps: the wrapped optimizer over its rows, their fp32 masters and row
views, and the parked state of its frozen parameters.

OSS (the global view: param groups, plan, gather, state dicts) builds one :class:`LocalShard`
per plan (Note [shard optimizer rebuild] in :mod:`shardopt.optim.oss`) and asks it for the
tensors and state of this rank's rows, keyed by index in ``OSS.params``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from shardopt import comm
from shardopt.agreement import raise_if_any_failed
from shardopt.optim.delayed_update import DelayedUpdate
from shardopt.optim.elementwise import updates_elementwise
from shardopt.optim.flat_masters import FlatGroup, Layout, compact_state
from shardopt.optim.masters import MasterWeights, needs_master
from shardopt.optim.owned_rows import OwnedRows
from shardopt.optim.state_transport import Fragments, StateByIndex, migrate, state_to_param
from shardopt.partition import Partition, SplitPlan, cut_quantum, plan_split, plan_whole
from shardopt.state_checks import MASTER_KEY

__all__ = ["LocalShard", "group_ranges", "groups_by_rank", "hyper", "plan_ownership"]


def hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters (everything but ``params``)."""
    return {k: v for k, v in group.items() if k != "params"}


def group_ranges(groups: list[dict[str, Any]]) -> list[tuple[dict[str, Any], range]]:
    """Each param group with the indices of its parameters in ``OSS.params`` (groups in order)."""
    ranges, start = [], 0
    for g in groups:
        ranges.append((g, range(start, start + len(g["params"]))))
        start += len(g["params"])
    return ranges


def plan_ownership(params: Sequence[torch.Tensor], world_size: int, split: bool) -> tuple[SplitPlan, Partition]:
    """Plan which rank owns which rows of each trainable parameter (pure: the same on every rank).

    Args:
        params: every parameter of OSS, in order (frozen ones get size 0).
        world_size: the ranks to plan over.
        split: cut parameters larger than their fair share into row blocks (``OSS.split_large_params``).

    Returns:
        The plan, and its fairscale-style :class:`~shardopt.partition.Partition` (a split parameter
        listed with the owner of its first rows).

    Raises:
        ValueError: a trainable parameter is not contiguous.
    """
    for i, p in enumerate(params):
        if p.requires_grad and not p.is_contiguous():
            raise ValueError(
                f"OSS needs contiguous parameters; parameter {i} (shape {tuple(p.shape)}, strides "
                f"{p.stride()}) is not: make it contiguous before building the optimizer, e.g. "
                "param.data = param.data.contiguous() or module.to(memory_format=torch.contiguous_format)"
            )
    sizes = [p.numel() * p.element_size() if p.requires_grad else 0 for p in params]
    rows = [p.shape[0] if p.dim() else 1 for p in params]
    if split:
        quanta = [cut_quantum(p.numel() // r if r else 0) for p, r in zip(params, rows, strict=True)]
        plan = plan_split(sizes, rows, world_size, quanta)
    else:
        plan = plan_whole(sizes, rows, world_size)
    first = {b.param: b.owner for b in reversed(plan.blocks)}
    return plan, Partition(world_size, tuple(sizes), tuple(first[i] for i in range(len(params))))


def groups_by_rank(plan: SplitPlan, groups: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each rank's param groups restricted to the trainable parameters it owns rows of under ``plan``
    (``OSS.partition_parameters``: ``result[rank][group]``; a split parameter is listed for each owner)."""
    owned = [{b.param for b in plan.blocks_of_rank(r)} for r in range(plan.num_ranks)]
    result: list[list[dict[str, Any]]] = [[] for _ in owned]
    for g, indices in group_ranges(groups):
        for mine, out in zip(owned, result, strict=True):
            out.append({**hyper(g), "params": [p for i, p in zip(indices, g["params"], strict=True)
                                               if i in mine and plan.sizes[i] > 0]})
    return result


class LocalShard:
    """This rank's part of an OSS under one plan.

    How it works: :meth:`build` keeps masters for the trainable rows this rank owns (in flat
    buffers: Note [flat masters] in :mod:`shardopt.optim.flat_masters`), makes row views of
    the split ones without masters (Note [row views] in :mod:`shardopt.optim.owned_rows`),
    builds the wrapped optimizer over them in the global groups' order (a group's aligned
    masters as one flat tensor for an elementwise optimizer) and puts carried state back
    (live, or parked for frozen parameters: Note [parked state] in :mod:`shardopt.optim.oss`).
    A step is :meth:`collect_grads` (the fold, also run early by clipping and the scaler), then
    :meth:`prepare_step` and :meth:`run_step` now (:meth:`run_closure_step` with a closure), or
    :meth:`launch` on a worker thread (Note [delayed update] in
    :mod:`shardopt.optim.delayed_update`), and :meth:`release_grads`.

    Args:
        plan: the ownership plan over ``OSS.params``.
        rank: this rank.
        masters: OSS's master weights (kept across plans; rebuilt here).
    """

    def __init__(self, plan: SplitPlan, rank: int, masters: MasterWeights) -> None:
        self.owned = OwnedRows(plan, rank)
        self.rank = rank
        self.masters = masters
        self.parked: StateByIndex = {}
        self.optim: Optimizer | None = None
        self._groups: list[list[int]] = []  # the trainable indices of each param group
        self._flat_of: dict[torch.Tensor, FlatGroup] = {}

    def build(self, params: Sequence[torch.Tensor], groups: list[tuple[dict[str, Any], range]],
              optim_cls: type[Optimizer], defaults: dict[str, Any], carried: StateByIndex,
              group: comm.ProcessGroup | None) -> Optimizer:
        """Build the wrapped optimizer over this rank's trainable rows and take ``carried`` state.

        Args:
            params: every parameter, by index.
            groups: each global param group with the indices of its parameters.
            optim_cls: the wrapped optimizer class, and ``defaults`` its arguments.
            defaults: the wrapped optimizer's keyword arguments.
            carried: state this rank keeps or received for its rows (masters included).
            group: OSS's group: if the optimizer refuses what one rank owns (torch's Muon and a
                1-D parameter), every rank raises (:func:`~shardopt.agreement.raise_if_any_failed`).

        Raises:
            ValueError: the wrapped optimizer refused the parameters of some rank (named).
        """
        sizes = self.owned.plan.sizes
        trainable = {i for i in self.owned.rows if sizes[i] > 0}
        group_of = [n for n, (_, indices) in enumerate(groups) for _ in indices]
        self.masters.rebuild(params, trainable, {i: carried[i].pop(MASTER_KEY) for i in trainable
                                                 if MASTER_KEY in carried.get(i, {})}, self.owned.split_rows(),
                             group_of, updates_elementwise(optim_cls))
        self._flat_of = {g.flat: g for g in self.masters.groups if g.flat is not None}
        self.owned.build_views(params, [i for i in trainable if self.masters.get(i) is None])
        self._groups = [[i for i in indices if i in trainable] for _, indices in groups]
        shard_groups = [{**hyper(g), "params": self._tensors(params, indices)}
                        for (g, _), indices in zip(groups, self._groups, strict=True)]
        failure = None
        try:
            self.optim = optim_cls(shard_groups, **defaults)
        except (ValueError, TypeError, RuntimeError) as exc:  # it refused what this rank owns
            failure = exc
        raise_if_any_failed(f"OSS: building {optim_cls.__qualname__} over the parameters each rank owns", failure,
                            group)
        assert self.optim is not None
        self.parked = {i: compact_state(s) for i, s in carried.items() if i not in trainable}
        live = {i: s for i, s in carried.items() if i in trainable and s}
        for flat_group in self.masters.groups:
            if flat_group.flat is None:
                continue
            joined = flat_group.join_states(live)
            if joined is None:  # Note [flat state falls back to views] in shardopt.optim.flat_masters
                flat_group.to_views(self.optim.state)
            elif joined:
                self.optim.state[flat_group.flat] = joined
        self._relist(params)
        for i, state in live.items():
            if not self._in_flat(i):
                self.optim.state[self._stepped(i, params[i])] = compact_state(state)
        return self.optim

    def receive(self, fragments: Fragments, params: Sequence[torch.Tensor], groups: list[dict[str, Any]],
                group: comm.ProcessGroup | None) -> StateByIndex:
        """The state of this plan's rows: every rank's old ``fragments`` whose rows changed owner are
        sent to their new owners, one rank at a time, and kept ones stay; by index, on each
        parameter's device (the host under offload) with its group's hyperparameters."""
        kept = migrate(fragments, self.owned.plan, self.rank, self.owned.plan.num_ranks, group)
        group_of = [g for g in groups for _ in g["params"]]
        return {i: state_to_param(s, params[i], group_of[i], self.masters.offload) for i, s in kept.items()}

    def push_hyperparams(self, groups: list[dict[str, Any]]) -> None:
        """Copy the global groups' hyperparameters (schedulers, user edits) to the wrapped optimizer."""
        for group, shard_group in zip(groups, self._live().param_groups, strict=True):
            shard_group.update(hyper(group))

    def pull_hyperparams(self, groups: list[dict[str, Any]]) -> None:
        """Copy the wrapped optimizer's hyperparameters back to the global ``groups``."""
        for group, shard_group in zip(groups, self._live().param_groups, strict=True):
            group.update(hyper(shard_group))

    def _in_flat(self, index: int) -> bool:
        """Whether ``params[index]`` is stepped as part of a flat tensor now."""
        flat_group = self.masters.group_of(index)
        return flat_group is not None and flat_group.stepped_flat(index)

    def _tensors(self, params: Sequence[torch.Tensor], indices: Sequence[int]) -> list[torch.Tensor]:
        """What the wrapped optimizer steps for ``params[indices]`` (one group), in order: each
        flat tensor once, where its first member is, and the other holders."""
        out: list[torch.Tensor] = []
        for i in indices:
            flat_group = self.masters.group_of(i)
            if flat_group is not None and flat_group.stepped_flat(i):
                if not any(t is flat_group.flat for t in out):
                    out.append(flat_group.flat)  # type: ignore[arg-type]
            else:
                out.append(self._stepped(i, params[i]))
        return out

    def _relist(self, params: Sequence[torch.Tensor]) -> None:
        """Give the wrapped optimizer's groups the tensors of the current layouts."""
        for shard_group, indices in zip(self._live().param_groups, self._groups, strict=True):
            shard_group["params"] = self._tensors(params, indices)

    def holder(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """What holds the rows of ``params[index]`` this rank steps, and their gradient: its
        master, its row view, or the parameter itself."""
        master = self.masters.get(index)
        if master is not None:
            return master
        view = self.owned.view(index)
        return param if view is None else view

    def _stepped(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """What the wrapped optimizer steps for ``params[index]`` outside a flat tensor: :meth:`holder`, or an
        offloaded master's stepped view (Note [delayed update] in :mod:`shardopt.optim.delayed_update`)."""
        flat_group = self.masters.group_of(index)
        return self.holder(index, param) if flat_group is None else flat_group.stepped[index]

    def _live(self) -> Optimizer:
        assert self.optim is not None, "LocalShard.build() was not called"
        return self.optim

    def state_by_index(self, params: Sequence[torch.Tensor]) -> StateByIndex:
        """This rank's optimizer state (live and parked, masters under ``MASTER_KEY``), by index;
        a flat tensor's state is cut per parameter (Note [flat masters] in shardopt.optim.flat_masters)."""
        self.masters.follow_outside_writes(params)
        index = {self._stepped(i, p): i for group in self._groups for i, p in ((i, params[i]) for i in group)}
        state: StateByIndex = {}
        for tensor, entry in self._live().state.items():
            flat_group = self._flat_of.get(tensor)
            if flat_group is not None and entry:
                state.update(flat_group.split_state(entry))
            elif tensor in index and entry:
                state[index[tensor]] = entry
        for i, master in self.masters.saved_items():  # not the mirrors: Note [offloaded masters] in shardopt.optim.masters
            state[i] = {**state.get(i, {}), MASTER_KEY: master}
        state.update(self.parked)
        return dict(sorted(state.items()))

    def fragments(self, params: Sequence[torch.Tensor]) -> Fragments:
        """:meth:`state_by_index` keyed by index and the rows each entry covers."""
        return {(i, *self.owned.rows[i]): s for i, s in self.state_by_index(params).items()}

    def collect_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Fold owned ``.grad`` into the masters' and link the row views' gradients (local).
        Touches nothing the wrapped optimizer steps (a delayed step may be running: Note
        [delayed update] in :mod:`shardopt.optim.delayed_update`)."""
        self.owned.refresh(params)
        self.masters.fold_grads(params)
        self.owned.link_grads(params)

    @torch.no_grad()
    def prepare_step(self, params: Sequence[torch.Tensor], own_buffer: bool = False) -> None:
        """Hand the gradients to what the wrapped optimizer steps, after :meth:`collect_grads`:
        each group's flat tensor, or its views from now on when only some of its masters have
        one (Note [flat state falls back to views] in :mod:`shardopt.optim.flat_masters`); with
        ``own_buffer``, a copy the step alone reads (Note [delayed update])."""
        switched = False
        for flat_group in self.masters.groups:
            if flat_group.choose_layout():
                flat_group.to_views(self._live().state)
                switched = True
        if switched:
            self._relist(params)
        for flat_group in self.masters.groups:
            flat_group.point_step_grads(own_buffer)

    def run_step(self, step: Callable[[], Any]) -> Any:
        """Run ``step`` (the wrapped optimizer's) over what :meth:`prepare_step` handed it, then take
        the gradients back from what it stepped, and place new host state for the next (Note [host
        buffer placement] in :mod:`shardopt.host_memory`); returns what ``step`` returned."""
        try:
            out = step()
        finally:
            for flat_group in self.masters.groups:
                flat_group.end_step()
        for flat_group in self.masters.groups:
            flat_group.place_state(self._live().state)
        return out

    def run_closure_step(self, params: Sequence[torch.Tensor], closure: Callable[[], Any],
                         step: Callable[[Callable[[], Any]], Any]) -> Any:
        """:meth:`run_step` of ``step(folding)``, where ``folding`` is what the wrapped optimizer calls as its
        closure: ``closure`` (the caller's forward and backward), then :meth:`collect_grads` and
        :meth:`prepare_step`; returns what ``step`` returned."""

        def folding() -> Any:
            # Folded after the closure's backward only: folding first moved no_sync sums into
            # the masters before DDP's reduction in that backward (other ranks' were lost).
            loss = closure()
            self.collect_grads(params)
            self.prepare_step(params)
            return loss

        return self.run_step(lambda: step(folding))

    def launch(self, params: Sequence[torch.Tensor], delay: DelayedUpdate, step: Callable[[], Any]) -> None:
        """Hand ``step`` a copy of the gradients, release the masters' as a step does, and run it
        on ``delay``'s worker thread (Note [delayed update] in :mod:`shardopt.optim.delayed_update`)."""
        self.prepare_step(params, own_buffer=True)
        self.release_grads(params)
        delay.launch(lambda: self.run_step(step))

    @torch.no_grad()
    def add_grads(self, grads: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Add each ``(index, param, grad)`` (this rank's rows of ``params[index]``'s gradient; for a
        master, in its dtype or narrower) to the gradient the step reads: into its master's segment of
        the gradient buffer, those of one group together (Note [one copy per bucket] in
        :mod:`shardopt.optim.flat_masters`), else to its holder's ``.grad``."""
        by_group: dict[FlatGroup, list[tuple[int, torch.Tensor]]] = {}
        for index, param, grad in grads:
            flat_group = self.masters.group_of(index)
            if flat_group is not None:
                by_group.setdefault(flat_group, []).append((index, grad))
                continue
            holder = self.holder(index, param)
            holder.grad = grad if holder.grad is None else holder.grad.add_(grad)
        for flat_group, in_group in by_group.items():
            flat_group.add_grads(in_group)

    def release_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Drop the masters' gradients once the step has them (a mirror's goes on: Note [mirrors carry
        gradients] in shardopt.optim.masters); keep the row views' (Note [split gradients outlive the
        step] in shardopt.optim.owned_rows)."""
        self.masters.release_grads(params)
        self.owned.after_step(params)

    def free_grads(self) -> None:
        """Drop the masters' and the row views' gradients."""
        self.masters.free_grads()
        self.owned.free_grads()

    def install(self, params: Sequence[torch.Tensor], state: StateByIndex,
                global_groups: list[tuple[dict[str, Any], range]]) -> list[int]:
        """Load ``state`` (this rank's rows, by index, masters included) into the wrapped
        optimizer, the masters and the parked table; a group's flat tensor takes its members'
        entries joined, or the group is stepped as views when they do not agree (Note [flat
        state falls back to views] in shardopt.optim.flat_masters).

        Returns:
            The indices whose master restarted from the parameter (the state had none).
        """
        optim = self._live()
        saved_masters = {i: s.pop(MASTER_KEY) for i, s in state.items() if MASTER_KEY in s}
        ignored = {i for i in saved_masters if not needs_master(params[i].dtype, self.masters.dtype)}
        trainable = {i for indices in self._groups for i in indices}
        live = {i: s for i, s in state.items() if i in trainable}
        joined: dict[torch.Tensor, dict[str, Any]] = {}
        for flat_group in self.masters.groups:
            if flat_group.flat is not None:
                found = flat_group.join_states(live)
                flat_group.use(Layout.VIEWS if found is None else Layout.FLAT)
                if found:
                    joined[flat_group.flat] = found
        self._relist(params)
        position: dict[torch.Tensor, int] = {}
        for shard_group in optim.param_groups:
            position.update({t: len(position) + k for k, t in enumerate(shard_group["params"])})
        index = {self._stepped(i, params[i]): i for i in trainable}
        local_state = {n: joined[t] if t in joined else live[index[t]] for t, n in position.items()
                       if t in joined or (t in index and index[t] in live)}
        local_groups = [{**hyper(g), "params": [position[t] for t in sg["params"]]}
                        for (g, _), sg in zip(global_groups, optim.param_groups, strict=True)]
        optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        missing = self.masters.load(params, saved_masters)
        group_of = {i: g for g, indices in global_groups for i in indices}
        self.parked = {}
        for i in range(len(params)):
            if self.owned.owns(i) and i not in trainable and (i in state or i in saved_masters):
                kept = {MASTER_KEY: saved_masters[i]} if i in saved_masters and i not in ignored else {}
                self.parked[i] = state_to_param({**state.get(i, {}), **kept}, params[i], group_of[i],
                                                self.masters.offload)
        return missing
