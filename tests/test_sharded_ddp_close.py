"""ShardedDataParallel.close() and the context manager: the module is left plain, and
training through a closed wrapper is refused."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)


def _close(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {}
    model, ref = seeded_mlp(), seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ddp = DDP(ref)
    with ShardedDataParallel(model, opt, reduce_buffer_size=0) as sdp:
        for step in range(2):
            for m, o in ((sdp, opt), (ddp, ref_opt)):
                o.zero_grad()
                m(rank_batch(rank, step)).square().mean().backward()
                o.step()
        # A no_sync backward sets the owner's reduced gradient aside; close() puts it back.
        sdp.zero_grad()
        sdp(rank_batch(rank, 2)).sum().backward()
        with sdp.no_sync():
            sdp(rank_batch(rank, 3)).sum().backward()
    out["trained_like_ddp"] = max_abs_diff(model.parameters(), ref.parameters())
    out["grads_kept"] = sum(p.grad is not None for p in model.parameters())
    sdp.close()  # idempotent
    # The module is plain again: a backward gives this rank's local gradients everywhere.
    model.zero_grad(set_to_none=True)
    model(rank_batch(rank, 4)).sum().backward()
    local = torch.autograd.grad(ref(rank_batch(rank, 4)).sum(), list(ref.parameters()))
    out["local_grads"] = max_abs_diff([p.grad for p in model.parameters()], local)  # type: ignore[misc]
    try:
        sdp(rank_batch(rank, 5))
    except RuntimeError as e:
        out["train_forward"] = str(e)
    sdp.eval()
    out["eval_forward"] = tuple(sdp(rank_batch(rank, 5)).shape)
    out["refresh"] = ""
    try:
        sdp.refresh_trainable()
    except RuntimeError as e:
        out["refresh"] = str(e)
    # close() inside a backward, once a bucket is on the wire, is refused.
    model2 = seeded_mlp()
    sdp2 = ShardedDataParallel(model2, OSS(model2.parameters(), lr=0.1), reduce_buffer_size=0)
    first = next(model2.parameters())  # its gradient arrives last, after other buckets launched
    first.register_post_accumulate_grad_hook(lambda p: sdp2.close())
    try:
        sdp2(rank_batch(rank, 6)).sum().backward()
    except RuntimeError as e:
        out["in_backward"] = str(e)
    return out


def test_close_leaves_a_plain_module_and_refuses_training_through_the_wrapper() -> None:
    for out in run_ranks(_close, 2):
        assert out["trained_like_ddp"] == 0.0
        assert out["grads_kept"] == 6  # every parameter: owned ones reduced + local, others local
        assert out["local_grads"] == 0.0
        assert "a training forward on a closed ShardedDataParallel" in str(out["train_forward"])
        assert out["eval_forward"] == (6, 4)
        assert "refresh_trainable() on a closed ShardedDataParallel" in str(out["refresh"])
        assert "close() was called while gradients are being reduced" in str(out["in_backward"])


class _Named(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = seeded_mlp()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(input_ids)


def _surface(rank: int, world_size: int) -> dict[str, object]:
    import inspect

    module = _Named()
    opt = OSS(module.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(module, opt)
    out: dict[str, object] = {
        "signature": list(inspect.signature(sdp.forward).parameters),
        "ddp_attrs": (sdp.device_type, sdp.is_multi_device_module, sdp.device_ids, sdp.require_backward_grad_sync),
    }
    with sdp.no_sync():
        out["in_no_sync"] = sdp.require_backward_grad_sync
    # a gradient that requires grad (create_graph left it) is refused at the next training forward
    sdp(rank_batch(rank, 0)).sum().backward()
    opt.step()
    first = next(module.parameters())
    first.grad = torch.zeros_like(first).requires_grad_()
    try:
        sdp(rank_batch(rank, 1))
        out["refused"] = ""
    except RuntimeError as exc:
        out["refused"] = str(exc)
    sdp.close()
    return out


def test_wrapper_shows_the_module_signature_ddp_attributes_and_refuses_grads_that_require_grad() -> None:
    for out in run_ranks(_surface, 2):
        assert out["signature"] == ["input_ids", "labels"], out
        assert out["ddp_attrs"] == ("cpu", False, None, True) and out["in_no_sync"] is False, out
        assert "parameter 'net.0.weight' holds a gradient that requires grad" in str(out["refused"]), out
