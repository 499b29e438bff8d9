"""Checkpoints lose nothing and never half-load: parked state survives every path, damage
is found by checksums on every rank, a load that does not fit changes nothing, and a save
never removes what is not its own."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from shardopt import comm
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks)

Snapshot = tuple[list[torch.Tensor], dict[str, Any]]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    """Data-parallel steps, gradients summed parameter by parameter in a fixed order."""
    for step in steps:
        opt.zero_grad(set_to_none=step % 2 == 0)
        model(rank_batch(rank, step)).pow(2).mean().backward()
        for param in model.parameters():
            if param.requires_grad:
                comm.all_reduce(param.grad, None).wait()  # type: ignore[arg-type]
        opt.step()


def _adam(model: torch.nn.Module) -> OSS:
    return OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)


def _snapshot(model: torch.nn.Module, opt: OSS) -> Snapshot:
    """Every parameter and the whole (consolidated, deep-copied) optimizer state."""
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict(all_ranks=True))


def _assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys(), (a["state"].keys(), b["state"].keys())
    for index, entry in a["state"].items():
        assert entry.keys() == b["state"][index].keys(), index
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][name])), (index, name)


# ---------------------------------------------------------------------- validate before loading


def _oss_load_state_dict_errors(rank: int, world_size: int) -> list[tuple[str, bool]]:
    model = seeded_mlp()
    opt = _adam(model)
    _train(model, opt, rank, range(2))
    good = copy.deepcopy(opt.state_dict(all_ranks=True))
    wrong_shape = copy.deepcopy(good)
    wrong_shape["state"][2]["exp_avg"] = torch.zeros(3)
    wrong_shape["param_groups"][0]["lr"] = 99.0  # must not be applied either
    not_a_dict = copy.deepcopy(good)
    not_a_dict["state"][0] = torch.zeros(1)
    two_groups = copy.deepcopy(good)
    two_groups["param_groups"] = [{**good["param_groups"][0], "params": [0, 1, 2]},
                                  {**good["param_groups"][0], "params": [3, 4, 5]}]
    results = []
    for bad in (wrong_shape, not_a_dict, two_groups):
        before = copy.deepcopy(opt.state_dict(all_ranks=True))
        try:
            opt.load_state_dict(bad)
            message = "no error"
        except ValueError as exc:
            message = str(exc)
        try:
            _assert_same_state(copy.deepcopy(opt.state_dict(all_ranks=True)), before)
            unchanged = True
        except AssertionError:
            unchanged = False
        results.append((message, unchanged))
    return results


def test_oss_load_state_dict_refuses_state_that_does_not_fit_and_changes_nothing() -> None:
    for results in run_ranks(_oss_load_state_dict_errors, 2, timeout_s=60):
        (shape_message, shape_unchanged), (type_message, type_unchanged), (group_message, group_unchanged) = results
        assert ("state_dict['state'][2]['exp_avg'] has shape (3,) but parameter 2 has shape (32, 16)"
                in shape_message), shape_message
        assert "load a state dict saved from the same model" in shape_message, shape_message
        assert "state_dict['state'][0] is a Tensor, not a dict of state values" in type_message, type_message
        assert "parameter groups of sizes [3, 3]" in group_message, group_message
        assert shape_unchanged and type_unchanged and group_unchanged
