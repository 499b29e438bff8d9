"""shardopt: ZeRO-style sharding of optimizer state, gradients and parameters for PyTorch."""

from shardopt.nn import FullyShardedDataParallel, ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler
from shardopt.partition import Partition, partition_by_size
from shardopt.param_norms import grad_norms

__version__ = "0.1.0"

__all__ = [
    "OSS",
    "FullyShardedDataParallel",
    "Partition",
    "ShardedDataParallel",
    "ShardedGradScaler",
    "__version__",
    "grad_norms",
    "partition_by_size",
]
