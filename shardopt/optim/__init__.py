"""Sharded optimizers: ``OSS`` (ZeRO-1) and the shard-aware ``ShardedGradScaler``; a split of a
model's parameters for the Muon + AdamW recipe (``split_hidden_matrices``)."""

from shardopt.optim.grad_scaler import ShardedGradScaler
from shardopt.optim.hidden_matrices import HiddenMatrices, split_hidden_matrices
from shardopt.optim.oss import OSS

__all__ = ["OSS", "HiddenMatrices", "ShardedGradScaler", "split_hidden_matrices"]
