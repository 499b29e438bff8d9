"""Model wrappers: ``ShardedDataParallel`` (ZeRO-2) and ``FullyShardedDataParallel`` (ZeRO-3)."""

from shardopt.nn.data_parallel import ShardedDataParallel
from shardopt.nn.fsdp import BackwardPrefetch, FullyShardedDataParallel, MixedPrecision, ShardingStrategy

__all__ = [
    "BackwardPrefetch",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardedDataParallel",
    "ShardingStrategy",
]
