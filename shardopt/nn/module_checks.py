"""Checks on a module that both wrappers run at construction, refused with an error naming the fix.

ShardedDataParallel (ZeRO-2) and FullyShardedDataParallel (ZeRO-3) call these on the module
they wrap; the module sits under :mod:`shardopt.nn` so that neither wrapper's package imports
the other's. Each check sees the same program on every rank, so every rank raises the same
error at the same point instead of one rank leaving a collective the others wait in.
"""

from __future__ import annotations

from torch import nn

__all__ = ["refuse_sparse_modules"]


def refuse_sparse_modules(module: nn.Module, wrapper: str) -> None:
    """Refuse embeddings that produce sparse gradients for trainable parameters (neither
    ShardedDataParallel's buckets nor a FullyShardedDataParallel unit's flat gradient can
    hold them).

    Args:
        module: the module being wrapped.
        wrapper: the wrapper's class name, for the message.

    Raises:
        TypeError: a trainable ``nn.Embedding`` / ``nn.EmbeddingBag`` has ``sparse=True``.
    """
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and sub.weight.requires_grad:
            raise TypeError(
                f"module {name or type(sub).__name__!r} ({type(sub).__name__}) has sparse=True: "
                f"{wrapper} reduces dense gradients only; build it with sparse=False "
                "(and a dense optimizer such as torch.optim.Adam instead of SparseAdam)"
            )
