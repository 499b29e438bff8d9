"""Tiny GPT-like models and helpers shared by the FSDP tests."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm block: causal-free self-attention stand-in (qkv + mixing) and an MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(att @ v)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Embedding, blocks, final norm and an output head tied to the embedding."""

    def __init__(self, vocab: int = 37, dim: int = 12, depth: int = 2, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(8, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt(seed: int = 0, **kwargs: int | bool) -> TinyGPT:
    """A TinyGPT identical for a given seed."""
    torch.manual_seed(seed)
    return TinyGPT(**kwargs)  # type: ignore[arg-type]


def tokens(rank: int, step: int, batch: int = 3, seq: int = 6, vocab: int = 37) -> torch.Tensor:
    """Different token batches for every (rank, step), the same on every run."""
    gen = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def lm_loss(logits: torch.Tensor, toks: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), toks[:, 1:].reshape(-1))


class SkippingGPT(TinyGPT):
    """TinyGPT whose forward can leave blocks out (a data-dependent execution order)."""

    skip: tuple[int, ...] = ()

    def forward(self, toks: torch.Tensor) -> torch.Tensor:
        x = self.embed(toks) + self.pos[: toks.shape[1]]
        for i, block in enumerate(self.blocks):
            if i not in self.skip:
                x = block(x)
        return self.head(self.ln_f(x))
