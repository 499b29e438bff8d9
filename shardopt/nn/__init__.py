"""Model wrappers: ``ShardedDataParallel`` (ZeRO-2) and ``FullyShardedDataParallel`` (ZeRO-3)."""

from shardopt.nn.data_parallel import ShardedDataParallel
from shardopt.nn.fsdp import BackwardPrefetch, CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardedDataParallel",
    "ShardingStrategy",
]
