"""ShardedTrainer at ZeRO-3 with a GPT-2 built on the meta device: no rank ever holds the
full parameters (peak resident memory gained from before the model is built to the first
step stays below the model's size), the weights come from the model's own initialiser
(GPT-2's Conv1D has no ``reset_parameters``), and it trains (Note [HF ZeRO-3 from the meta
device] in shardopt.integrations.transformers)."""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402

from shardopt.integrations.transformers import ShardedTrainer, Sharding, init_from_model_weights  # noqa: E402
from shardopt.nn.fsdp import ModuleClassPolicy  # noqa: E402
from shardopt.testing import run_ranks  # noqa: E402
from tests.helpers.processes import call_in_fresh_interpreter  # noqa: E402
from tests.test_integration_lightning_meta import _fixed_mmap_threshold, _peak_rss_bytes, _reset_peak  # noqa: E402
from tests.test_integration_transformers import _args, _env, _Tokens  # noqa: E402

pytestmark = pytest.mark.distributed

LAYERS, WIDTH, VOCAB = 8, 512, 64
INIT_STD = 0.02


def _config() -> GPT2Config:
    return GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=8, vocab_size=VOCAB, n_positions=16,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=INIT_STD)


FULL_BYTES = 4 * sum(p.numel() for p in GPT2LMHeadModel(_config()).parameters())


class _Probe(TrainerCallback):
    def __init__(self) -> None:
        self.peak_at_first_step = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 0:
            self.peak_at_first_step = _peak_rss_bytes()


class _OneRow(_Tokens):
    """One token row, repeated: a model that trains lowers its loss step after step."""

    def __init__(self) -> None:
        super().__init__()
        self.ids[:] = self.ids[0]


def _warm_up(tmp: str) -> None:
    """Build a ShardedTrainer once so the memory the Trainer itself allocates the first time
    (Accelerate's state, lazy imports: ~0.3x this model) is resident before measuring."""
    tiny = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=VOCAB, n_positions=16))
    ShardedTrainer(model=tiny, args=_args(tmp), train_dataset=_OneRow(), sharding=Sharding(stage=3))


def _train(rank: int, world_size: int, tmp: str, on_meta: bool) -> dict[str, Any]:
    _env(rank, world_size)
    _warm_up(tmp)
    _fixed_mmap_threshold()
    _reset_peak()
    before = _peak_rss_bytes()
    torch.manual_seed(0)
    with torch.device("meta") if on_meta else torch.device("cpu"):
        model = GPT2LMHeadModel(_config())
    meta = all(p.is_meta for p in model.parameters())
    probe = _Probe()
    sharding = Sharding(stage=3, wrapper_kwargs={"auto_wrap_policy": ModuleClassPolicy((GPT2Block,))})
    trainer = ShardedTrainer(model=model, args=_args(tmp, max_steps=3, learning_rate=1e-4, warmup_steps=0),
                             train_dataset=_OneRow(), sharding=sharding, callbacks=[probe])
    trainer.train()
    h = model.transformer.h
    return {
        "meta": meta, "gained": probe.peak_at_first_step - before,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "c_attn_std": torch.cat([b.attn.c_attn.weight.flatten() for b in h]).std().item(),
        "c_proj_std": torch.cat([b.attn.c_proj.weight.flatten() for b in h]).std().item(),
        "ln_mean": torch.cat([b.ln_1.weight for b in h]).mean().item(),
        "tied": model.lm_head.weight is model.transformer.wte.weight,
    }


def _both(tmp: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return run_ranks(_train, 2, tmp, True, timeout_s=400), run_ranks(_train, 2, tmp, False, timeout_s=400)


def test_meta_gpt2_at_zero3_never_holds_the_full_model_and_trains_from_its_own_init() -> None:
    # Ranks forked from a fresh interpreter: this test process's freed heap would hide part of what
    # a rank allocates (call_in_fresh_interpreter; in the suite the full build gained 0.95x, not 1.16x).
    with tempfile.TemporaryDirectory() as tmp:
        on_meta, in_full = call_in_fresh_interpreter("tests.test_integration_transformers_meta:_both", tmp)
    scaled = INIT_STD / math.sqrt(2 * LAYERS)  # GPT-2's residual c_proj init (its _init_weights)
    for meta, full in zip(on_meta, in_full, strict=True):
        assert meta["meta"] and not full["meta"], (meta, full)
        # Built eagerly a rank gains the model and its shard while the units are flattened
        # (measured 1.16x); on meta its shard (0.5x), one GPT2Block in full and its flat copy
        # while that block is wrapped (2/8 of the blocks) (measured 0.74x).
        assert full["gained"] > FULL_BYTES, (full["gained"] / FULL_BYTES, full)
        assert meta["gained"] < 0.85 * FULL_BYTES, (meta["gained"] / FULL_BYTES, meta)
        for run in (meta, full):
            assert run["finite"] and run["tied"], run
            assert len(run["losses"]) == 3 and all(math.isfinite(x) for x in run["losses"]), run
            assert run["losses"][-1] < run["losses"][0] - 0.1, run  # it trains
            # 3 AdamW steps at lr 1e-4 move a weight by at most 3e-4: the init's spread stays
            # (the sample std of ~3M draws is within 1% of its own; 10% bounds the steps).
            assert run["c_attn_std"] == pytest.approx(INIT_STD, rel=0.1), run
            assert run["c_proj_std"] == pytest.approx(scaled, rel=0.1), run
            assert run["ln_mean"] == pytest.approx(1.0, abs=1e-3), run


def test_init_from_model_weights_refuses_a_model_without_an_initialiser() -> None:
    with pytest.raises(TypeError, match="has no _init_weights"):
        init_from_model_weights(nn.Linear(2, 2), "cpu")
