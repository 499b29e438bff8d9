"""Where ZeRO-2's reductions run on a GPU: a side stream, joined once per backward.

ShardedDataParallel picks the stream operations (:class:`~shardopt.streams.StreamOps`) once per
plan (:func:`streams_for`) and hands them to its
:class:`~shardopt.nn.data_parallel.reduction_queue.ReductionQueue`, which routes every stream
operation through them and nothing else. On the CPU, and on gloo (whose
collectives are host-synchronous), they do nothing. Tests drive the queue with a recorder in
their place to check the order of launches, waits and frees without a GPU.

Note [reductions on a side stream]
On NCCL the bucket all-to-all, the owner's sum and the hand-over into ``param.grad`` or the
master's gradient run on one high-priority side stream ``R``, so that backward kernels on the
compute stream ``S0`` never queue behind communication (FSDP2's protocol, adapted to
buckets; torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):

1. launch (in the hook; the host never blocks): the gradient copy-ins and flag fills are on
   ``S0``; ``R.wait_stream(S0)``; the collective is posted with ``R`` current, so NCCL orders
   it after ``R``;
2. finish: with ``R`` current, ``work.wait()`` makes ``R`` (not the host, not ``S0``) wait, the
   owner sums and hands over on ``R``, and an event ``done`` is recorded on ``R``;
3. a bucket's pieces are referenced until ``S0`` has waited for its ``done``: when the bytes in
   flight pass the budget (the oldest bucket is retired: ``S0.wait_event(done)``, then its
   pieces are freed), or at the end of backward, where ``S0`` waits once for the last
   ``done`` before anything is freed and before the one deferred flag read (Note [host reads
   per step] in ``grad_buckets``). No ``record_stream``: a block is never returned to the
   allocator while a stream that did not allocate it may still read it.

Blocks allocated on ``R`` (receive pieces, a widened sum) are freed later from ``S0``'s
consumers; ``R`` reuses them only in a later launch, after ``R.wait_stream(S0)``, which orders
that reuse after every ``S0`` consumer queued before. A user hook that reads an owner's
gradient during backward sees it before the join, as with FSDP2.
"""

from __future__ import annotations

import torch

from shardopt import comm
from shardopt.streams import CudaStreams, HostStreams, StreamOps

__all__ = ["streams_for"]


def streams_for(device: torch.device, group: comm.ProcessGroup | None) -> StreamOps:
    """The stream operations for reducing gradients of ``device`` over ``group``: a
    high-priority side stream for CUDA tensors on a collective backend (NCCL) with more than
    one rank, else none.
    """
    if device.type == "cuda" and comm.group_size(group) > 1 and not comm.prefers_point_to_point(group, device):
        return CudaStreams(device, priority=-1)
    return HostStreams()
