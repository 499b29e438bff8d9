"""A Llama-style decoder built from a :class:`~shardopt.app.shapes.DecoderShape`, for ``estimate --measure``.

:class:`Decoder` has exactly the parameters :meth:`DecoderShape.named_shapes` lists, under the
same names and in the same order (Hugging Face's ``LlamaForCausalLM`` layout): a token
embedding; per layer q/k/v/o projections with grouped-query attention, a gated MLP and two
RMSNorm weights; a final norm; an LM head unless tied. Its forward pass is a plain causal
decoder (no rotary embedding: nothing here is trained for quality, only for the bytes each
rank holds). :func:`scaled` shrinks a shape by a factor in every width and in the vocabulary,
keeping the layer count, so every matrix keeps its share of the model.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from shardopt.app.shapes import DecoderShape

__all__ = ["Decoder", "DecoderLayer", "decoder_loss", "scaled"]


def scaled(shape: DecoderShape, factor: int) -> DecoderShape:
    """``shape`` with the vocabulary, hidden and MLP widths and the head width divided by ``factor``.

    Every matrix then has ``1/factor**2`` of its elements (norm weights ``1/factor``), so the
    embedding's and the head's share of the model is unchanged; rows shrink by ``factor``.

    Args:
        shape: the full-size shape.
        factor: the divisor (>= 1).

    Returns:
        The scaled shape.

    Raises:
        ValueError: ``factor`` < 1, or it leaves a width or the vocabulary below 1.
    """
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(f"the scale factor must be a positive int, got {factor!r}; e.g. 16 divides every width by 16")
    sizes = {"vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
             "intermediate_size": shape.intermediate_size, "head_dim": shape.head_dim}
    small = {key: value // factor for key, value in sizes.items()}
    zero = [key for key, value in small.items() if value < 1]
    if zero:
        raise ValueError(f"--measure-scale {factor} leaves {zero[0]} {sizes[zero[0]]} // {factor} = 0; give a scale "
                         f"of at most {min(sizes.values())}")
    return replace(shape, vocab_size=small["vocab_size"], hidden_size=small["hidden_size"],
                   intermediate_size=small["intermediate_size"], head_dim=small["head_dim"])


class _Attention(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_proj = nn.Linear(h, q, bias=shape.attention_bias)
        self.k_proj = nn.Linear(h, kv, bias=shape.attention_bias)
        self.v_proj = nn.Linear(h, kv, bias=shape.attention_bias)
        self.o_proj = nn.Linear(q, h, bias=shape.attention_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        h, i = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=shape.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=shape.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One transformer block (the ZeRO-3 unit of ``estimate --measure``)."""

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.self_attn = _Attention(shape)
        self.mlp = _MLP(shape)
        self.input_layernorm = nn.RMSNorm(shape.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(shape.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = nn.RMSNorm(shape.hidden_size)


class Decoder(nn.Module):
    """A causal decoder with the parameters of ``shape`` (names and order as :meth:`DecoderShape.named_shapes`).

    Args:
        shape: the sizes.
    """

    def __init__(self, shape: DecoderShape) -> None:
        super().__init__()
        if shape.num_heads % shape.num_kv_heads:
            raise ValueError(f"num_heads {shape.num_heads} is not a multiple of num_kv_heads {shape.num_kv_heads}; "
                             "grouped-query attention shares each key/value head among a whole number of heads")
        self.shape = shape
        self.model = _Body(shape)
        self.lm_head = None if shape.tie_embeddings else nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for each position of ``tokens`` (batch x time ids)."""
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x)
        x = self.model.norm(x)
        return self.lm_head(x) if self.lm_head is not None else x @ self.model.embed_tokens.weight.t()


def decoder_loss(model: nn.Module, vocab_size: int, tokens: int = 16) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` (a wrapped :class:`Decoder`) on ``tokens`` fixed random ids.

    Args:
        model: what to call (the wrapper).
        vocab_size: the ids' range.
        tokens: the sequence length (one sequence).

    Returns:
        The scalar loss in fp32.
    """
    ids = torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, vocab_size), ids[:, 1:].reshape(-1))
