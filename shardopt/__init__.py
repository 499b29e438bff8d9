"""shardopt: ZeRO-style sharding of optimizer state, gradients and parameters for PyTorch."""

from shardopt.optim import OSS
from shardopt.partition import Partition, partition_by_size

__version__ = "0.1.0"

__all__ = ["OSS", "Partition", "partition_by_size", "__version__"]
