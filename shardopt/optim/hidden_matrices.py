"""Split a model's parameters for the two-optimizer recipe: hidden matrices for a matrix-wise
optimizer (``torch.optim.Muon``), everything else for AdamW.

Note [which parameters Muon gets]
Muon orthogonalises each update, which suits the weight matrices of hidden layers only: its
authors and torch's documentation give the input embedding, the output layer, norms' gains
and biases to a standard optimizer such as AdamW (the KellerJordan/Muon README: "embeddings,
classifier heads, and hidden gains/biases should be optimized using standard AdamW";
``torch.optim.Muon``'s docstring). torch's own example selects ``p.ndim == 2``, which also
hands Muon the embedding table and the output head (both 2-D), and ``torch.optim.Muon``
refuses any parameter that is not 2-D. So the split here goes by module type, not by
shape: the ``weight`` of every ``nn.Linear`` (a subclass too, such as
``nn.MultiheadAttention``'s ``out_proj``) is a hidden matrix, unless its layer is named as
not hidden (the output head) or the tensor is shared with an embedding (a tied head).
Everything else - embeddings, biases, norms, a positional table held as a plain
``nn.Parameter``, convolution kernels, ``nn.MultiheadAttention``'s ``in_proj_weight`` - goes
to the other optimizer; pass such a matrix to Muon yourself if you mean it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from torch import nn

__all__ = ["HiddenMatrices", "split_hidden_matrices"]

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


class HiddenMatrices(NamedTuple):
    """A module's parameters in two disjoint lists, each in ``module.parameters()`` order."""

    matrices: list[nn.Parameter]
    """The 2-D weights of hidden ``nn.Linear`` layers: for ``torch.optim.Muon``."""
    others: list[nn.Parameter]
    """Everything else (embeddings, output layers, norms, biases, other tensors): for AdamW."""


def split_hidden_matrices(module: nn.Module, non_hidden: nn.Module | Iterable[nn.Module] | None = None
                          ) -> HiddenMatrices:
    """Split ``module``'s parameters into hidden-layer matrices and the rest (Note [which
    parameters Muon gets]).

    How it works: a parameter is a hidden matrix when it is the 2-D ``weight`` of an
    ``nn.Linear`` (or subclass) that is not inside a ``non_hidden`` module and is not also
    the weight of an ``nn.Embedding``/``nn.EmbeddingBag`` (a head tied to the embedding).
    Each parameter appears once (shared ones as ``module.parameters()`` lists them), frozen
    ones included, so the two lists together are exactly ``list(module.parameters())``.

    Args:
        module: the model.
        non_hidden: the layers whose Linear weights are not hidden: the output head (e.g.
            ``model.lm_head``), and a first Linear over raw inputs if you treat it as an
            input layer. ``None`` (default) takes ``module.get_output_embeddings()`` (a
            Hugging Face model's head) and refuses a module without one; pass ``()`` when
            the model has no output layer to exclude.

    Returns:
        ``HiddenMatrices(matrices, others)``: build ``OSS(matrices, optim=torch.optim.Muon,
        ...)`` and ``OSS(others, optim=torch.optim.AdamW, ...)`` from them.

    Raises:
        ValueError: ``non_hidden`` is ``None`` and ``module`` has no
            ``get_output_embeddings()`` head, or a ``non_hidden`` layer is not a submodule
            of ``module``.
        TypeError: ``non_hidden`` holds something that is not an ``nn.Module``.
    """
    excluded = _non_hidden_layers(module, non_hidden)
    inside = {id(sub) for layer in excluded for sub in layer.modules()}
    embedded = {id(sub.weight) for sub in module.modules() if isinstance(sub, _EMBEDDINGS)}
    hidden = {id(sub.weight) for sub in module.modules()
              if isinstance(sub, nn.Linear) and id(sub) not in inside and sub.weight.ndim == 2}
    hidden -= embedded
    hidden -= {id(p) for layer in excluded for p in layer.parameters()}  # a weight shared with a head
    params = list(module.parameters())
    return HiddenMatrices([p for p in params if id(p) in hidden], [p for p in params if id(p) not in hidden])


def _non_hidden_layers(module: nn.Module, non_hidden: nn.Module | Iterable[nn.Module] | None) -> list[nn.Module]:
    """The layers named as not hidden, checked to be ``module``'s own."""
    if non_hidden is None:
        finder = getattr(module, "get_output_embeddings", None)
        head = finder() if callable(finder) else None
        if not isinstance(head, nn.Module):
            raise ValueError(
                f"non_hidden=None needs a model with get_output_embeddings() (a Hugging Face head); "
                f"{type(module).__name__} has none: name the output layer, e.g. "
                "split_hidden_matrices(model, non_hidden=model.head), or non_hidden=() if it has none"
            )
        return [head]
    layers = [non_hidden] if isinstance(non_hidden, nn.Module) else list(non_hidden)
    bad = [x for x in layers if not isinstance(x, nn.Module)]
    if bad:
        raise TypeError(f"non_hidden must be nn.Module layers of the model, got a {type(bad[0]).__name__}; "
                        "pass the layer itself, e.g. non_hidden=model.head")
    own = {id(sub) for sub in module.modules()}
    foreign = [x for x in layers if id(x) not in own]
    if foreign:
        raise ValueError(f"non_hidden holds a {type(foreign[0]).__name__} that is not a submodule of the "
                         f"{type(module).__name__} being split: pass the model's own layer (e.g. model.head), "
                         "not a copy")
    return layers
