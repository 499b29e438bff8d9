"""ZeRO stage 3: ``FullyShardedDataParallel`` on flat-parameter units, with its policies."""

from shardopt.nn.fsdp.fully_sharded import FullyShardedDataParallel
from shardopt.nn.fsdp.options import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from shardopt.nn.fsdp.wrap import ModuleClassPolicy, NameGlobPolicy, SizePolicy

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ModuleClassPolicy",
    "NameGlobPolicy",
    "ShardingStrategy",
    "SizePolicy",
]
