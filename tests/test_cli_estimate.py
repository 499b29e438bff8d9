"""``shardopt estimate`` against the real ownership plans: the Llama-3-8B preset, shapes read from
a Hugging Face config.json (checked against transformers' own model on meta), the plan table and
JSON, the plot, and one-line errors for bad configs and a missing matplotlib."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from shardopt.app.cli import main
from shardopt.app.shapes import SHAPE_PRESETS, DecoderShape, read_hf_config
from tests.helpers.cli import assert_one_line_errors

LLAMA_STYLE = {  # a small Llama-style config.json with grouped-query attention and an untied head
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 176, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
}


def _write(tmp_path: Path, config: Any, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def _json(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def test_llama3_8b_preset_has_8_03b_parameters_with_untied_525m_embedding_and_head() -> None:
    shape = SHAPE_PRESETS["llama3-8b"]
    named = dict(shape.named_shapes())
    assert sum(math.prod(s) for s in shape.shapes()) == 8_030_261_248
    assert named["model.embed_tokens.weight"] == named["lm_head.weight"] == (128256, 4096)
    assert named["model.layers.0.self_attn.k_proj.weight"] == (1024, 4096)
    assert named["model.layers.31.mlp.down_proj.weight"] == (4096, 14336)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize("extra", [{}, {"tie_word_embeddings": True, "attention_bias": True, "head_dim": 16}])
def test_hf_config_shapes_match_transformers_llama_built_on_meta(tmp_path: Path, extra: dict[str, Any]) -> None:
    import transformers

    config = {**LLAMA_STYLE, **extra}
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    expected = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert read_hf_config(_write(tmp_path, config)).named_shapes() == expected


def test_hf_config_defaults_follow_transformers() -> None:
    shape = DecoderShape(vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=2, head_dim=4, tie_embeddings=True)
    assert [name for name, _ in shape.named_shapes()][-1] == "model.norm.weight"  # tied: no lm_head


def test_estimate_llama3_8b_reports_the_heaviest_rank_of_the_real_plans(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--model", "llama3-8b", "--world-size", "64", "--json", str(out)]) == 0
    data = _json(out)
    plan = data["plan"]
    assert data["num_params"] == 8_030_261_248 and data["largest_layer_params"] == 128256 * 4096
    # the whole-parameter plan (a matrix-wise optimizer's) holds an untied 525M embedding on one rank: 23.4 GB with ZeRO-2,
    # where the formula promises 17.8 GB (2 + 14/64 bytes per parameter); the row-split plan reaches it
    assert round(plan["unsplit_imbalance"], 2) == 4.19 and plan["split_imbalance"] <= 1.05
    assert round(plan["stage2_unsplit_bytes"] / 1e9, 1) == 23.4 and round(data["stage2_bytes"] / 1e9, 1) == 17.8
    assert round(plan["stage2_split_bytes"] / 1e9, 1) == 17.8 and plan["split_param_count"] == 2
    printed = capsys.readouterr().out
    for text in ("heaviest rank under shardopt's ownership plans", "whole parameters (matrix-wise", "4.187x",
                 "23.4", "row-split (OSS default"):
        assert text in printed, text
    caption = " ".join(printed.split())  # rich wraps it
    assert "what OSS (and ShardedDataParallel with it) plans by default for an optimizer that updates elementwise" \
        in caption, caption
    assert "issue" not in caption and "yet" not in caption, caption  # no stale "not used yet" or internal issue number


def test_estimate_hf_config_plans_the_config_shapes(tmp_path: Path) -> None:
    out = tmp_path / "est.json"
    config = _write(tmp_path, LLAMA_STYLE)
    assert main(["estimate", "--hf-config", config, "--world-size", "8", "--fp32", "--json", str(out)]) == 0
    data = _json(out)
    assert data["num_params"] == sum(math.prod(s) for s in read_hf_config(config).shapes())
    assert data["plan"]["split_imbalance"] <= data["plan"]["unsplit_imbalance"]
    assert data["plan"]["stage1_split_bytes"] == data["plan"]["stage1_split_at_step_bytes"]  # fp32: no masters


def test_estimate_of_a_bare_count_has_no_plan(tmp_path: Path) -> None:
    out = tmp_path / "est.json"
    assert main(["estimate", "--params", "1e9", "--world-size", "8", "--json", str(out)]) == 0
    assert _json(out)["plan"] is None


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
@pytest.mark.parametrize("what", [["--model", "llama3-8b"], ["--params", "7.5e9"]])
def test_estimate_plot_writes_a_png(tmp_path: Path, what: list[str]) -> None:
    png = tmp_path / "sub" / "memory.png"
    assert main(["estimate", *what, "--world-size", "64", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_bad_estimate_inputs_end_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.json")
    no_layers = {k: v for k, v in LLAMA_STYLE.items() if k != "num_hidden_layers"}
    cases = [
        (["estimate", "--hf-config", missing, "--world-size", "2"], f"--hf-config {missing!r}: cannot read it"),
        (["estimate", "--hf-config", _write(tmp_path, "[1, 2]", "text.json"), "--world-size", "2"],
         "holds a JSON str, not an object"),
        (["estimate", "--hf-config", _write(tmp_path, [1], "list.json"), "--world-size", "2"],
         "holds a JSON list, not an object"),
        (["estimate", "--hf-config", _write(tmp_path, no_layers, "nolayers.json"), "--world-size", "2"],
         "lacks num_hidden_layers; shardopt reads Llama-style decoder configs"),
        (["estimate", "--hf-config", _write(tmp_path, {**LLAMA_STYLE, "hidden_size": "64"}, "str.json"),
          "--world-size", "2"], "hidden_size must be a positive integer, got '64'"),
        (["estimate", "--hf-config", _write(tmp_path, {**LLAMA_STYLE, "num_key_value_heads": True}, "b.json"),
          "--world-size", "2"], "num_key_value_heads must be a positive integer, got True"),
        (["estimate", "--hf-config", _write(tmp_path, {**LLAMA_STYLE, "num_attention_heads": 128}, "h.json"),
          "--world-size", "2"], "hidden_size 64 over num_attention_heads 128 leaves heads of width 0"),
        (["estimate", "--model", "llama3-8b", "--hf-config", missing, "--world-size", "2"],
         "argument --hf-config: not allowed with argument --model"),
        (["estimate", "--model", "nomodule", "--world-size", "2"], "llama3-8b"),
    ]
    (tmp_path / "bad.json").write_text("{not json")
    cases.append((["estimate", "--hf-config", str(tmp_path / "bad.json"), "--world-size", "2"],
                  "is not JSON (Expecting property name enclosed in double quotes at line 1)"))
    assert_one_line_errors(cases, capsys)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now fails
    assert_one_line_errors([(["estimate", "--model", "llama3-8b", "--world-size", "2", "--plot", "x.png"],
                             "--plot needs matplotlib, which is not installed; pip install matplotlib")], capsys)
