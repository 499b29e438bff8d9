"""A built-in GPT-style language model and a built-in corpus, for the demo, the benchmark and tests.

Nothing here needs a download. :class:`GPT` is a plain pre-LN decoder-only transformer
(token embedding, learned positions, ``num_layers`` blocks of causal self-attention and an
MLP, a final LayerNorm and an untied LM head) configured by a frozen :class:`GPTConfig`;
:data:`PRESETS` names a tiny one for tests, a small one for the demo and a ~27M-parameter
one for the benchmark. :func:`stdlib_corpus` reads the Python standard library's own
``.py`` files (every Python installation has them) in sorted order as bytes, and
:class:`CharBatches` samples fixed-length windows from it with a generator seeded by
``(seed, rank, step)``: the same batches on every run, different batches on every rank.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "PRESETS", "CharBatches", "GPTConfig", "build_model", "stdlib_corpus"]

VOCAB_BYTES = 256
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids (256 for byte-level text).
        seq_len: the longest sequence (number of learned positions).
        dim: width of the residual stream.
        num_layers: number of transformer blocks.
        num_heads: attention heads; must divide ``dim``.
        mlp_ratio: hidden width of the MLP as a multiple of ``dim``.
    """

    vocab_size: int = VOCAB_BYTES
    seq_len: int = 128
    dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "dim", "num_layers", "num_heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.num_heads:
            raise ValueError(
                f"GPTConfig.dim={self.dim} must be divisible by num_heads={self.num_heads}; "
                "pick a head count that divides the width"
            )

    def num_params(self) -> int:
        """The parameter count of a model with this shape, without building it."""
        d, h = self.dim, self.mlp_ratio * self.dim
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        return self.vocab_size * d + self.seq_len * d + self.num_layers * block + 2 * d + d * self.vocab_size


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=32, dim=32, num_layers=2, num_heads=2),
    "small": GPTConfig(seq_len=128, dim=128, num_layers=4, num_heads=4),
    "27m": GPTConfig(seq_len=128, dim=528, num_layers=8, num_heads=8),
    # GPT-2 medium's shape (without its 50k-token vocabulary): for a GPU.
    "300m": GPTConfig(seq_len=512, dim=1024, num_layers=24, num_heads=16),
}


class _Block(nn.Module):
    """Pre-LN block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
        shape = (batch, seq, self.num_heads, dim // self.num_heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer language model over byte tokens.

    How it works: token and learned position embeddings are summed, passed through
    ``num_layers`` pre-LN blocks (causal attention via ``scaled_dot_product_attention``,
    then a GELU MLP), a final LayerNorm and an untied linear head. Weights are initialised
    GPT-2 style (normal, std 0.02; residual projections scaled by ``1/sqrt(2 * layers)``).

    Args:
        cfg: the model's shape.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        residual_std = 0.02 / math.sqrt(2 * cfg.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() >= 2:
                nn.init.normal_(param, std=residual_std if name.endswith(("proj.weight", "out.weight")) else 0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of shape ``(batch, seq, vocab)``, or the mean cross-entropy when ``targets`` is given.

        Args:
            tokens: int64 token ids of shape ``(batch, seq)`` with ``seq <= cfg.seq_len``.
            targets: optional next-token ids of the same shape.

        Returns:
            The logits, or the scalar loss.

        Raises:
            ValueError: the sequence is longer than the model's ``seq_len``.
        """
        seq = tokens.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(f"tokens have length {seq} but the model has seq_len={self.cfg.seq_len}; "
                             "cut the batch or build a model with a longer seq_len")
        x = self.tok(tokens) + self.pos(torch.arange(seq, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_model(preset: str | GPTConfig, seed: int = 0, device: torch.device | str = "cpu") -> GPT:
    """A :class:`GPT` with weights fixed by ``seed`` (identical on every rank and run).

    Args:
        preset: a name in :data:`PRESETS` or a :class:`GPTConfig`.
        seed: the initialisation seed.
        device: where to put the model.

    Returns:
        The model.

    Raises:
        ValueError: unknown preset name.
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
        preset = PRESETS[preset]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(preset)
    return model.to(device)


def stdlib_corpus(max_bytes: int = 4 * 2**20) -> torch.Tensor:
    """The first ``max_bytes`` bytes of the Python standard library's ``.py`` files, as uint8.

    How it works: walks ``sysconfig.get_paths()["stdlib"]`` with directories and files in
    sorted order, skipping installed third-party packages (``site-packages``,
    ``dist-packages``), and concatenates file contents until ``max_bytes`` is reached. The
    result depends only on the Python installation, so every rank reads the same text.

    Args:
        max_bytes: the most bytes to read (the corpus is cut there).

    Returns:
        A 1-D uint8 tensor of byte tokens.

    Raises:
        ValueError: ``max_bytes`` is below 2 or the standard library has no sources
            (e.g. a frozen, zip-only installation).
    """
    if max_bytes < 2:
        raise ValueError(f"max_bytes must be >= 2, got {max_bytes}")
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py") or total >= max_bytes:
                continue
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read(max_bytes - total)
            chunks.append(data)
            total += len(data)
        if total >= max_bytes:
            break
    if total < 2:
        raise ValueError(f"found no Python sources under {root!r}; this installation ships no stdlib .py files")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class CharBatches:
    """Random fixed-length windows of a byte corpus: the samples of a step depend on the seed and
    the step alone, and each rank takes its slice of them.

    How it works: the samples of optimizer step ``s`` are numbered ``0 .. G-1`` (G =
    ``batch_size * world_size * micro-batches``, the global batch); sample ``j`` is the window
    starting at a position given by a hash of ``(seed, s, j)`` (BLAKE2b). Rank
    ``r`` takes, for micro-batch ``m``, samples ``(m * world_size + r) * batch_size`` onwards.
    So a step trains on the same G samples at any world size that keeps G (Note [the same run
    at another world size] in :mod:`shardopt.app.runner`), and a resumed run draws what the
    uninterrupted one would have.

    Args:
        corpus: 1-D uint8 tokens (e.g. from :func:`stdlib_corpus`).
        batch_size: sequences per batch (per rank and micro-batch).
        seq_len: tokens per sequence.
        rank: this process's data-parallel rank (ranks see different windows).
        seed: the sampling seed shared by all ranks.
        world_size: data-parallel ranks.

    Raises:
        ValueError: the corpus is shorter than one window plus its target, or ``rank`` is
            not in ``[0, world_size)``.
    """

    def __init__(self, corpus: torch.Tensor, batch_size: int, seq_len: int, rank: int, seed: int = 0,
                 world_size: int = 1) -> None:
        if corpus.numel() < seq_len + 2:
            raise ValueError(f"corpus has {corpus.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}; pass the data-parallel "
                             "world size")
        self.corpus = corpus
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.seed = seed
        self.world_size = world_size

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets for ``step`` (and micro-batch ``micro``), int64.

        Args:
            step: the optimizer step.
            micro: the micro-batch index within the step (gradient accumulation).

        Returns:
            ``(tokens, targets)``, each ``(batch_size, seq_len)``.
        """
        first = (micro * self.world_size + self.rank) * self.batch_size
        high = self.corpus.numel() - self.seq_len - 1
        starts = [_sample_start(self.seed, step, j, high) for j in range(first, first + self.batch_size)]
        window = torch.stack([self.corpus[s: s + self.seq_len + 1] for s in starts]).long()
        return window[:, :-1], window[:, 1:]


def _sample_start(seed: int, step: int, sample: int, high: int) -> int:
    """Where sample ``sample`` of ``step`` starts, in ``[0, high)``: a pure function of its arguments."""
    digest = hashlib.blake2b(f"{seed}/{step}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % high  # a bias below high / 2**64 (< 1e-12 here)
