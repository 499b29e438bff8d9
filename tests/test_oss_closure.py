"""OSS.step(closure) with fp32 masters under DDP's no_sync accumulation (ZeRO-1): the closure's
backward reduces what the ranks accumulated, so the step equals stepping after that backward.
Folding the gradients into the masters before the closure used to skip the other ranks'
accumulated micro-batches (found through Lightning's precision plugin, which steps with a
closure)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff
from tests.helpers.masters import loss_of, low_mlp

pytestmark = pytest.mark.distributed


def _closure_vs_plain(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    models = {}
    for how in ("plain", "closure"):
        model = low_mlp()
        ddp = DDP(model)
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=torch.float32)
        for step in range(3):
            opt.zero_grad()
            with ddp.no_sync():
                loss_of(ddp, rank, 10 * step).backward()
            last = lambda s=step: loss_of(ddp, rank, 10 * s + 1)  # noqa: E731
            if how == "plain":
                last().backward()
                opt.step()
            else:
                def closure(last: Any = last) -> float:
                    loss = last()
                    loss.backward()
                    return float(loss)
                opt.step(closure)
        models[how] = model
        del ddp
    out["diff"] = max_abs_diff(models["closure"].parameters(), models["plain"].parameters())
    return out


def test_step_with_a_closure_after_no_sync_accumulation_equals_stepping_after_backward() -> None:
    for out in run_ranks(_closure_vs_plain, 2, timeout_s=120):
        assert out["diff"] == 0.0, out
