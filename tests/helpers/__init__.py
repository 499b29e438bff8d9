"""Pieces shared by shardopt's tests (nothing here is a test).

- :mod:`tests.helpers.data`: seeded models, per-rank batches, comparisons.
- :mod:`tests.helpers.ddp_arithmetic`: DDP's arithmetic done by hand in one process (the
  references of the parity tests).
- :mod:`tests.helpers.oss`: a mixed-precision model and its loss for OSS tests.
- :mod:`tests.helpers.masters`: a bf16 model and the fp32-master reference of ZeRO-1/2.
- :mod:`tests.helpers.cli`: the tiny-model arguments and the one-line-error check of the CLI tests.
- :mod:`tests.helpers.gpt`: the tiny GPT (blocks, tied head) of the FSDP tests.
- :mod:`tests.helpers.sdp`: the branchy model and tolerances of the ShardedDataParallel tests.
- :mod:`tests.helpers.fsdp`: whether an FSDP model shows its shards (no unit left gathered).
- :mod:`tests.helpers.processes`: the repository root and a session's live processes.
"""
