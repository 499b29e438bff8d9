"""Factory models for ``shardopt rehearse --model package.module:factory`` tests."""

from __future__ import annotations

from torch import nn


def embedding_only() -> nn.Module:
    """A model with a vocabulary but no repeated blocks (nothing to checkpoint)."""
    return nn.Embedding(16, 4)


def not_a_module() -> int:
    """A factory that returns something other than a module."""
    return 3
