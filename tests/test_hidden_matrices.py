"""split_hidden_matrices: hidden Linear weights for Muon, everything else for AdamW."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardopt.optim import split_hidden_matrices
from tests.helpers.gpt import gpt


def _names(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    ids = {id(p) for p in params}
    return [n for n, p in model.named_parameters() if id(p) in ids]


def test_untied_gpt_gives_muon_the_block_linear_weights_and_adamw_the_rest() -> None:
    model = gpt(tied=False)
    matrices, others = split_hidden_matrices(model, non_hidden=model.head)
    assert _names(model, matrices) == [f"blocks.{b}.{layer}.weight" for b in range(2)
                                       for layer in ("qkv", "proj", "mlp.0", "mlp.2")]
    named_others = _names(model, others)
    assert {"embed.weight", "pos", "head.weight", "ln_f.weight", "ln_f.bias", "blocks.0.qkv.bias",
            "blocks.1.ln2.weight"} <= set(named_others)
    assert sorted(map(id, matrices + others)) == sorted(map(id, model.parameters()))  # each once, none lost
    assert all(p.ndim == 2 for p in matrices)
    torch.optim.Muon(matrices)  # torch's Muon accepts every one of them


def test_a_head_tied_to_the_embedding_stays_with_adamw_once() -> None:
    model = gpt(tied=True)
    matrices, others = split_hidden_matrices(model, non_hidden=())
    assert "head.weight" not in _names(model, matrices) and len(matrices) == 8
    assert sum(p is model.embed.weight for p in others) == 1
    assert len(matrices) + len(others) == len(list(model.parameters()))


def test_a_hugging_face_style_head_is_found_by_get_output_embeddings() -> None:
    class WithHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = nn.Linear(4, 4)
            self.lm_head = nn.Linear(4, 9, bias=False)

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

    model = WithHead()
    matrices, others = split_hidden_matrices(model)
    assert matrices == [model.hidden.weight]
    assert others == [model.hidden.bias, model.lm_head.weight]


def test_other_matrices_go_to_adamw_by_module_type() -> None:
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(4, 2), "conv": nn.Conv1d(2, 2, 3), "out": nn.Linear(4, 2)})
    matrices, _ = split_hidden_matrices(model, non_hidden=model["out"])
    assert _names(model, matrices) == ["attn.out_proj.weight"]  # in_proj_weight is a plain Parameter


def test_no_head_to_find_is_an_error_naming_non_hidden() -> None:
    with pytest.raises(ValueError, match=r"Sequential has none: name the output layer, e\.g\. "
                                         r"split_hidden_matrices\(model, non_hidden=model\.head\)"):
        split_hidden_matrices(nn.Sequential(nn.Linear(2, 2)))


def test_a_layer_of_another_model_or_a_non_module_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="non_hidden holds a Linear that is not a submodule of the Sequential"):
        split_hidden_matrices(model, non_hidden=nn.Linear(2, 2))
    with pytest.raises(TypeError, match="non_hidden must be nn.Module layers of the model, got a Parameter"):
        split_hidden_matrices(model, non_hidden=[model[1].weight])  # type: ignore[list-item]
