"""Sharded optimizers: ``OSS`` (ZeRO-1)."""

from shardopt.optim.oss import OSS

__all__ = ["OSS"]
