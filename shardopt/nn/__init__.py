"""Model wrappers: ``ShardedDataParallel`` (ZeRO-2)."""

from shardopt.nn.data_parallel import ShardedDataParallel

__all__ = ["ShardedDataParallel"]
