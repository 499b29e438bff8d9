"""The built-in GPT and corpus: counted parameters match, batches are reproducible per
(seed, rank, step) and differ between ranks, and shape mistakes say what to do."""

from __future__ import annotations

import pytest
import torch

from shardopt.app.models import GPT, PRESETS, CharBatches, GPTConfig, build_model, stdlib_corpus


def test_presets_count_their_parameters_and_27m_is_27m() -> None:
    for name, cfg in PRESETS.items():
        with torch.device("meta"):  # shapes only: no memory, no init cost
            model = GPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_params(), name
    assert 27_000_000 <= PRESETS["27m"].num_params() < 28_000_000


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b, c = build_model("tiny", seed=0), build_model("tiny", seed=0), build_model("tiny", seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.tok.weight, c.tok.weight)
    state = torch.random.get_rng_state()
    build_model("tiny", seed=3)
    assert torch.equal(state, torch.random.get_rng_state())  # the caller's RNG is left alone


def test_forward_gives_logits_or_loss_and_rejects_long_sequences() -> None:
    model = build_model("tiny")
    tokens = torch.randint(0, 256, (2, 32))
    assert model(tokens).shape == (2, 32, 256)
    loss = model(tokens, tokens)
    assert loss.dim() == 0 and 4.0 < loss.item() < 7.0  # ~ln(256) = 5.5 at initialisation
    with pytest.raises(ValueError, match="tokens have length 33 but the model has seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_config_and_preset_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="dim=30 must be divisible by num_heads=4"):
        GPTConfig(dim=30, num_heads=4)
    with pytest.raises(ValueError, match="GPTConfig.num_layers must be a positive int, got 0"):
        GPTConfig(num_layers=0)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        build_model("huge")


def test_corpus_is_python_source_read_deterministically() -> None:
    a, b = stdlib_corpus(2**16), stdlib_corpus(2**16)
    assert a.dtype == torch.uint8 and a.numel() == 2**16 and torch.equal(a, b)
    text = bytes(a.tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    with pytest.raises(ValueError, match="max_bytes must be >= 2"):
        stdlib_corpus(1)


def test_batches_repeat_per_seed_rank_step_and_differ_across_ranks() -> None:
    corpus = stdlib_corpus(2**16)
    r0, r0_again, r1 = (CharBatches(corpus, 4, 16, rank, world_size=2) for rank in (0, 0, 1))
    x, y = r0.batch(step=5)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    assert torch.equal(x, r0_again.batch(step=5)[0])
    assert not torch.equal(x, r1.batch(step=5)[0])
    assert not torch.equal(x, r0.batch(step=6)[0])
    assert not torch.equal(x, r0.batch(step=5, micro=1)[0])
    assert not torch.equal(x, CharBatches(corpus, 4, 16, 0, seed=1, world_size=2).batch(step=5)[0])
    with pytest.raises(ValueError, match="fewer than seq_len \\+ 2"):
        CharBatches(corpus[:10], 1, 16, 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2; pass the data-parallel"):
        CharBatches(corpus, 4, 16, 2, world_size=2)


def test_a_step_trains_on_the_same_samples_at_any_world_size_with_the_same_global_batch() -> None:
    corpus = stdlib_corpus(2**16)

    def step_samples(world: int, batch: int, accum: int, step: int = 7) -> torch.Tensor:
        parts = [CharBatches(corpus, batch, 16, r, seed=3, world_size=world).batch(step, m)[0]
                 for m in range(accum) for r in range(world)]
        return torch.cat(parts)

    eight = step_samples(2, 4, 1)  # 2 ranks x 4 sequences
    assert eight.shape == (8, 16) and len({tuple(row.tolist()) for row in eight}) == 8
    for world, batch, accum in ((1, 8, 1), (4, 2, 1), (8, 1, 1), (2, 2, 2), (1, 4, 2)):
        assert torch.equal(step_samples(world, batch, accum), eight), (world, batch, accum)
    assert not torch.equal(step_samples(2, 4, 1, step=8), eight)
