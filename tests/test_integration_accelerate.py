"""Accelerate custom loops with ShardedAccelerator on 2 real ranks: ZeRO-1 (DDP + OSS) and
ZeRO-2 (ShardedDataParallel + OSS), built in either order around the LR scheduler, and
ZeRO-3 (FullyShardedDataParallel + a plain optimizer) train like accelerate + DDP with
accumulation, a warm-up schedule and clipping by the global norm (bit for bit with nothing
split across ranks, else like DDP clipping by their own norms, which are torch's within its
summation error); save_state / load_state resumes exactly. An OSS built with
``offload="cpu"`` trains and resumes bit for bit as without it, its state saved with offload
loading without and the reverse."""

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
from tests.helpers.clip import clip_with_fed_norm, norms_within
from tests.helpers.data import max_abs_diff, seeded_mlp

pytestmark = pytest.mark.distributed

CLIP, STEPS, ACCUM = 0.05, 4, 2
NUMEL = 820  # seeded_mlp()'s parameters: 8*16+16 + 16*32+32 + 32*4+4
# (mode, order, OSS split_large_params): ZeRO-1/2 by default split seeded_mlp()'s 32 x 16
# weight (512 elements, over a rank's share of 410) at 2 ranks; "whole" keeps every parameter
# on one rank.
RUNS = (("zero1", "late", None), ("zero1", "early", None), ("zero2", "late", None), ("zero2", "early", None),
        ("zero1", "whole", False), ("zero2", "whole", False), ("zero3", "late", None))


def _env(rank: int, world_size: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    warnings.filterwarnings("ignore")


def _loader(accelerator: Any) -> Any:
    gen = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 4, generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _run(mode: str, order: str, tmp: str, save_after: int | None = None, load: bool = False,
         fed_norms: list[float] | None = None, offload: str | None = None, state: str | None = None,
         split_large_params: bool | None = None) -> dict[str, Any]:
    """Train STEPS optimizer steps; optionally save after ``save_after`` steps, or load
    the saved state first and train the remaining steps. ``fed_norms``: the DDP run clips
    by these total norms (Note [fed clip norms] in tests/helpers/clip.py). ``offload`` and
    ``split_large_params``: the OSS's; ``state``: the folder saved to and loaded from (default
    ``<mode>-<order>``). ``order`` "early" consolidates the OSS's state before the scheduler exists."""
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
        optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1, offload=offload,
                        split_large_params=split_large_params)
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
    split: list[str] = []  # the names of the parameters the OSS splits across ranks
    if isinstance(optimizer.optimizer, OSS):
        names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
        split = [names[optimizer.optimizer.params[i]] for i in optimizer.optimizer.plan.split_params]
    if isinstance(model, FullyShardedDataParallel):
        params = list(model.state_dict().values())  # the full parameters (a collective)
    else:
        params = [p.detach().clone() for p in model.parameters()]
    accelerator.free_memory()
    return {"params": params, "lrs": lrs, "norms": norms, "losses": losses, "offloaded": offloaded, "split": split}


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
    for mode, order, split_large_params in RUNS:
        key = f"{mode}/{order}"
        run = _run(mode, order, tmp, save_after=2, split_large_params=split_large_params)
        out[key] = max_abs_diff(run["params"], ref["params"])
        out[f"{key}/split"] = run["split"]
        out[f"{key}/lrs"] = run["lrs"] == ref["lrs"]
        out[f"{key}/norms"] = list(zip(ref["norms"], run["norms"], strict=True))
        fed = _run("ddp", "late", tmp, fed_norms=run["norms"])  # Note [fed clip norms]
        out[f"{key}/fed"] = max_abs_diff(run["params"], fed["params"])
        resumed = _run(mode, order, tmp, save_after=2, load=True, split_large_params=split_large_params)
        out[f"{key}/resumed"] = max_abs_diff(resumed["params"], run["params"])
    return out


def test_sharded_accelerator_trains_like_accelerate_ddp_in_any_call_order_and_resumes() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_loops, 2, tmp, timeout_s=300)
    for out in results:
        assert out["lrs"][0] == 0.0, out  # the warm-up starts at 0
        # Nothing split: ZeRO-1/2's clip norm is torch's bit for bit, and so are the parameters.
        for mode in ("zero1", "zero2"):
            assert out[f"{mode}/whole/split"] == [], out
            assert all(a == b for a, b in out[f"{mode}/whole/norms"]), out
            assert out[f"{mode}/whole"] == 0.0, out
        # By default the 32 x 16 weight is split: its norm is the norm of its blocks' norms, and
        # ZeRO-3's is summed from flat shards, so the clip norm, and with it every parameter, may
        # differ from DDP's in the last bits (measured here: ZeRO-1/2 equal, ZeRO-3 6.6e-8 of
        # the norm and 3.0e-8 of the parameters; Note [fed clip norms] in tests/helpers/clip.py).
        # So every run is compared bit for bit with DDP clipping by the run's own norms (the rest
        # of the arithmetic is the same), and its norms with torch's within total_norm_rtol.
        for key in ("zero1/late", "zero1/early", "zero2/late", "zero2/early"):
            assert out[f"{key}/split"] == ["2.weight"], (key, out)
        for mode, order, _ in RUNS:
            key = f"{mode}/{order}"
            assert out[f"{key}/lrs"], (key, out)
            assert len(out[f"{key}/norms"]) == STEPS and norms_within(out[f"{key}/norms"], NUMEL), (key, out)
            assert out[f"{key}/fed"] == 0.0, (key, out)
            assert out[f"{key}/resumed"] == 0.0, (key, out)


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
