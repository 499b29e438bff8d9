"""Sharded optimizers: ``OSS`` (ZeRO-1) and the shard-aware ``ShardedGradScaler``."""

from shardopt.optim.grad_scaler import ShardedGradScaler
from shardopt.optim.oss import OSS

__all__ = ["OSS", "ShardedGradScaler"]
