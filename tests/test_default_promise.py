"""What the front pages promise under default arguments (README "From DDP", docs/from-ddp.md):
the from-DDP script shape (AdamW with decay groups, global-norm clipping that is active every
step, ``zero_grad`` alternating ``set_to_none``) in fp32 at 2 ranks, ZeRO-2 with default
``OSS`` arguments against DDP.

* When the default plan keeps every parameter whole (a GPT whose largest matrix is under a
  rank's share), everything is bit for bit DDP's: parameters and every step's clip norm.
* When the default plan splits a parameter (a vocabulary head larger than a rank's share), a
  clip's total norm takes that parameter's norm from its blocks' norms instead of torch's one
  reduction (Note [sharded norm in torch's order]): both are fp32 sums of ``n`` squares whose
  rounding error grows like ``log2(n) * 2**-24`` relative (torch's reduction is a tree), so
  the two totals differ by at most about twice that: ``2 * 17 * 2**-24`` (2.0e-6) for the head's
  131,072 elements (measured: 9.2e-7, about 12 float32 ulps of the total). The clip
  coefficient then differs by as much, AdamW's update ``m / (sqrt(v) + eps)`` is nearly
  invariant to a common scale of the gradients, and what is left is the rounding of the
  parameter after each update, up to one ulp of its magnitude per step, carried on through
  Adam's moments: we allow 8 ulps of the largest parameter (``2**-20`` relative) after 6 steps
  (measured: 2.1e-7 relative, 3.5e-7 under ``ATEN_CPU_CAPABILITY=avx2``: 2 to 3 ulps).
* Without clipping the split run is bit for bit DDP's, and with ``split_large_params=False``
  the clipped one is too.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.data import decay_groups
from tests.helpers.gpt import gpt, lm_loss, tokens
from tests.helpers.sdp import VocabModel, rel_diff, vocab_loss

pytestmark = pytest.mark.distributed  # starts processes

MAX_NORM = 0.01  # far below both models' gradient norms (about 0.4 and 5): every step clips
NORM_BOUND = 2 * 17 * 2.0**-24  # relative; see the module docstring
PARAM_BOUND = 2.0**-20


def _run(rank: int, world_size: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message="OSS: the heaviest rank")
    out: dict[str, Any] = {}
    cases = [("gpt", True, None), ("vocab", True, None), ("vocab", False, None), ("vocab", True, False)]
    for name, clip, split in cases:
        make = gpt if name == "gpt" else VocabModel
        ref, model = make(), make()
        ddp = DDP(ref)
        ref_opt = torch.optim.AdamW(decay_groups(ref), lr=1e-2)
        kwargs = {} if split is None else {"split_large_params": split}  # None: the default, not passed
        opt = OSS(decay_groups(model), optim=torch.optim.AdamW, lr=1e-2, **kwargs)
        sdp = ShardedDataParallel(model, opt)
        index = {id(p): i for i, p in enumerate(opt.params)}
        key = f"{name}/clip={clip}/split={split}"
        out[f"{key}/split"] = [n for n, p in model.named_parameters() if index[id(p)] in opt.plan.split_params]
        norms = []
        for step in range(6):
            for net in (ddp, sdp):
                if name == "gpt":
                    toks = tokens(rank, step)
                    lm_loss(net(toks), toks).backward()
                else:
                    vocab_loss(net, rank, step).backward()
            if clip:
                expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                norms.append((float(expected), float(total)))
            ref_opt.step()
            opt.step()
            ref_opt.zero_grad(set_to_none=step % 2 == 0)
            opt.zero_grad(set_to_none=step % 2 == 0)
        out[f"{key}/norms"] = norms
        out[f"{key}/params"] = rel_diff(model, ref)
        sdp.close()
        del ddp
    return out


def test_default_arguments_train_like_ddp_bitwise_unless_a_split_parameter_is_clipped_then_within_one_rounding() -> None:
    for out in run_ranks(_run, 2, timeout_s=180):
        assert out["gpt/clip=True/split=None/split"] == []  # nothing split by default here
        assert out["vocab/clip=True/split=None/split"] == ["head.weight"]  # split by default here
        assert out["vocab/clip=True/split=False/split"] == []
        for key in ("gpt/clip=True/split=None", "vocab/clip=True/split=False"):
            assert out[f"{key}/params"] == 0.0, (key, out[f"{key}/params"])
            assert all(a == b for a, b in out[f"{key}/norms"]), (key, out[f"{key}/norms"])
        assert out["vocab/clip=False/split=None/params"] == 0.0
        key = "vocab/clip=True/split=None"
        assert all(abs(a - b) <= NORM_BOUND * a for a, b in out[f"{key}/norms"]), out[f"{key}/norms"]
        assert all(a > 10 * MAX_NORM for a, _ in out[f"{key}/norms"])  # clipping is active every step
        assert out[f"{key}/params"] <= PARAM_BOUND, out[f"{key}/params"]
