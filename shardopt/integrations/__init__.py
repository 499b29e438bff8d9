"""Integrations with training frameworks; each lives in its own module and imports its
framework only when that module is imported (without it, the import error names the extra
to install: ``pip install 'shardopt[hf]'`` or ``'shardopt[lightning]'``; :mod:`.extras`).

* :mod:`shardopt.integrations.lightning`: Lightning strategies ``shardopt_zero1``,
  ``shardopt_zero2`` and ``shardopt_zero3`` (registered on import).
* :mod:`shardopt.integrations.transformers`: a Hugging Face ``Trainer`` subclass training
  with OSS, ShardedDataParallel or FullyShardedDataParallel.
* :mod:`shardopt.integrations.accelerate`: ``ShardedAccelerator`` for Accelerate custom loops.
* :mod:`shardopt.integrations.checkpoints`: full or sharded trainer checkpoints, and the
  converter from a sharded folder to one file (``shardopt convert``).
* :mod:`shardopt.integrations.convert`: rebuild a plain ``torch.optim`` optimizer as
  :class:`~shardopt.optim.OSS` and rebind its LR schedulers (torch only; used by both).
"""
