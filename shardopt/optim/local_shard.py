"""What one rank of OSS steps: the wrapped optimizer over its rows, their fp32 masters and row
views, and the parked state of its frozen parameters.

OSS (the global view: param groups, plan, gather, state dicts) builds one :class:`LocalShard`
per plan (Note [shard optimizer rebuild] in :mod:`shardopt.optim.oss`) and asks it for the
tensors and state of this rank's rows, keyed by index in ``OSS.params``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from shardopt import comm
from shardopt.agreement import raise_if_any_failed
from shardopt.optim.masters import MasterWeights, needs_master
from shardopt.optim.owned_rows import OwnedRows
from shardopt.optim.state_transport import Fragments, StateByIndex, state_to_param
from shardopt.partition import SplitPlan
from shardopt.state_checks import MASTER_KEY

__all__ = ["LocalShard", "group_ranges", "hyper"]


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


class LocalShard:
    """This rank's part of an OSS under one plan.

    How it works: :meth:`build` keeps masters for the trainable rows this rank owns, makes row
    views of the split ones without masters (Note [row views] in
    :mod:`shardopt.optim.owned_rows`), builds the wrapped optimizer over them in the global
    groups' order and puts carried state back (live, or parked for frozen parameters: Note
    [parked state] in :mod:`shardopt.optim.oss`).

    Args:
        plan: the ownership plan over ``OSS.params``.
        rank: this rank.
        masters: OSS's master weights (kept across plans; rebuilt here).
    """

    def __init__(self, plan: SplitPlan, rank: int, masters: MasterWeights) -> None:
        self.owned = OwnedRows(plan, rank)
        self.masters = masters
        self.parked: StateByIndex = {}
        self.optim: Optimizer | None = None

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
        self.masters.rebuild(params, trainable, {i: carried[i].pop(MASTER_KEY) for i in trainable
                                                 if MASTER_KEY in carried.get(i, {})}, self.owned.split_rows())
        self.owned.build_views(params, [i for i in trainable if self.masters.get(i) is None])
        shard_groups = [{**hyper(g), "params": [self.stepped(i, params[i]) for i in indices if i in trainable]}
                        for g, indices in groups]
        failure = None
        try:
            self.optim = optim_cls(shard_groups, **defaults)
        except (ValueError, TypeError, RuntimeError) as exc:  # it refused what this rank owns
            failure = exc
        raise_if_any_failed(f"OSS: building {optim_cls.__qualname__} over the parameters each rank owns", failure,
                            group)
        assert self.optim is not None
        self.parked = {}
        for i, state in carried.items():
            if i not in trainable:
                self.parked[i] = state
            elif state:
                self.optim.state[self.stepped(i, params[i])] = state
        return self.optim

    def stepped(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """What the wrapped optimizer steps for ``params[index]``: its master, its row view, or itself."""
        master = self.masters.get(index)
        if master is not None:
            return master
        view = self.owned.view(index)
        return param if view is None else view

    def _live(self) -> Optimizer:
        assert self.optim is not None, "LocalShard.build() was not called"
        return self.optim

    def state_by_index(self, params: Sequence[torch.Tensor]) -> StateByIndex:
        """This rank's optimizer state (live and parked, masters under ``MASTER_KEY``), by index."""
        self.masters.follow_outside_writes(params)
        index = {self.stepped(i, p): i for i, p in enumerate(params)}
        state = {index[p]: s for p, s in self._live().state.items() if p in index and s}
        for i, master in self.masters.items():
            state[i] = {**state.get(i, {}), MASTER_KEY: master}
        state.update(self.parked)
        return state

    def fragments(self, params: Sequence[torch.Tensor]) -> Fragments:
        """:meth:`state_by_index` keyed by index and the rows each entry covers."""
        return {(i, *self.owned.rows[i]): s for i, s in self.state_by_index(params).items()}

    def collect_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Fold owned ``.grad`` into the masters' and link the row views' gradients (local)."""
        self.owned.refresh(params)
        self.masters.fold_grads(params)
        self.owned.link_grads(params)

    def after_step(self, params: Sequence[torch.Tensor]) -> None:
        """Round the masters into the parameters and drop their gradients; keep the row views'
        (Note [split gradients outlive the step] in shardopt.optim.owned_rows)."""
        self.masters.write_back(params)
        self.owned.after_step(params)

    def free_grads(self) -> None:
        """Drop the masters' and the row views' gradients."""
        self.masters.free_grads()
        self.owned.free_grads()

    def install(self, params: Sequence[torch.Tensor], state: StateByIndex,
                global_groups: list[tuple[dict[str, Any], range]]) -> list[int]:
        """Load ``state`` (this rank's rows, by index, masters included) into the wrapped
        optimizer, the masters and the parked table.

        Returns:
            The indices whose master restarted from the parameter (the state had none).
        """
        optim = self._live()
        saved_masters = {i: s.pop(MASTER_KEY) for i, s in state.items() if MASTER_KEY in s}
        ignored = {i for i in saved_masters if not needs_master(params[i].dtype, self.masters.dtype)}
        position = {self.stepped(i, p): i for i, p in enumerate(params)}
        local_groups = [{**hyper(g), "params": [position[p] for p in sg["params"]]}
                        for (g, _), sg in zip(global_groups, optim.param_groups, strict=True)]
        trainable = {i for sg in local_groups for i in sg["params"]}
        optim.load_state_dict({"state": {i: s for i, s in state.items() if i in trainable}, "param_groups": local_groups})
        missing = self.masters.load(params, saved_masters)
        group_of = {i: g for g, indices in global_groups for i in indices}
        self.parked = {}
        for i in range(len(params)):
            if self.owned.owns(i) and i not in trainable and (i in state or i in saved_masters):
                kept = {MASTER_KEY: saved_masters[i]} if i in saved_masters and i not in ignored else {}
                self.parked[i] = state_to_param({**state.get(i, {}), **kept}, params[i], group_of[i])
        return missing
