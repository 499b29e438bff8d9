"""Pieces shared by shardopt's tests (nothing here is a test).

- :mod:`tests.helpers.data`: seeded models, per-rank batches, comparisons, DDP's arithmetic
  done by hand in one process.
- :mod:`tests.helpers.oss`: a mixed-precision model and the DDP-order average for OSS tests.
- :mod:`tests.helpers.gpt`: the tiny GPT (blocks, tied head) of the FSDP tests.
- :mod:`tests.helpers.sdp`: the branchy model and tolerances of the ShardedDataParallel tests.
- :mod:`tests.helpers.fsdp`: whether an FSDP model shows its shards (no unit left gathered).
- :mod:`tests.helpers.processes`: the repository root and a session's live processes.
"""
