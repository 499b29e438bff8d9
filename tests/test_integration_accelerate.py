"""Accelerate custom loops with ShardedAccelerator on 2 real ranks: ZeRO-1 (DDP + OSS) and
ZeRO-2 (ShardedDataParallel + OSS), built in either order around the LR scheduler, and
ZeRO-3 (FullyShardedDataParallel + a plain optimizer) train like accelerate + DDP with
accumulation, a warm-up schedule and clipping by the global norm; save_state / load_state
resumes exactly. An OSS built with ``offload="cpu"`` trains and resumes bit for bit as without
it, its state saved with offload loading without and the reverse."""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("accelerate")

from accelerate import Accelerator

from shardopt.integrations.accelerate import ShardedAccelerator
from shardopt.nn import FullyShardedDataParallel, ShardedDataParallel
from shardopt.optim import OSS
from shardopt.testing import run_ranks
from tests.helpers.clip import NORM_RTOL, clip_with_fed_norm
from tests.helpers.data import max_abs_diff, seeded_mlp

pytestmark = pytest.mark.distributed

CLIP, STEPS, ACCUM = 0.05, 4, 2


def _env(rank: int, world_size: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    warnings.filterwarnings("ignore")


def _loader(accelerator: Any) -> Any:
    gen = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 4, generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _run(mode: str, order: str, tmp: str, save_after: int | None = None, load: bool = False,
         fed_norms: list[float] | None = None, offload: str | None = None, state: str | None = None) -> dict[str, Any]:
    """Train STEPS optimizer steps; optionally save after ``save_after`` steps, or load
    the saved state first and train the remaining steps. ``fed_norms``: the DDP run clips
    by these total norms (Note [fed clip norms] in tests/helpers/clip.py). ``offload``: the
    OSS's; ``state``: the folder saved to and loaded from (default ``<mode>-<order>``)."""
    state = os.path.join(tmp, state or f"{mode}-{order}")
    cls = Accelerator if mode == "ddp" else ShardedAccelerator
    accelerator = cls(gradient_accumulation_steps=ACCUM, cpu=True)  # CPU tests: the CPU even where a GPU is seen
    model = seeded_mlp()
    if mode == "zero3":
        model = FullyShardedDataParallel(model)
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    elif mode == "ddp":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1, offload=offload)
        if order == "early":  # the trap: a state dict taken before the scheduler exists
            optimizer.consolidate_state_dict(recipient_rank=-1)
    wrapped: Any = ShardedDataParallel(model, optimizer) if mode == "zero2" else model
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 2))  # warm-up from 0
    wrapped, optimizer, loader, scheduler = accelerator.prepare(wrapped, optimizer, _loader(accelerator), scheduler)
    start = 0
    if load:
        accelerator.load_state(state)
        start = save_after or 0
    lrs, norms, losses, offloaded, done = [], [], [], [], 0
    for batch_idx, (x, y) in enumerate(loader):
        if batch_idx < start * ACCUM:
            continue  # the batches the saved run consumed
        with accelerator.accumulate(wrapped):
            loss = F.mse_loss(wrapped(x), y)
            losses.append(loss.detach().clone())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                offloaded.append(_offloaded(optimizer.optimizer))
                if fed_norms is not None:
                    norms.append(float(clip_with_fed_norm(model.parameters(), CLIP, fed_norms[len(norms)])))
                else:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            if save_after is not None and not load and start + done == save_after:
                accelerator.save_state(state)
            if start + done == STEPS:
                break
    if isinstance(wrapped, ShardedDataParallel):
        wrapped.close()
    if isinstance(model, FullyShardedDataParallel):
        params = list(model.state_dict().values())  # the full parameters (a collective)
    else:
        params = [p.detach().clone() for p in model.parameters()]
    accelerator.free_memory()
    return {"params": params, "lrs": lrs, "norms": norms, "losses": losses, "offloaded": offloaded}


def _offloaded(optimizer: Any) -> bool:
    """Whether ``optimizer`` is an offloaded OSS and every master this rank steps is a host
    tensor apart from its parameter (``None`` would mean no master: fp32 without offload)."""
    if not isinstance(optimizer, OSS) or optimizer.offload != "cpu":
        return False
    held = [(p, optimizer.master_of(p)) for p in optimizer.params if optimizer.grad_holder(p) is not None]
    return bool(held) and all(m is not None and m is not p and m.device.type == "cpu" for p, m in held)


def _loops(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _env(rank, world_size)
    out: dict[str, Any] = {}
    ref = _run("ddp", "late", tmp)
    out["lrs"] = ref["lrs"]
    for mode in ("zero1", "zero2"):
        for order in ("late", "early"):
            run = _run(mode, order, tmp, save_after=2)
            key = f"{mode}/{order}"
            out[key] = max_abs_diff(run["params"], ref["params"])
            out[f"{key}/lrs"] = run["lrs"] == ref["lrs"]
            out[f"{key}/norms"] = max(abs(a - b) for a, b in zip(run["norms"], ref["norms"], strict=True))
            resumed = _run(mode, order, tmp, save_after=2, load=True)
            out[f"{key}/resumed"] = max_abs_diff(resumed["params"], run["params"])
    zero3 = _run("zero3", "late", tmp, save_after=2)
    out["zero3"] = max_abs_diff(zero3["params"], ref["params"])
    out["zero3/lrs"] = zero3["lrs"] == ref["lrs"]
    out["zero3/norms"] = max(abs(a - b) / b for a, b in zip(zero3["norms"], ref["norms"], strict=True))
    fed = _run("ddp", "late", tmp, fed_norms=zero3["norms"])
    out["zero3/fed"] = max_abs_diff(zero3["params"], fed["params"])
    resumed = _run("zero3", "late", tmp, save_after=2, load=True)
    out["zero3/resumed"] = max_abs_diff(resumed["params"], zero3["params"])
    return out


def test_sharded_accelerator_trains_like_accelerate_ddp_in_any_call_order_and_resumes() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_loops, 2, tmp, timeout_s=300)
    for out in results:
        assert out["lrs"][0] == 0.0, out  # the warm-up starts at 0
        for mode in ("zero1", "zero2"):
            for order in ("late", "early"):
                key = f"{mode}/{order}"
                assert out[f"{key}/lrs"], out
                assert out[key] == 0.0 and out[f"{key}/norms"] == 0.0, out
                assert out[f"{key}/resumed"] == 0.0, out
        # ZeRO-3: the unit's reduce-scatter sums the same two fp32 gradients as DDP's
        # all-reduce, but its clip norm is summed from per-rank pieces and may differ from
        # torch's in the last bits (NORM_RTOL; Note [fed clip norms]): against DDP clipping
        # by ZeRO-3's own norms it is exact (measured against plain DDP: 3.0e-8).
        assert out["zero3/lrs"] and out["zero3/norms"] <= NORM_RTOL, out
        assert out["zero3/fed"] == 0.0, out
        assert out["zero3/resumed"] == 0.0, out


def _partial_clip(rank: int, world_size: int) -> str:
    _env(rank, world_size)
    accelerator = ShardedAccelerator(cpu=True)
    model = seeded_mlp()
    optimizer = accelerator.prepare(OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1))
    try:
        accelerator.clip_grad_norm_(list(model.parameters())[:2], CLIP)
    except ValueError as e:
        return str(e)
    finally:
        del optimizer
        accelerator.free_memory()
    return ""


def test_clipping_part_of_an_oss_optimizers_parameters_is_refused() -> None:
    (message,) = run_ranks(_partial_clip, 1)
    assert "clip_grad_norm_ got parameters that are not exactly those of the OSS optimizer (2 given, 6" in message


def _optimizer_first(rank: int, world_size: int, tmp: str) -> str:
    _env(rank, world_size)
    accelerator = ShardedAccelerator(cpu=True)
    model = FullyShardedDataParallel(seeded_mlp())
    optimizer, model = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1), model)
    try:
        accelerator.save_state(tmp)
    except ValueError as e:
        return str(e)
    finally:
        del optimizer, model
        accelerator.free_memory()
    return ""


def test_zero3_state_of_an_optimizer_prepared_before_its_model_is_refused() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (message,) = run_ranks(_optimizer_first, 1, tmp)
    assert message.startswith("save_state: an optimizer over a FullyShardedDataParallel model's shards was "
                              "prepared before the model"), message
    assert "prepare the model first" in message


def _plain_accelerator(rank: int, world_size: int, tmp: str) -> dict[str, str]:
    _env(rank, world_size)
    out: dict[str, str] = {}
    for placement in (True, False):
        accelerator = Accelerator(device_placement=placement, cpu=True)
        model = seeded_mlp()
        optimizer: Any = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
        try:
            model, optimizer = accelerator.prepare(model, optimizer)
            optimizer.optimizer.consolidate_state_dict()  # onto rank 0, as for torch.save on rank 0
            accelerator.save_state(tmp)
            out[f"placement={placement}"] = ""
        except RuntimeError as e:
            out[f"placement={placement}"] = str(e)
        finally:
            del model, optimizer
            accelerator.free_memory()
    return out


def test_oss_through_a_plain_accelerator_is_refused_with_a_message_naming_sharded_accelerator() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_plain_accelerator, 2, tmp, timeout_s=120)
    fix = ("it was called by a plain accelerate.Accelerator (in prepare or save_state), which reads the state dict on "
           "every rank without consolidating it first (a collective): use "
           "shardopt.integrations.accelerate.ShardedAccelerator (the same arguments)")
    for rank, out in enumerate(results):
        # prepare's device placement round-trips the state dict: refused on every rank.
        assert out["placement=True"].startswith(
            f"[rank {rank}] OSS.state_dict() has no consolidated state (consolidate_state_dict() was never called "
            f"on this optimizer); {fix}"), out
    # Without placement, save_state reads the state on every rank: rank 0 holds it, rank 1 is
    # told that the consolidation it did call went to rank 0, and the fix.
    assert results[0]["placement=False"] == "", results
    assert results[1]["placement=False"].startswith(
        "[rank 1] OSS.state_dict() has no consolidated state (the last consolidate_state_dict() collected the state "
        f"on rank 0, not this rank); {fix}"), results


def _offload(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    _env(rank, world_size)
    out: dict[str, Any] = {}
    for mode in ("zero1", "zero2"):
        runs = {offload: _run(mode, "late", tmp, save_after=2, offload=offload, state=f"{mode}-{offload}")
                for offload in (None, "cpu")}
        plain, offloaded = runs[None], runs["cpu"]
        out[f"{mode}/params"] = max_abs_diff(offloaded["params"], plain["params"])
        out[f"{mode}/losses"] = max_abs_diff(offloaded["losses"], plain["losses"])
        out[f"{mode}/same"] = offloaded["norms"] == plain["norms"] and offloaded["lrs"] == plain["lrs"]
        out[f"{mode}/offloaded"], out[f"{mode}/plain_offloaded"] = offloaded["offloaded"], plain["offloaded"]
        for saved, resumed in ((None, "cpu"), ("cpu", None)):  # across offload, both ways
            again = _run(mode, "late", tmp, save_after=2, load=True, offload=resumed, state=f"{mode}-{saved}")
            at = f"{mode}/saved-{saved}-resumed-{resumed}"
            out[f"{at}/params"] = max_abs_diff(again["params"], plain["params"])
            out[f"{at}/losses"] = max_abs_diff(again["losses"], plain["losses"][len(plain["losses"]) // 2:])
    return out


def test_an_offloaded_oss_trains_and_resumes_bit_for_bit_like_without_offload() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_offload, 2, tmp, timeout_s=300)
    for out in results:
        for mode in ("zero1", "zero2"):
            assert out[f"{mode}/offloaded"] == [True] * STEPS and not any(out[f"{mode}/plain_offloaded"]), out
            assert out[f"{mode}/params"] == 0.0 and out[f"{mode}/losses"] == 0.0 and out[f"{mode}/same"], out
            for saved, resumed in ((None, "cpu"), ("cpu", None)):
                at = f"{mode}/saved-{saved}-resumed-{resumed}"
                assert out[f"{at}/params"] == 0.0 and out[f"{at}/losses"] == 0.0, (at, out)
