"""DistributedDataParallel's settable attributes on ShardedDataParallel: each works as in DDP or is refused.

Note [DDP attributes on ShardedDataParallel]
Scripts written for DDP set attributes on the wrapper. On an ``nn.Module`` an unknown name
just becomes a new attribute that nothing reads: training goes on as if the line were not
there (FullyShardedDataParallel silently reduced every micro-step after
``model.require_backward_grad_sync = False``: 414,288 B instead of 197,408 B). So
ShardedDataParallel keeps DDP's meaning where it has one and refuses the rest by name:

* ``require_backward_grad_sync``: settable; ``False`` accumulates the next backward passes
  locally, as inside :meth:`ShardedDataParallel.no_sync`, and the first backward with it
  ``True`` again reduces everything. DDP reads it at forward, ShardedDataParallel as the
  gradients arrive: set it before the forward, as DDP scripts do.
* the names in :data:`DDP_ONLY` (settings and methods of DDP that have no counterpart or
  another spelling here): setting or calling one raises ``AttributeError`` saying what to
  do instead.

ZeRO-1 (OSS under torch's own DDP) needs none of this: DDP is the wrapper.
"""

from __future__ import annotations

__all__ = ["DDP_ONLY", "refuse_ddp_only"]

DDP_ONLY: dict[str, str] = {
    "find_unused_parameters": "ShardedDataParallel always handles parameters that get no gradient (every bucket "
                              "is sent at the end of backward): remove the line",
    "gradient_as_bucket_view": "ShardedDataParallel copies each gradient into a bucket and frees it, so there is no "
                               "bucket view to choose: remove the line",
    "static_graph": "ShardedDataParallel needs no static-graph mode (unused parameters and use_reentrant=False "
                    "activation checkpoints work without it): remove the line",
    "_set_static_graph": "ShardedDataParallel needs no static-graph mode (unused parameters and use_reentrant=False "
                         "activation checkpoints work without it): remove the call",
    "require_forward_param_sync": "ShardedDataParallel's forward syncs only buffers: set "
                                  "model.broadcast_buffers = False to skip that",
    "bucket_bytes_cap": "pass ShardedDataParallel(reduce_buffer_size=<elements per bucket>) at construction",
    "register_comm_hook": "ShardedDataParallel reduces each gradient to its owner with its own all-to-all; for "
                          "compressed gradients pass reduce_dtype=torch.bfloat16 at construction",
}
"""DDP's attributes and methods that ShardedDataParallel refuses, with what to do instead."""


def refuse_ddp_only(name: str, setting: bool) -> None:
    """Raise if ``name`` is one of :data:`DDP_ONLY` (Note [DDP attributes on ShardedDataParallel]).

    Args:
        name: the attribute set, read or called.
        setting: whether it is being set (for the message).

    Raises:
        AttributeError: ``name`` is a DDP attribute or method that ShardedDataParallel does not have.
    """
    fix = DDP_ONLY.get(name)
    if fix is None:
        return
    what = f"{'setting ' if setting else ''}{name}"
    raise AttributeError(
        f"ShardedDataParallel has no DistributedDataParallel {name!r} ({what} is refused rather than ignored): {fix}"
    )
