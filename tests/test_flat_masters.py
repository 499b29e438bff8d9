"""Flat master buffers (Note [flat masters] in shardopt.optim.flat_masters): the flat step
equals today's per-parameter masters bit for bit (parameters, masters and every optimizer
state tensor), a group falls back to per-parameter views exactly when some of its masters
have no gradient, checkpoints keep one entry per parameter, the optimizer's kernels per
step do not grow with the number of parameters, and ShardedDataParallel's reduced gradients
land in the gradient buffer in one copy per bucket (Note [one copy per bucket]).

The reference is :class:`~tests.helpers.masters.MasterReference`: one fp32 master tensor per
parameter under the same torch optimizer, stepped on the same reduced gradients (DDP's own
sums for ZeRO-1, ShardedDataParallel's rank-order arithmetic for ZeRO-2), which is what the
per-parameter layout computed bit for bit (tests/test_oss_masters.py,
tests/test_sharded_ddp_masters.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt import checkpoint, comm
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler
from shardopt.testing import run_ranks
from tests.helpers.kernels import aten_calls, optimizer_kernels, writes_into
from tests.helpers.masters import MasterReference, loss_of, sdp_reduce

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam/default": (torch.optim.Adam, {"lr": 1e-2}),
    "adam/foreach": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "foreach": True}),
    "adam/fused": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01, "fused": True}),
    "adamw/foreach": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    "adamw/fused": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    "sgd_momentum/foreach": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "foreach": True}),
    "sgd_momentum/fused": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}),
}


def flat_mlp(seed: int = 0, dtype: torch.dtype = BF16) -> nn.Module:
    """Weights and biases of multiples of 64 elements (stepped flat) and two that are not
    (a bias of 48 and one of 4: stepped as views, Note [aligned segments])."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 4)).to(dtype)


def _steps_flat(opt: OSS) -> bool:
    """Whether the wrapped optimizer steps a tensor that is no single master (a flat one)."""
    masters = [m for m in (opt.master_of(p) for p in opt.params) if m is not None]
    return any(all(t is not m for m in masters) for g in opt.optim.param_groups for t in g["params"])


def _state_equal(opt: OSS, ref: MasterReference) -> bool:
    """Every parameter's optimizer state and master, consolidated, equals the reference's."""
    ours = opt.state_dict(all_ranks=True)["state"]
    theirs = ref.opt.state_dict()["state"]
    if {i for i, s in ours.items() if set(s) - {"master"}} != set(theirs):
        return False
    for i, entry in ours.items():
        if not torch.equal(entry["master"], ref.masters[i].detach()):
            return False
        for name, value in theirs.get(i, {}).items():
            if not torch.equal(torch.as_tensor(entry[name]), torch.as_tensor(value)):
                return False
    return True


def _compact(opt: OSS) -> bool:
    """Every tensor of the consolidated state owns its storage: a view of a flat buffer would
    carry the whole buffer into a pickle or a file (Note [flat masters])."""
    return all(v.untyped_storage().nbytes() == v.numel() * v.element_size()
               for s in opt.state_dict(all_ranks=True)["state"].values() for v in s.values()
               if isinstance(v, torch.Tensor))


def _build(stage: str, model: nn.Module, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]
           ) -> tuple[OSS, nn.Module]:
    opt = OSS(model.parameters(), optim=cls, master_dtype=F32, **kwargs)
    return opt, (DDP(model) if stage == "zero1" else ShardedDataParallel(model, opt))


def _round_trip(stage: str, model: nn.Module, opt: OSS, wrapped: nn.Module, cls: type[torch.optim.Optimizer],
                kwargs: dict[str, Any], path: str) -> tuple[nn.Module, OSS, nn.Module]:
    """Save, then go on with a fresh model and optimizer that load everything from the file."""
    if stage == "zero1":
        checkpoint.save_consolidated(path + ".pt", model, opt)
    else:
        checkpoint.save_sharded(path, model, opt)
    fresh = flat_mlp(seed=5)
    fresh_opt, fresh_wrapped = _build(stage, fresh, cls, {**kwargs, "lr": 0.5})
    (checkpoint.load_consolidated if stage == "zero1" else checkpoint.load_sharded)(
        path + ".pt" if stage == "zero1" else path, fresh, fresh_opt)
    return fresh, fresh_opt, fresh_wrapped


def _equality(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in ("zero1", "zero2"):
        for opt_name, (cls, kwargs) in OPTIMIZERS.items():
            for mode in ("plain", "accumulate", "clip", "checkpoint"):
                tag = f"{stage}/{opt_name}/{mode}"
                model = flat_mlp()
                opt, wrapped = _build(stage, model, cls, kwargs)
                ref = MasterReference(flat_mlp(), cls, **kwargs)
                flat, norms = False, True
                micro = 2 if mode == "accumulate" else 1
                for step in range(5):
                    if mode == "checkpoint" and step == 3:
                        model, opt, wrapped = _round_trip(stage, model, opt, wrapped, cls, kwargs, f"{folder}/{tag}")
                    opt.zero_grad(set_to_none=step % 2 == 0)
                    for k in range(micro):
                        loss_of(wrapped, rank, 10 * step + k).backward()
                        if stage == "zero2":
                            per_rank = [ref.local_grads(lambda m, r=r, s=10 * step + k: loss_of(m, r, s))
                                        for r in range(world_size)]
                            ref.add_master_grads([sdp_reduce(list(g), F32) for g in zip(*per_rank, strict=True)])
                    if stage == "zero1":  # the reference steps on DDP's own sums
                        ref.add_master_grads([p.grad.float() for p in model.parameters()])  # type: ignore[union-attr]
                    if mode == "clip":  # the reference is clipped by OSS's total norm: a split parameter's
                        # norm is the norm of its blocks' norms, which may differ from torch's in its last bit
                        total = opt.clip_grad_norm(0.05)
                        norms &= total.dtype == F32 and bool(torch.isclose(  # the norm of fp32 master gradients
                            total, torch.nn.utils.get_total_norm([m.grad for m in ref.masters]), rtol=1e-6, atol=0))
                        torch._foreach_mul_([m.grad for m in ref.masters], torch.clamp(0.05 / (total + 1e-6), max=1.0))
                    opt.step()
                    ref.step()
                    flat |= _steps_flat(opt)
                out[tag] = {"params": all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.params, strict=True)),
                            "state": _state_equal(opt, ref), "norms": norms, "flat": flat, "compact": _compact(opt)}
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_flat_masters_equal_per_parameter_masters_bit_for_bit(world_size: int, tmp_path: Any) -> None:
    results = run_ranks(_equality, world_size, str(tmp_path), timeout_s=300)
    for tag in results[0]:
        for key in ("params", "state", "norms", "compact"):
            assert all(r[tag][key] for r in results), (tag, key, [r[tag] for r in results])
        assert any(r[tag]["flat"] for r in results), (tag, "no rank stepped a flat tensor")


def _scaler(rank: int, world_size: int) -> dict[str, Any]:
    """fp16 parameters, fp32 masters, ShardedGradScaler; an inf in one rank's owned gradient at
    step 3 (every rank skips, the masters' gradients are dropped, the next step is flat again)."""
    out: dict[str, Any] = {}
    for stage in ("zero1", "zero2"):
        for opt_name in ("adam/foreach", "adamw/fused"):
            cls, kwargs = OPTIMIZERS[opt_name]
            model = flat_mlp(dtype=F16)
            opt, wrapped = _build(stage, model, cls, kwargs)
            scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=2, device="cpu")
            ref = MasterReference(flat_mlp(dtype=F16), cls, **kwargs)
            owned = [p for i, p in enumerate(opt.params) if opt.owns(i)]
            flat = False
            for step in range(6):
                opt.zero_grad()
                scale = scaler.get_scale()
                scaler.scale(loss_of(wrapped, rank, step, F16)).backward()
                reduced = [p.grad.float() for p in model.parameters()] if stage == "zero1" else []  # type: ignore[union-attr]
                if step == 3 and rank == world_size - 1 and owned:
                    master = opt.master_of(owned[0])
                    assert master is not None
                    target = master.grad if master.grad is not None else owned[0].grad
                    target.view(-1)[0] = float("inf")  # type: ignore[union-attr]
                scaler.step(opt)
                scaler.update()
                flat |= _steps_flat(opt)
                if step == 3:
                    continue  # skipped everywhere
                if stage == "zero2":
                    per_rank = [ref.local_grads(lambda m, r=r, s=step, k=scale: loss_of(m, r, s, F16) * k)
                                for r in range(world_size)]
                    reduced = [sdp_reduce(list(g), F32) for g in zip(*per_rank, strict=True)]
                ref.add_master_grads([g * (1.0 / scale) for g in reduced])
                ref.step()
            out[f"{stage}/{opt_name}"] = {
                "params": all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.params, strict=True)),
                "state": _state_equal(opt, ref), "flat": flat, "scale": scaler.get_scale()}
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_flat_masters_under_sharded_grad_scaler_equal_per_parameter_masters(world_size: int) -> None:
    results = run_ranks(_scaler, world_size, timeout_s=180)
    for tag in results[0]:
        assert all(r[tag]["params"] and r[tag]["state"] for r in results), (tag, [r[tag] for r in results])
        assert any(r[tag]["flat"] for r in results), tag
        assert len({r[tag]["scale"] for r in results}) == 1, tag


class _Forked(nn.Module):
    """A trunk and two heads of 64 x 64 (aligned); ``b`` is used only when asked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(8, 64)
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.to(BF16)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = F.relu(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def _forked_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * step + rank)).to(BF16)
    return model(x, use_b=step != 2).float().pow(2).mean()


def _missing_grads(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Head ``b`` is unused at step 2: torch skips its masters there (no step count, no moment
    decay), and so must the flat layout, which falls back to views; Adam's state then has two
    step counts, and a checkpoint of it loads as views and goes on equal."""
    out: dict[str, Any] = {}
    for stage in ("zero1", "zero2"):
        for opt_name in ("adam/default", "adamw/fused", "sgd_momentum/foreach"):
            cls, kwargs = OPTIMIZERS[opt_name]
            model = _Forked()
            opt = OSS(model.parameters(), optim=cls, master_dtype=F32, **kwargs)
            wrapped: Callable[..., Any] = model if stage == "zero1" else ShardedDataParallel(model, opt)
            ref_model = _Forked()
            ref = MasterReference(ref_model, cls, **kwargs)
            flat_before = False
            for step in range(6):
                if step == 4:  # a checkpoint of the mixed state: loaded into a fresh OSS, which goes on
                    opt.consolidate_state_dict(recipient_rank=-1)
                    saved = copy.deepcopy(opt.state_dict())
                    weights = copy.deepcopy(model.state_dict())
                    model = _Forked()
                    opt = OSS(model.parameters(), optim=cls, master_dtype=F32, **kwargs)
                    wrapped = model if stage == "zero1" else ShardedDataParallel(model, opt)
                    model.load_state_dict(weights)
                    opt.load_state_dict(saved)
                opt.zero_grad()
                _forked_loss(wrapped, rank, step).backward()  # type: ignore[arg-type]
                if stage == "zero1":  # DDP's average, one parameter at a time; None where unused
                    for p in model.parameters():
                        if p.grad is not None:
                            comm.all_reduce(p.grad, None).wait()
                            p.grad.mul_(1.0 / world_size)
                    grads = [None if p.grad is None else p.grad.float() for p in model.parameters()]
                else:
                    per_rank = [torch.autograd.grad(_forked_loss(ref_model, r, step), ref.params, allow_unused=True)
                                for r in range(world_size)]
                    grads = [None if g[0] is None else sdp_reduce(list(g), F32) for g in zip(*per_rank, strict=True)]
                for m, g in zip(ref.masters, grads, strict=True):
                    m.grad = g
                if step < 2:
                    flat_before |= _steps_flat(opt)
                opt.step()
                ref.step()
            out[f"{stage}/{opt_name}"] = {
                "params": all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.params, strict=True)),
                "state": _state_equal(opt, ref), "flat_before": flat_before, "views_after": not _steps_flat(opt)}
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_master_without_gradient_is_skipped_as_torch_does_and_its_group_falls_back_to_views(
        world_size: int, tmp_path: Any) -> None:
    results = run_ranks(_missing_grads, world_size, str(tmp_path), timeout_s=180)
    for tag in results[0]:
        assert all(r[tag]["params"] and r[tag]["state"] for r in results), (tag, [r[tag] for r in results])
        assert any(r[tag]["flat_before"] for r in results), tag
        # Adam's skipped masters count one step fewer: views for good. SGD keeps no step count, so
        # its loaded state agrees again and the group is flat again.
        assert all(r[tag]["views_after"] == ("sgd" not in tag) for r in results), tag


def _ragged(rank: int, world_size: int) -> dict[str, bool]:
    """Many parameters of sizes that are no multiple of 64 among aligned ones, fused kernels:
    a ragged parameter's tail inside a flat tensor would take the vector path (measured: 1 and
    7 elements of 43,591 differ for fused Adam and SGD, Note [aligned segments])."""
    gen = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1, 300, (40,), generator=gen)] + [64 * 37, 37 * 1001]
    out = {}
    for opt_name in ("adam/fused", "sgd_momentum/fused", "adamw/foreach"):
        cls, kwargs = OPTIMIZERS[opt_name]
        params = [nn.Parameter(torch.randn(n, generator=gen).to(BF16)) for n in sizes]
        opt = OSS(params, optim=cls, master_dtype=F32, **kwargs)
        masters = [p.detach().float().requires_grad_() for p in params]
        ref = cls(masters, **kwargs)
        for _ in range(6):
            grads = [torch.randn(n, generator=gen).to(BF16) for n in sizes]
            for p, m, g in zip(params, masters, grads, strict=True):
                p.grad, m.grad = g.clone(), g.float()
            opt.step()
            ref.step()
        out[opt_name] = all(torch.equal(opt.master_of(p), m) for p, m in zip(params, masters, strict=True)) and _steps_flat(opt)
    return out


def test_segments_of_no_multiple_of_64_elements_are_stepped_as_views_and_stay_exact_under_fused_kernels() -> None:
    results = run_ranks(_ragged, 1, timeout_s=120)
    assert all(results[0].values()), results


def _matrix_wise(rank: int, world_size: int) -> dict[str, bool]:
    """Adafactor reads whole matrices: its masters are views of the buffer, stepped one per
    parameter with the parameter's shape, and the run equals per-parameter masters."""
    model = flat_mlp()
    opt, ddp = _build("zero1", model, torch.optim.Adafactor, {"lr": 1e-2})
    ref = MasterReference(flat_mlp(), torch.optim.Adafactor, lr=1e-2)
    for step in range(4):
        opt.zero_grad()
        loss_of(ddp, rank, step).backward()
        ref.add_master_grads([p.grad.float() for p in model.parameters()])  # type: ignore[union-attr]
        opt.step()
        ref.step()
    masters = [m for m in (opt.master_of(p) for p in opt.params) if m is not None]
    stepped = [t for g in opt.optim.param_groups for t in g["params"]]
    return {"views": len(stepped) == len(masters) and all(any(t is m for m in masters) for t in stepped),
            "params": all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.params, strict=True)),
            "state": _state_equal(opt, ref)}


def test_a_matrix_wise_optimizer_steps_each_master_as_a_view_of_the_buffer_and_equals_per_parameter_masters() -> None:
    results = run_ranks(_matrix_wise, 2, timeout_s=120)
    assert all(all(r.values()) for r in results), results


# ---------------------------------------------------------------------- host work per step


def _deep(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)]).to(BF16)


def _kernel_counts(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for opt_name in ("adam/default", "adam/foreach", "adam/fused", "sgd_momentum/foreach"):
        cls, kwargs = OPTIMIZERS[opt_name]
        for layers in (8, 64):
            model = _deep(layers)
            opt = OSS(model.parameters(), optim=cls, master_dtype=F32, **kwargs)
            counts = []
            for _ in range(3):  # the first step creates the state
                opt.zero_grad()
                model(torch.randn(4, 64).to(BF16)).float().pow(2).mean().backward()
                counts.append(optimizer_kernels(opt.step, cls))
            # The per-parameter layout: what OSS stepped before flat masters, for the control below.
            masters = [p.detach().float().requires_grad_() for p in model.parameters()]
            per_param = cls(masters, **kwargs)
            for _ in range(2):
                for m in masters:
                    m.grad = torch.ones_like(m)
                per_param_count = optimizer_kernels(per_param.step, cls)
            out[f"{opt_name}/{layers}"] = (counts[-1], per_param_count)
    return out


def test_optimizer_kernels_per_step_do_not_grow_with_the_number_of_parameters() -> None:
    counts = run_ranks(_kernel_counts, 1, timeout_s=180)[0]
    print(f"\noptimizer aten calls per step (flat masters, per-parameter masters): {counts}")
    for opt_name in ("adam/default", "adam/foreach", "adam/fused", "sgd_momentum/foreach"):
        (flat8, per8), (flat64, per64) = counts[f"{opt_name}/8"], counts[f"{opt_name}/64"]
        assert flat8 == flat64 > 0, (opt_name, flat8, flat64)
        # The counter sees per-tensor work: the per-parameter layout grows with the layers.
        assert per64 > per8 and per64 > flat64, (opt_name, per8, per64)


def _landing_writes(rank: int, world_size: int) -> dict[str, Any]:
    """Writes into the masters' gradient buffer per backward pass under ShardedDataParallel, for
    models of 8 and 64 layers (every parameter aligned), in one bucket and in buckets of 3 layers."""
    out: dict[str, Any] = {}
    for offload in (None, "cpu"):
        for cap in (2**23, 3 * (64 * 64 + 64)):
            for layers in (8, 64):
                model = _deep(layers)
                opt = OSS(model.parameters(), optim=torch.optim.Adam, master_dtype=F32, offload=offload, lr=1e-2)
                sdp = ShardedDataParallel(model, opt, reduce_buffer_size=cap)

                def master_grads() -> list[torch.Tensor]:
                    found = (opt.master_of(p) for p in model.parameters())
                    return [m.grad for m in found if m is not None and m.grad is not None]

                counts = []
                for step in range(2):
                    opt.zero_grad()
                    for k in range(2):  # the second backward pass adds to the first (no no_sync)
                        torch.manual_seed(100 * rank + 10 * step + k)
                        loss = sdp(torch.randn(4, 64).to(BF16)).float().pow(2).mean()
                        counts.append(writes_into(loss.backward, master_grads))
                    opt.step()
                buckets = -(-layers // 3) if cap < 2**23 else 1
                out[f"{offload}/{'one bucket' if cap == 2**23 else 'buckets'}/{layers}"] = (counts, buckets)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_reduced_gradients_land_in_one_copy_per_bucket_not_one_per_parameter(world_size: int) -> None:
    results = run_ranks(_landing_writes, world_size, timeout_s=240)
    print(f"\nwrites into the master gradient buffer per backward pass, rank 0: {results[0]}")
    for rank, result in enumerate(results):
        for tag, (counts, buckets) in result.items():
            # Note [one copy per bucket]: each bucket's owned part is one run of the buffer, so one copy (first
            # backward pass) or one addition (second) per bucket whatever the layers; one per parameter would
            # give this rank's share of 16 or 128 parameters.
            assert all(1 <= c <= buckets for c in counts), (rank, tag, counts, buckets)
            if buckets == 1:
                assert counts == [1] * len(counts), (rank, tag, counts)


def _one_rank_landing(rank: int, world_size: int) -> dict[str, Any]:
    """At one rank ShardedDataParallel hands autograd's bf16 gradients straight to the masters."""
    out: dict[str, Any] = {}
    for offload in (None, "cpu"):
        model = _deep(8)
        opt = OSS(model.parameters(), optim=torch.optim.Adam, master_dtype=F32, offload=offload, lr=1e-2)
        sdp = ShardedDataParallel(model, opt)
        casts, exact = [], True
        grads: dict[torch.Tensor, torch.Tensor] = {}
        for p in model.parameters():  # autograd's own bf16 gradient, as the queue receives it
            p.register_hook(lambda g, p=p: grads.__setitem__(p, g.clone()))
        for step in range(2):
            opt.zero_grad()
            loss = sdp(torch.randn(4, 64).to(BF16)).pow(2).mean()  # in bf16: backward casts nothing itself
            casts.append(aten_calls(loss.backward, "aten::_to_copy"))
            exact &= all(torch.equal(opt.master_of(p).grad, grads[p].float()) for p in model.parameters())
            opt.step()
        out[str(offload)] = {"casts": casts, "exact": exact}
        sdp.close()
    return out


def test_at_one_rank_bf16_gradients_land_in_the_fp32_buffer_without_a_temporary_per_parameter() -> None:
    # Note [one rank passes gradients through]: the copy into the master's segment widens each
    # gradient (exactly); an fp32 temporary per parameter (a _to_copy each) was made before.
    (out,) = run_ranks(_one_rank_landing, 1, timeout_s=120)
    for offload, result in out.items():
        assert result["casts"] == [0, 0] and result["exact"], (offload, result)
