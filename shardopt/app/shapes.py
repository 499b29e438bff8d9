"""Parameter shapes of large models without building them: presets and Hugging Face configs.

``shardopt estimate`` plans ownership from shapes alone (:func:`shardopt.memory.estimate_plans`),
so an 8B-parameter model costs a list of tuples, not 16 GB. :class:`DecoderShape` describes a
Llama-style decoder (token embedding; per layer q/k/v/o projections with grouped-query
attention, a gated MLP of gate/up/down projections and two RMSNorm weights; a final norm; an
LM head unless tied), in the order Hugging Face's ``LlamaForCausalLM.named_parameters()``
lists them. :data:`SHAPE_PRESETS` names Llama-3-8B, Llama-3.2-1B and TinyLlama-1.1B; :func:`read_hf_config` reads the same
fields from a ``config.json`` (Llama, Mistral and other configs with these keys).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["SHAPE_PRESETS", "DecoderShape", "read_hf_config"]


@dataclass(frozen=True)
class DecoderShape:
    """Shapes of a Llama-style decoder-only transformer.

    Attributes:
        vocab_size: token ids (rows of the embedding and of the LM head).
        hidden_size: width of the residual stream.
        intermediate_size: hidden width of the gated MLP.
        num_layers: transformer blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention; ``num_heads`` for plain MHA).
        head_dim: width of one head (``hidden_size // num_heads`` unless the config says).
        tie_embeddings: the LM head shares the embedding's weight (no separate parameter).
        attention_bias: q/k/v/o projections have biases.
        mlp_bias: gate/up/down projections have biases.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False

    def named_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every parameter, in ``named_parameters()`` order."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab_size, h))]
        for layer in range(self.num_layers):
            pre = f"model.layers.{layer}"
            linears = [("self_attn.q_proj", q, h, self.attention_bias), ("self_attn.k_proj", kv, h, self.attention_bias),
                       ("self_attn.v_proj", kv, h, self.attention_bias), ("self_attn.o_proj", h, q, self.attention_bias),
                       ("mlp.gate_proj", i, h, self.mlp_bias), ("mlp.up_proj", i, h, self.mlp_bias),
                       ("mlp.down_proj", h, i, self.mlp_bias)]
            for name, rows, cols, bias in linears:
                out.append((f"{pre}.{name}.weight", (rows, cols)))
                if bias:
                    out.append((f"{pre}.{name}.bias", (rows,)))
            out += [(f"{pre}.input_layernorm.weight", (h,)), (f"{pre}.post_attention_layernorm.weight", (h,))]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h)))
        return out

    def shapes(self) -> list[tuple[int, ...]]:
        """Every parameter's shape, in ``named_parameters()`` order."""
        return [shape for _, shape in self.named_shapes()]


SHAPE_PRESETS: dict[str, DecoderShape] = {
    # meta-llama/Meta-Llama-3-8B config.json: 8,030,261,248 parameters
    "llama3-8b": DecoderShape(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_heads=32, num_kv_heads=8, head_dim=128, tie_embeddings=False),
    # meta-llama/Llama-3.2-1B config.json: 1,235,814,400 parameters (embedding tied to the head)
    "llama3.2-1b": DecoderShape(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64, tie_embeddings=True),
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json: 1,100,048,384 parameters, 32k vocabulary
    "tinyllama-1.1b": DecoderShape(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22,
                                   num_heads=32, num_kv_heads=4, head_dim=64, tie_embeddings=False),
}
"""Shape-only presets for ``shardopt estimate --model``."""

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_hf_config(path: str) -> DecoderShape:
    """A :class:`DecoderShape` from a Hugging Face ``config.json``.

    How it works: reads ``vocab_size``, ``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers`` and ``num_attention_heads`` (required), ``num_key_value_heads``
    (default: ``num_attention_heads``), ``head_dim`` (default ``hidden_size //
    num_attention_heads``), ``tie_word_embeddings`` (default ``True``, as
    ``transformers.PretrainedConfig``), ``attention_bias`` and ``mlp_bias`` (default
    ``False``). Only the Llama layout is modelled: a config of another architecture with
    these keys gives Llama's parameter list for its sizes.

    Args:
        path: the ``config.json`` file.

    Returns:
        The shapes.

    Raises:
        ValueError: the file cannot be read, is not a JSON object, or a required key is
            missing or not a positive integer.
    """
    try:
        with open(path, encoding="utf-8") as f:
            config: Any = json.load(f)
    except OSError as exc:
        raise ValueError(f"--hf-config {path!r}: cannot read it ({exc.strerror}); give the path of a Hugging Face "
                         "config.json") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hf-config {path!r} is not JSON ({exc.msg} at line {exc.lineno}); give a Hugging Face "
                         "config.json") from None
    if not isinstance(config, dict):
        raise ValueError(f"--hf-config {path!r} holds a JSON {type(config).__name__}, not an object; give a "
                         "Hugging Face config.json")
    missing = [key for key in _REQUIRED if key not in config]
    if missing:
        raise ValueError(f"--hf-config {path!r} lacks {', '.join(missing)}; shardopt reads Llama-style decoder "
                         f"configs, which have {', '.join(_REQUIRED)}")
    values = {key: config[key] for key in _REQUIRED}
    values["num_key_value_heads"] = config.get("num_key_value_heads", config["num_attention_heads"])
    if config.get("head_dim") is not None:
        values["head_dim"] = config["head_dim"]
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--hf-config {path!r}: {key} must be a positive integer, got {value!r}")
    heads = values["num_attention_heads"]
    head_dim = values.get("head_dim", values["hidden_size"] // heads)
    if head_dim < 1:
        raise ValueError(f"--hf-config {path!r}: hidden_size {values['hidden_size']} over num_attention_heads "
                         f"{heads} leaves heads of width 0; give head_dim or fix the sizes")
    return DecoderShape(
        vocab_size=values["vocab_size"], hidden_size=values["hidden_size"],
        intermediate_size=values["intermediate_size"], num_layers=values["num_hidden_layers"], num_heads=heads,
        num_kv_heads=values["num_key_value_heads"], head_dim=head_dim,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)),
        attention_bias=bool(config.get("attention_bias", False)), mlp_bias=bool(config.get("mlp_bias", False)))
