"""Data-parallel wrappers: ``ShardedDataParallel`` (ZeRO-2)."""

from shardopt.nn.data_parallel.sharded_ddp import ShardedDataParallel

__all__ = ["ShardedDataParallel"]
