"""Shared by the ShardedDataParallel tests: a model with optional and unused heads, and the
tolerance rule (exact where the arithmetic is)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.data import max_abs_diff


def tolerance(world_size: int) -> float:
    """Exact at 1 and 2 ranks (fp32 sums of two terms commute); 1e-6 relative beyond."""
    return 0.0 if world_size <= 2 else 1e-6


def rel_diff(a: nn.Module, b: nn.Module) -> float:
    scale = max(p.detach().abs().max().item() for p in b.parameters())
    return max_abs_diff(a.parameters(), b.parameters()) / max(scale, 1e-12)


class Branchy(nn.Module):
    """A trunk and three heads: ``a`` always used, ``b`` used when asked, ``never`` never."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 4)
        self.never = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = F.relu(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


VOCAB = 4096


class VocabModel(nn.Module):
    """A language-model shape whose head (and at 4 ranks its embedding) is larger than a
    rank's fair share, so OSS splits it: an embedding of ``VOCAB`` x 16, a hidden layer and an
    untied head of ``VOCAB`` rows; with ``aux``, a second head (then the first one can be skipped)."""

    def __init__(self, dtype: torch.dtype = torch.float32, aux: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.hidden = nn.Linear(16, 32)
        self.head = nn.Linear(32, VOCAB)
        self.aux = nn.Linear(32, VOCAB) if aux else None
        self.to(dtype)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = F.relu(self.hidden(self.embed(tokens)))
        if self.aux is None:
            return self.head(h)
        return self.aux(h) if skip_head else self.aux(h) + self.head(h)


def vocab_tokens(rank: int, step: int, batch: int = 4, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for :class:`VocabModel`, different for every (rank, step)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def vocab_loss(model: nn.Module, rank: int, step: int, skip_head: bool = False) -> torch.Tensor:
    """Cross-entropy of ``model`` (a VocabModel, wrapped or not) on rank ``rank``'s batch of ``step``."""
    x, y = vocab_tokens(rank, step)
    logits = model(x, skip_head=True) if skip_head else model(x)
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
