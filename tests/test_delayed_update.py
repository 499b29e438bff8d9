"""``OSS(..., offload="cpu", delay_update_after=k)`` (Note [delayed update] in
shardopt.optim.delayed_update): after ``k`` ordinary steps each host step runs on a worker
thread and its update reaches the parameters at the next ``step()`` (or ``finish_update()``, a
save, a re-plan), so every later iteration computes its gradients one update late.

The reference is written here from plain pieces: a model whose gradients come through DDP
(ZeRO-1) or are computed for every rank in one process and summed in rank order as
ShardedDataParallel's owners sum them (ZeRO-2; Note [reduce into master gradients]), fp32
masters stepped by torch's own AdamW, and the masters copied into the model one step late
after the warm-up. The delayed run must equal it bit for bit: the same kernels run on the same
values (an fp32 parameter's mirror is exact, a flat step equals the per-tensor one over
64-aligned segments: Note [aligned segments] in shardopt.optim.flat_masters), only on another
thread. Clipping is compared against torch's clip fed the run's own total norm (Note [fed clip
norms] in tests/helpers/clip.py: the default plan splits the 64 x 64 weight at 2 and 3 ranks).
"""

from __future__ import annotations

import os
import shutil
import threading
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt import checkpoint
from shardopt.files import SHARDED_MARKER
from shardopt.integrations.checkpoints import convert_sharded
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler
from shardopt.state_checks import meta_crc
from shardopt.testing import RankFailure, run_ranks
from tests.helpers.clip import norms_within
from tests.helpers.hybrid import group_then_replicas
from tests.helpers.masters import backward_micro_steps, loss_of, sdp_reduce
from tests.helpers.oss import state_entries_equal

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

F32, BF16 = torch.float32, torch.bfloat16
ADAMW: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1}
WARMUP = 2
"""delay_update_after of the sweep: steps 0 and 1 are ordinary, the later ones delayed."""
STEPS = 7
SAVE_AT = 4
"""The checkpoint mode saves before this step's forward, with an update pending."""
MAX_NORM = 0.05
MODES = ("plain", "accumulate", "no_sync", "clip", "overlap", "scaler", "freeze", "checkpoint")
"""``overlap``: two reduced micro-batches and clipping while the last step's update is held on its worker
(:func:`_hold_steps`), so the next iteration writes the gradient buffer and clips it during that step."""
ACCUMULATING = ("accumulate", "no_sync", "overlap")
CLIPPING = ("clip", "overlap")
INF_STEP = 3
"""The scaler mode puts an inf into one rank's gradient at this step: every rank skips it."""
HYBRID = "hybrid2"
"""The stage of ZeRO-2 over a hybrid layout: ``OSS(..., shard_size=SHARD_SIZE)`` under ShardedDataParallel, each
rank's gradient summed in its shard group and the group sums across replicas (Note [hybrid reduction])."""
SHARD_SIZE = 2


def mlp(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Aligned weights (stepped as one flat tensor) and two biases that are not (48 and 4
    elements: stepped as views); the 64 x 64 weight is split at 2 and 3 ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 4)).to(dtype)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _frozen(mode: str, stage: str, step: int) -> bool | None:
    """Whether the freeze mode freezes (True) or unfreezes (False) ``model[2].weight`` before
    ``step``; ``None``: no change (ZeRO-2 only: DDP cannot change which parameters train)."""
    if mode != "freeze" or stage != "zero2" or step not in (3, 5):
        return None
    return step == 3


# ---------------------------------------------------------------------- the delayed run


def _hold_steps(opt: OSS) -> threading.Semaphore:
    """Make each of the wrapped optimizer's steps wait for a permit (60 s at most). The caller
    releases one just before an ordinary ``OSS.step()`` and before one that finishes a delayed
    update, so that update runs only once the next iteration's backward and clipping are over."""
    permits = threading.Semaphore(0)
    inner = opt.optim.step

    def held(*args: Any, **kwargs: Any) -> Any:
        if not permits.acquire(timeout=60):
            raise RuntimeError("the test never released this step")
        return inner(*args, **kwargs)

    opt.optim.step = held  # type: ignore[method-assign]
    return permits


def _build(stage: str, model: nn.Module, dtype: torch.dtype, delay: int | None) -> tuple[OSS, nn.Module]:
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, offload="cpu", delay_update_after=delay,
              master_dtype=F32 if dtype != F32 else None, shard_size=SHARD_SIZE if stage == HYBRID else None, **ADAMW)
    return opt, (DDP(model) if stage == "zero1" else ShardedDataParallel(model, opt))


def _delayed(rank: int, world_size: int, stage: str, dtype: torch.dtype, mode: str, folder: str) -> dict[str, Any]:
    """The run under test. Returns the parameters after every ``step()``, before and after the
    final ``finish_update()``, the consolidated state, the clip norms and the checkpoint checks."""
    model = mlp(dtype)
    opt, wrapped = _build(stage, model, dtype, WARMUP)
    assert (opt.layout is not None) == (stage == HYBRID), (stage, opt.layout)
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=2, device="cpu") if mode == "scaler" else None
    permits = _hold_steps(opt) if mode == "overlap" else None
    out: dict[str, Any] = {"after_step": [], "norms": []}
    for step in range(STEPS):
        if mode == "checkpoint" and step == SAVE_AT:
            path = f"{folder}/{stage}-{dtype}"
            if stage == "zero1":
                checkpoint.save_consolidated(path + ".pt", model, opt)
            else:
                checkpoint.save_sharded(path, model, opt)
            out["saved_model"] = _params(model)  # the save wrote the pending update first
            model = mlp(dtype, seed=5)
            opt, wrapped = _build(stage, model, dtype, WARMUP)  # the checkpoint holds the steps taken
            if stage == "zero1":
                checkpoint.load_consolidated(path + ".pt", model, opt)
            else:
                checkpoint.load_sharded(path, model, opt)
            out["loaded_model"] = _params(model)
        frozen = _frozen(mode, stage, step)
        if frozen is not None:
            model[2].weight.requires_grad_(not frozen)  # type: ignore[index]  # ShardedDataParallel re-plans at the forward
        opt.zero_grad(set_to_none=step % 2 == 0)
        micro = 2 if mode in ACCUMULATING else 1
        backward_micro_steps(wrapped, rank, step, micro, dtype, scaler, no_sync=mode == "no_sync")
        if scaler is not None:
            if step == INF_STEP and rank == world_size - 1:  # on one rank only: every rank skips
                opt.collect_master_grads()
                owned = [p for p in opt.params if opt.grad_holder(p) is not None]
                holder = opt.grad_holder(owned[0])
                assert holder is not None and holder.grad is not None
                holder.grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        else:
            if mode in CLIPPING:
                out["norms"].append(float(opt.clip_grad_norm(MAX_NORM)))
            if permits is not None and step != WARMUP:  # an ordinary step, or the update held since the last one
                permits.release()
            opt.step()
        out["after_step"].append(_params(model))
    out["before_finish"] = _params(model)
    if permits is not None:
        permits.release()
    opt.finish_update()
    out["final"] = _params(model)
    out["state"] = opt.state_dict(all_ranks=True)["state"]
    return out


# ---------------------------------------------------------------------- the reference


class StaleReference:
    """Plain pieces: ``model`` takes the gradients, fp32 ``masters`` are stepped by torch's
    AdamW, and :meth:`write` copies them into the model (rounded): at once during the warm-up,
    else at the next step, as OSS finishes a delayed update.

    Args:
        stage: ``"zero1"`` (gradients through DDP), ``"zero2"`` (every rank's local gradients
            computed here and summed in rank order, ShardedDataParallel's arithmetic) or ``HYBRID``
            (summed in rank order inside each shard group, then the group sums in group order:
            hybrid ShardedDataParallel's, bit for bit with 2 replicas, tests/helpers/hybrid.py).
        dtype: the model's dtype.
        world_size: the ranks whose data the gradients average.
    """

    def __init__(self, stage: str, dtype: torch.dtype, world_size: int) -> None:
        self.stage, self.dtype, self.world_size = stage, dtype, world_size
        self.model = mlp(dtype)
        self.masters = [p.detach().to(F32, copy=True).requires_grad_() for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, **ADAMW)
        self.ddp = DDP(self.model) if stage == "zero1" else None
        self.pending = False
        self._sums: list[list[torch.Tensor]] | None = None  # ZeRO-2 no_sync: each rank's fp32 local sum

    @torch.no_grad()
    def write(self) -> None:
        """The masters into the model: the update is finished."""
        for p, m in zip(self.model.parameters(), self.masters, strict=True):
            p.copy_(m)
        self.pending = False

    def backward(self, rank: int, data_step: int, quiet: bool, scaler: torch.amp.GradScaler | None) -> None:
        """One micro-batch: DDP's reduction into ``.grad`` (ZeRO-1); or every rank's local gradient,
        reduced now into the masters' gradients or, when ``quiet``, summed locally in fp32 (ZeRO-2)."""
        if self.ddp is not None:
            loss = loss_of(self.ddp, rank, data_step, self.dtype)
            with self.ddp.no_sync() if quiet else nullcontext():
                (loss if scaler is None else scaler.scale(loss)).backward()
            return
        params = list(self.model.parameters())
        local = []
        for r in range(self.world_size):
            loss = loss_of(self.model, r, data_step, self.dtype)
            local.append([g.detach() for g in torch.autograd.grad(loss if scaler is None else scaler.scale(loss), params)])
        if self._sums is not None or quiet:  # Note [no_sync sums in master precision] in local_sums
            self._sums = [[g.to(F32, copy=True) for g in grads] for grads in local] if self._sums is None else [
                [a.add_(b) for a, b in zip(acc, grads, strict=True)] for acc, grads in zip(self._sums, local, strict=True)]
            if quiet:
                return
            local, self._sums = self._sums, None
        if self.stage == HYBRID:  # widened exactly, scaled by 1/N in fp32, group then replicas (as sdp_reduce)
            self._add(group_then_replicas([[g.to(F32) for g in grads] for grads in local], SHARD_SIZE))  # type: ignore[arg-type]
            return
        self._add([sdp_reduce(list(g), F32) for g in zip(*local, strict=True)])

    def _add(self, grads: list[torch.Tensor]) -> None:
        for m, g in zip(self.masters, grads, strict=True):
            g = g.to(F32, copy=True)
            m.grad = g if m.grad is None else m.grad.add_(g)

    def collect(self, frozen: set[int]) -> None:
        """DDP's reduced ``.grad`` (ZeRO-1) into the masters' gradients, cast exactly; drop the
        frozen parameters' (torch's AdamW then skips them, as OSS parks them)."""
        if self.ddp is not None:
            self._add([p.grad for p in self.model.parameters()])  # type: ignore[misc]
        for i in frozen:
            self.masters[i].grad = None

    def zero_grad(self, set_to_none: bool) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        for m in self.masters:
            m.grad = None

    def state(self) -> dict[int, dict[str, Any]]:
        """AdamW's state, with the master of each bf16 parameter (mirrors of fp32 ones are never saved)."""
        state = {i: dict(s) for i, s in self.opt.state_dict()["state"].items()}
        if self.dtype != F32:
            for i, m in enumerate(self.masters):
                state.setdefault(i, {})["master"] = m.detach()
        return state


def _reference(rank: int, world_size: int, stage: str, dtype: torch.dtype, mode: str,
               norms: list[float]) -> dict[str, Any]:
    """The iterations of :func:`_delayed` from :class:`StaleReference`, clipped by the delayed
    run's own total ``norms`` (Note [fed clip norms] in tests/helpers/clip.py)."""
    ref = StaleReference(stage, dtype, world_size)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if mode == "scaler" else None
    out: dict[str, Any] = {"after_step": [], "torch_norms": []}
    frozen: set[int] = set()
    weight = [n for n, _ in ref.model.named_parameters()].index("2.weight")
    taken = 0  # steps taken; a skipped one is none
    for step in range(STEPS):
        if mode == "checkpoint" and step == SAVE_AT:
            ref.write()  # a save writes the pending update
            out["saved_model"] = _params(ref.model)
            if ref.ddp is not None:  # as the resumed run: a fresh DDP's first buckets may sum in another order
                ref.ddp = DDP(ref.model)
        change = _frozen(mode, stage, step)
        if change is not None:
            ref.write()  # a re-plan writes the pending update
            frozen = {weight} if change else set()
        ref.zero_grad(set_to_none=step % 2 == 0)
        micro = 2 if mode in ACCUMULATING else 1
        for k in range(micro):
            ref.backward(rank, 10 * step + k, mode == "no_sync" and k < micro - 1, scaler)
        ref.collect(frozen)
        skipped = scaler is not None and step == INF_STEP
        if scaler is not None:
            if skipped:
                ref.masters[0].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
            scaler.unscale_(ref.opt)
        if mode in CLIPPING:
            grads = [m.grad for m in ref.masters if m.grad is not None]
            out["torch_norms"].append(float(torch.nn.utils.get_total_norm(grads)))
            torch.nn.utils.clip_grads_with_norm_(ref.masters, MAX_NORM, torch.tensor(norms[step], dtype=F32))
        if not skipped:
            if ref.pending:
                ref.write()
            if scaler is not None:
                scaler.step(ref.opt)
            else:
                ref.opt.step()
            ref.pending = True
            if taken < WARMUP:
                ref.write()
            taken += 1
        if scaler is not None:
            scaler.update()
        out["after_step"].append(_params(ref.model))
    out["before_finish"] = _params(ref.model)
    ref.write()
    out["final"] = _params(ref.model)
    out["state"] = ref.state()
    return out


# ---------------------------------------------------------------------- the sweep


def _sweep(rank: int, world_size: int, folder: str, modes: tuple[str, ...],
           stages: tuple[str, ...] = ("zero1", "zero2")) -> dict[str, dict[str, bool]]:
    out: dict[str, dict[str, bool]] = {}
    numel = sum(p.numel() for p in mlp(F32).parameters())
    for stage in stages:
        for dtype in (F32, BF16):
            for mode in modes:
                if mode == "freeze" and stage != "zero2":
                    continue
                run = _delayed(rank, world_size, stage, dtype, mode, folder)
                ref = _reference(rank, world_size, stage, dtype, mode, run["norms"])
                out[f"{stage}/{dtype}/{mode}"] = {
                    "every_step": all(_equal(a, b) for a, b in zip(run["after_step"], ref["after_step"], strict=True)),
                    "before_finish": _equal(run["before_finish"], ref["before_finish"]),
                    "final": _equal(run["final"], ref["final"]),
                    "state": state_entries_equal(run["state"], ref["state"]),
                    "last_update_pending": not _equal(run["before_finish"], run["final"]),
                    "norms": mode not in CLIPPING or (len(run["norms"]) == STEPS
                                                and norms_within(zip(ref["torch_norms"], run["norms"], strict=True), numel)),
                    "saved": mode != "checkpoint" or (_equal(run["saved_model"], ref["saved_model"])
                                                      and _equal(run["loaded_model"], ref["saved_model"])),
                }
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_delayed_update_equals_a_reference_that_applies_each_update_one_step_late(world_size: int, tmp_path: Any) -> None:
    results = run_ranks(_sweep, world_size, str(tmp_path), MODES, timeout_s=600)
    assert results[0], "no configuration ran"
    for tag in results[0]:
        for key in results[0][tag]:
            assert all(r[tag][key] for r in results), (tag, key, [r[tag] for r in results])


def test_delayed_hybrid_zero2_at_2_groups_of_2_equals_the_group_then_replicas_reference_one_step_late(
        tmp_path: Any) -> None:
    results = run_ranks(_sweep, 4, str(tmp_path), tuple(m for m in MODES if m != "freeze"), (HYBRID,), timeout_s=600)
    assert len(results[0]) == 2 * (len(MODES) - 1), sorted(results[0])
    for tag in results[0]:
        for key in results[0][tag]:
            assert all(r[tag][key] for r in results), (tag, key, [r[tag] for r in results])


# ---------------------------------------------------------------------- warm-up, finishing, loading


def _train(rank: int, model: nn.Module, wrapped: nn.Module, opt: OSS, steps: range,
           dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Plain steps; the parameters after each ``step()``."""
    seen = []
    for step in steps:
        opt.zero_grad()
        loss_of(wrapped, rank, step, dtype).backward()
        opt.step()
        seen.append(_params(model))
    return seen


def _warm_up(rank: int, world_size: int) -> dict[str, bool]:
    """Six steps with delay_update_after=3, 6 (never reached) and None (off)."""
    out: dict[str, bool] = {}
    for stage in ("zero1", "zero2"):
        for dtype in (F32, BF16):
            runs: dict[int | None, tuple[list[list[torch.Tensor]], list[torch.Tensor], dict[Any, Any]]] = {}
            for delay in (None, 3, 6):
                model = mlp(dtype)
                opt, wrapped = _build(stage, model, dtype, delay)
                seen = _train(rank, model, wrapped, opt, range(6), dtype)
                opt.finish_update()
                runs[delay] = (seen, _params(model), opt.state_dict(all_ranks=True)["state"])
            off, late, never = runs[None], runs[3], runs[6]
            tag = f"{stage}/{dtype}"
            out[tag + "/warm-up equal"] = all(_equal(a, b) for a, b in zip(late[0][:3], off[0][:3], strict=True))
            out[tag + "/step 3 pending"] = _equal(late[0][3], late[0][2]) and not _equal(late[0][3], off[0][3])
            out[tag + "/results change"] = not _equal(late[1], off[1])
            out[tag + "/never reached equal"] = (all(_equal(a, b) for a, b in zip(never[0], off[0], strict=True))
                                                 and _equal(never[1], off[1]) and state_entries_equal(never[2], off[2]))
    return out


def test_warm_up_steps_equal_the_run_without_delay_and_the_delay_changes_the_results() -> None:
    for r in run_ranks(_warm_up, 2, timeout_s=300):
        assert r and all(r.values()), r


def _finishing(rank: int, world_size: int, folder: str) -> dict[str, bool]:
    """Three delayed steps (delay_update_after=0), then each way of finishing or dropping the
    pending update, against a twin run that calls finish_update()."""
    out: dict[str, bool] = {}
    for dtype in (F32, BF16):
        tag = str(dtype)
        twin = mlp(dtype)
        twin_opt, twin_sdp = _build("zero2", twin, dtype, 0)
        _train(rank, twin, twin_sdp, twin_opt, range(3), dtype)
        stale = _params(twin)
        twin_opt.finish_update()
        finished = _params(twin)
        twin_opt.finish_update()  # nothing pending: nothing changes
        out[tag + "/finish twice"] = _equal(_params(twin), finished) and not _equal(stale, finished)
        for how in ("state_dict(all_ranks=True)", "consolidate_state_dict", "add_param_group", "save_sharded"):
            model = mlp(dtype)
            opt, sdp = _build("zero2", model, dtype, 0)
            _train(rank, model, sdp, opt, range(3), dtype)
            before = _params(model)
            if how == "add_param_group":
                opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, dtype=dtype))]})
            elif how == "save_sharded":
                checkpoint.save_sharded(f"{folder}/{dtype}", model, opt)
            else:
                getattr(opt, how.split("(")[0])(**({"all_ranks": True} if "all_ranks" in how else {}))
            out[f"{tag}/{how} writes the update"] = _equal(before, stale) and _equal(_params(model), finished)
        model = mlp(dtype)  # a load drops the pending update and writes nothing
        opt, sdp = _build("zero2", model, dtype, 0)
        _train(rank, model, sdp, opt, range(3), dtype)
        saved = twin_opt.state_dict(all_ranks=True)
        before = _params(model)
        opt.load_state_dict(saved)
        opt.finish_update()
        out[tag + "/load drops it"] = _equal(_params(model), before)
        model.load_state_dict(twin.state_dict())  # the model's weights too (Note [masters follow outside writes])
        out[tag + "/load keeps the loaded state"] = state_entries_equal(opt.state_dict(all_ranks=True)["state"],
                                                                        saved["state"])
    model = mlp(F32)  # without a delay, finish_update() does nothing
    opt, sdp = _build("zero2", model, F32, None)
    _train(rank, model, sdp, opt, range(2), F32)
    before = _params(model)
    opt.finish_update()
    out["no delay: finish_update does nothing"] = _equal(_params(model), before)
    return out


def test_saving_consolidating_and_re_planning_write_the_pending_update_and_a_load_drops_it(tmp_path: Any) -> None:
    for r in run_ranks(_finishing, 2, str(tmp_path), timeout_s=300):
        assert r and all(r.values()), r


# ---------------------------------------------------------------------- resuming: the saved step count

RESUME_WARMUP = 3
"""delay_update_after of the resume test: steps 0-2 ordinary, from step 3 on delayed."""
RESUME_AT = (1, 4)
"""The resume test saves before step 1 (in the warm-up) and before step 4 (one delayed step done; its update pending)."""


def _save(kind: str, path: str, model: nn.Module, opt: OSS) -> None:
    if kind == "consolidated":
        checkpoint.save_consolidated(path, model, opt)
    else:
        checkpoint.save_sharded(path, model, opt)


def _load(kind: str, path: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    if kind == "consolidated":
        checkpoint.load_consolidated(path, model, opt)
    else:
        checkpoint.load_sharded(path, model, opt)


def _as_before_the_count(kind: str, path: str, old: str) -> None:
    """Write at ``old`` the checkpoint at ``path`` as shardopt wrote it before the step count was saved:
    without the optimizer's ``"oss_steps"`` (consolidated) or the folder's ``optim_entries`` (sharded)."""
    if kind == "consolidated":
        blob = torch.load(path, weights_only=True)
        del blob["optimizer"]["oss_steps"], blob["checksums"]["optimizer"]["/oss_steps"]
        torch.save(blob, old)
        return
    shutil.copytree(path, old)
    meta_path = os.path.join(old, SHARDED_MARKER)
    meta = torch.load(meta_path, weights_only=True)
    del meta["optim_entries"], meta["meta_crc"]
    meta["meta_crc"] = meta_crc(meta)
    torch.save(meta, meta_path)


def _go_on(rank: int, model: nn.Module, wrapped: nn.Module, opt: OSS, start: int, dtype: torch.dtype) -> dict[str, Any]:
    """Steps ``start`` to ``STEPS - 1``: the parameters after each, after ``finish_update()``, the state and the count."""
    seen = _train(rank, model, wrapped, opt, range(start, STEPS), dtype)
    opt.finish_update()
    saved = opt.state_dict(all_ranks=True)
    return {"after_step": seen, "final": _params(model), "state": saved["state"], "steps": saved["oss_steps"]}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (all(_equal(x, y) for x, y in zip(a["after_step"], b["after_step"], strict=True))
            and _equal(a["final"], b["final"]) and state_entries_equal(a["state"], b["state"]))


def _resumed(rank: int, kind: str, stage: str, dtype: torch.dtype, path: str, delay: int, start: int) -> dict[str, Any]:
    """A fresh model and OSS(delay_update_after=delay) that load ``path`` and go on from step ``start``."""
    model = mlp(dtype, seed=5)
    opt, wrapped = _build(stage, model, dtype, delay)
    _load(kind, path, model, opt)
    return _go_on(rank, model, wrapped, opt, start, dtype)


def _resuming(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """For each checkpoint kind, stage, dtype and save point: the run that saves and goes on, a fresh
    OSS with the same delay_update_after that loads the checkpoint and goes on, and one that loads it
    as written before the count was saved."""
    out: dict[str, Any] = {}
    for kind, stage in (("consolidated", "zero1"), ("consolidated", "zero2"), ("sharded", "zero1"),
                        ("sharded", "zero2")):
        for dtype in (F32, BF16):
            for save_at in RESUME_AT:
                tag = f"{kind}/{stage}/{dtype}/save before step {save_at}"
                path = os.path.join(folder, tag.replace("/", "-").replace(" ", "_"))
                model = mlp(dtype)
                opt, wrapped = _build(stage, model, dtype, RESUME_WARMUP)
                _train(rank, model, wrapped, opt, range(save_at), dtype)
                _save(kind, path, model, opt)
                saved = _params(model)  # the save wrote the pending update first
                on = _go_on(rank, model, wrapped, opt, save_at, dtype)
                again = _resumed(rank, kind, stage, dtype, path, RESUME_WARMUP, save_at)
                if rank == 0:
                    _as_before_the_count(kind, path, path + "-old")
                dist.barrier()
                old = _resumed(rank, kind, stage, dtype, path + "-old", RESUME_WARMUP, save_at)
                # A count from 0 with delay_update_after=k is the saved count with k + save_at.
                shifted = _resumed(rank, kind, stage, dtype, path, RESUME_WARMUP + save_at, save_at)
                out[tag] = {"resumed equals the run that saved": _same(again, on),
                            "counts": (on["steps"], again["steps"], old["steps"]),
                            "old checkpoint counts from 0": _same(old, shifted),
                            "old checkpoint differs": not _same(old, on),
                            "folder": path, "saved": saved}
    out["loads elsewhere"] = _loads_elsewhere(rank, folder)
    return out


def _loads_elsewhere(rank: int, folder: str) -> dict[str, bool]:
    """A checkpoint of a delayed, offloaded OSS loads into an OSS without offload and into torch's AdamW; a
    bad saved count is refused before anything changes."""
    path = os.path.join(folder, "elsewhere.pt")
    model = mlp(F32)
    opt, wrapped = _build("zero1", model, F32, 1)
    _train(rank, model, wrapped, opt, range(3), F32)
    checkpoint.save_consolidated(path, model, opt)
    out: dict[str, bool] = {}
    plain_model = mlp(F32, seed=5)
    plain = OSS(plain_model.parameters(), optim=torch.optim.AdamW, **ADAMW)
    checkpoint.load_consolidated(path, plain_model, plain)
    out["OSS without offload takes the count"] = plain.state_dict(all_ranks=True)["oss_steps"] == 3
    out["OSS without offload takes the weights"] = _equal(_params(plain_model), _params(model))
    torch_model = mlp(F32, seed=5)
    adamw = torch.optim.AdamW(torch_model.parameters(), **ADAMW)
    checkpoint.load_consolidated(path, torch_model, adamw)
    out["torch's AdamW takes the state"] = state_entries_equal(adamw.state_dict()["state"],
                                                               opt.state_dict(all_ranks=True)["state"])
    good = opt.state_dict(all_ranks=True)
    for value in (-1, True, 2.0, "3"):
        try:
            opt.load_state_dict({**good, "oss_steps": value})
            out[f"oss_steps={value!r} refused"] = False
        except ValueError as exc:
            out[f"oss_steps={value!r} refused"] = str(exc) == (
                f"state_dict: the optimizer entry 'oss_steps' must be the step() calls taken, an int >= 0, got "
                f"{value!r}; it was edited or not saved by OSS: load a state dict saved by OSS, or delete the "
                "'oss_steps' entry to count the steps from 0. Nothing was loaded")
    if rank == 0:
        blob = torch.load(path, weights_only=True)
        blob["optimizer"]["oss_steps"] = -2
        blob["checksums"]["optimizer"].pop("/oss_steps")
        torch.save(blob, path + "-bad")
    dist.barrier()
    fresh = mlp(F32, seed=5)
    fresh_opt, _ = _build("zero1", fresh, F32, 1)
    before = _params(fresh)
    try:
        checkpoint.load_consolidated(path + "-bad", fresh, fresh_opt)
        out["bad count in a file refused"] = False
    except ValueError as exc:
        out["bad count in a file refused"] = (f"checkpoint {path + '-bad'!r}: the optimizer entry 'oss_steps' must be "
                                              "the step() calls taken, an int >= 0, got -2" in str(exc))
    out["bad count in a file changes nothing"] = _equal(_params(fresh), before)
    return out


def test_a_run_resumed_with_the_same_delay_update_after_equals_the_run_that_saved_and_old_checkpoints_count_from_0(
        tmp_path: Any) -> None:
    results = run_ranks(_resuming, 2, str(tmp_path), timeout_s=600)
    for r in results:
        elsewhere = r.pop("loads elsewhere")
        assert len(r) == 16, sorted(r)
        for tag, checks in r.items():
            assert checks["resumed equals the run that saved"], (tag, checks)
            assert checks["counts"] == (STEPS, STEPS, STEPS - int(tag.split()[-1])), (tag, checks)
            assert checks["old checkpoint counts from 0"] and checks["old checkpoint differs"], (tag, checks)
        assert elsewhere and all(elsewhere.values()), elsewhere
    for tag, checks in results[0].items():  # `shardopt convert` reads a folder that holds the count
        if tag.startswith("sharded/"):
            convert_sharded(checks["folder"], checks["folder"] + ".pt")
            weights = torch.load(checks["folder"] + ".pt", weights_only=True)["state_dict"]
            names = [n for n, _ in mlp(F32).named_parameters()]
            assert _equal([weights[n] for n in names], checks["saved"]), tag


# ---------------------------------------------------------------------- worker errors, refusals


def _fail_on_second_step(opt: OSS) -> None:
    """Make the wrapped optimizer's second step (the first delayed one, at delay_update_after=1) raise."""
    inner, calls = opt.optim.step, [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise ValueError("injected failure")
        return inner(*args, **kwargs)

    opt.optim.step = failing  # type: ignore[method-assign]


def _worker_errors(rank: int, world_size: int) -> dict[str, str | bool]:
    """Step 0 ordinary, step 1 delayed and failing on every rank; the failure surfaces at the
    next step() or finish_update()."""
    out: dict[str, str | bool] = {}
    for stage in ("zero1", "zero2"):
        for via in ("step", "finish_update"):
            model = mlp(F32)
            opt, wrapped = _build(stage, model, F32, 1)
            _fail_on_second_step(opt)
            _train(rank, model, wrapped, opt, range(2), F32)
            written = _params(model)
            opt.zero_grad()
            loss_of(wrapped, rank, 2, F32).backward()
            tag = f"{stage}/{via}"
            try:
                opt.step() if via == "step" else opt.finish_update()
                out[tag] = "no error"
            except RuntimeError as exc:
                out[tag] = f"{exc} | cause: {exc.__cause__!r}"
            out[tag + "/parameters keep the update before"] = _equal(_params(model), written)
            opt.finish_update()  # raised once: nothing is pending any more
    return out


def test_a_worker_error_surfaces_at_the_next_wait_on_every_failing_rank() -> None:
    for r in run_ranks(_worker_errors, 2, timeout_s=120):
        for tag in ("zero1/step", "zero1/finish_update", "zero2/step", "zero2/finish_update"):
            assert "the delayed update of step 1 failed on its worker thread: ValueError: injected failure" in r[tag], r
            assert "resume from a checkpoint" in r[tag] and "cause: ValueError('injected failure')" in r[tag], r
            assert r[tag + "/parameters keep the update before"], r


def _one_rank_fails(rank: int, world_size: int) -> None:
    """Rank 1's first delayed step fails; nothing catches the error."""
    model = mlp(F32)
    opt, wrapped = _build("zero2", model, F32, 1)
    if rank == 1:
        _fail_on_second_step(opt)
    _train(rank, model, wrapped, opt, range(3), F32)


def test_a_worker_error_on_one_rank_fails_the_run_instead_of_hanging() -> None:
    with pytest.raises(RankFailure, match=r"\[rank 1\] failed(.|\n)*the delayed update of step 1 failed on its worker "
                       r"thread: ValueError: injected failure"):
        run_ranks(_one_rank_fails, 2, timeout_s=60)


def _refusals(rank: int, world_size: int) -> dict[str, str]:
    out: dict[str, str] = {}
    model = mlp(F32)
    cases: dict[str, dict[str, Any]] = {"no offload": {"delay_update_after": 2},
                                        "negative": {"offload": "cpu", "delay_update_after": -1},
                                        "bool": {"offload": "cpu", "delay_update_after": True},
                                        "float": {"offload": "cpu", "delay_update_after": 1.5},
                                        "disagree": {"offload": "cpu", "delay_update_after": 2 if rank == 0 else None}}
    for name, kwargs in cases.items():
        try:
            OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, **kwargs)
            out[name] = "accepted"
        except (TypeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, offload="cpu", delay_update_after=0)
    try:
        opt.step(closure=lambda: 0.0)
        out["closure"] = "accepted"
    except ValueError as exc:
        out["closure"] = f"ValueError: {exc}"
    return out


def test_bad_delay_update_after_values_closures_and_disagreeing_ranks_are_clear_errors() -> None:
    for r in run_ranks(_refusals, 2, timeout_s=60):
        assert r["no offload"].startswith("ValueError: delay_update_after=2 needs offload='cpu'"), r
        assert "pass OSS(..., offload='cpu', delay_update_after=...) or drop delay_update_after" in r["no offload"], r
        assert r["negative"].startswith("ValueError: delay_update_after must be >= 0"), r
        assert "got -1; pass 0 to delay from the first step, or None" in r["negative"], r
        assert r["bool"].startswith("TypeError: delay_update_after must be an int") and "got bool True" in r["bool"], r
        assert "got float 1.5; pass e.g. delay_update_after=50" in r["float"], r
        assert "delay_update_after" in r["disagree"] and "same OSS arguments on every rank" in r["disagree"], r
        assert r["closure"].startswith("ValueError: OSS(delay_update_after=0).step(closure)"), r
        assert "call step() without a closure" in r["closure"], r
