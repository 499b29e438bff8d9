"""updates_elementwise: element-by-element optimizers (may be split by rows) versus the rest."""

from __future__ import annotations

import pytest
import torch

from shardopt.optim.elementwise import updates_elementwise

ELEMENTWISE = ["SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad", "Adadelta", "Rprop", "ASGD"]
MATRIX_OR_UNKNOWN = ["Muon", "Adafactor", "LBFGS", "SparseAdam"]


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_torch_elementwise_optimizers_may_be_split(name: str) -> None:
    cls = getattr(torch.optim, name)
    assert updates_elementwise(cls)
    assert updates_elementwise(cls([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.1))


FUSED_ON_CPU = ["SGD", "Adam", "AdamW", "Adagrad"]  # torch 2.13: the others take no `fused` argument


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_foreach_and_fused_forms_are_the_same_class_and_may_be_split(name: str) -> None:
    cls = getattr(torch.optim, name)
    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert updates_elementwise(cls(p, lr=0.1, foreach=True))
    assert updates_elementwise(cls(p, lr=0.1, foreach=False))
    if name in FUSED_ON_CPU:
        assert updates_elementwise(cls(p, lr=0.1, fused=True))


def test_matrix_wise_instances_keep_whole_parameters_whatever_their_flags() -> None:
    p = [torch.nn.Parameter(torch.zeros(3, 2))]
    assert not updates_elementwise(torch.optim.Muon(p, lr=0.02, nesterov=False, adjust_lr_fn="match_rms_adamw"))
    assert not updates_elementwise(torch.optim.Adafactor(p, foreach=True))
    assert not updates_elementwise(torch.optim.LBFGS(p))


@pytest.mark.parametrize("name", MATRIX_OR_UNKNOWN)
def test_matrix_wise_and_other_torch_optimizers_keep_whole_parameters(name: str) -> None:
    assert not updates_elementwise(getattr(torch.optim, name))


def test_a_subclass_is_unknown_and_keeps_whole_parameters() -> None:
    class MyAdam(torch.optim.Adam):
        pass

    assert not updates_elementwise(MyAdam)
    assert not updates_elementwise(torch.optim.Optimizer)


def test_a_non_optimizer_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.optim\.Optimizer class or instance, got Linear"):
        updates_elementwise(torch.nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got int"):
        updates_elementwise(3)  # type: ignore[arg-type]
