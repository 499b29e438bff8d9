"""No host sync on ZeRO-2's per-step path (Note [host reads per step] in
shardopt/nn/data_parallel/grad_buckets.py), checked on CPU ranks by counting the calls from
shardopt's code that would block the host on a GPU (tests/helpers/host_reads.py), and a scan
of the source for the patterns, so a new one fails CI without a GPU."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS
from shardopt.optim.grad_scaler import ShardedGradScaler
from shardopt.testing import run_ranks
from tests.helpers.data import rank_batch, seeded_mlp
from tests.helpers.host_reads import HostReadAudit
from tests.helpers.masters import loss_of, low_mlp
from tests.helpers.sdp import Branchy

REPO = Path(__file__).resolve().parents[1]


def _build(precision: str) -> tuple[ShardedDataParallel, OSS]:
    if precision == "fp32":
        model = seeded_mlp()
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
    else:
        model = low_mlp()
        opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, master_dtype=torch.float32)
    return ShardedDataParallel(model, opt), opt


def _loss(model: torch.nn.Module, precision: str, rank: int, step: int) -> torch.Tensor:
    if precision == "fp32":
        return model(rank_batch(rank, step)).pow(2).mean()
    return loss_of(model, rank, step)


def _audit(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for precision in ("fp32", "bf16-master"):
        sdp, opt = _build(precision)
        out[f"{precision}/splits"] = len(opt.plan.split_params)  # Adam splits the largest layer from 2 ranks
        for step in range(3):
            opt.zero_grad(set_to_none=step % 2 == 0)
            with HostReadAudit() as audit:
                with sdp.no_sync():
                    _loss(sdp, precision, rank, 10 + step).backward()
                _loss(sdp, precision, rank, step).backward()
            out[f"{precision}/backward{step}"] = audit.hits
            with HostReadAudit() as audit:
                (opt.clip_grad_norm if step % 2 else lambda m: torch.nn.utils.clip_grad_norm_(sdp.parameters(), m))(1.0)
            out[f"{precision}/clip{step}"] = audit.hits
            with HostReadAudit() as audit:
                opt.step()
            if step > 0:  # the first step compares masters with their parameters once
                out[f"{precision}/step{step}"] = audit.hits
        sdp.close()
    # The scaler: torch's one step-or-skip read, no other.
    sdp, opt = _build("fp32")
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8)
    for step in range(2):
        opt.zero_grad()
        scaler.scale(_loss(sdp, "fp32", rank, step)).backward()
        with HostReadAudit() as audit:
            scaler.step(opt)
            scaler.update()
        out[f"scaler{step}"] = audit.hits
    sdp.close()
    # A parameter this rank owns but did not use: one read of the summed flags per backward,
    # on the owner only, and the gradient other ranks sent arrives.
    model = Branchy()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    index = {id(p): i for i, p in enumerate(opt.params)}
    owner = opt.partition.owners[index[id(model.b.weight)]]
    for step in range(2):
        opt.zero_grad()
        with HostReadAudit() as audit:
            sdp(rank_batch(rank, step), use_b=rank != owner).pow(2).mean().backward()
        out[f"unused/backward{step}"] = audit.hits
        out[f"unused/grad{step}"] = None if model.b.weight.grad is None else model.b.weight.grad.abs().sum().item()
        opt.step()
    out["owner"] = owner
    unused_here = [*model.never.parameters(), *(model.b.parameters() if rank == owner else ())]
    out["owns_unused"] = any(opt.partition.owners[index[id(p)]] == rank for p in unused_here)
    sdp.close()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_zero2_backward_and_step_read_nothing_from_the_device_when_every_parameter_is_used(world_size: int) -> None:
    for rank, out in enumerate(run_ranks(_audit, world_size, timeout_s=120)):
        # the audit covers split parameters' rows (Note [split parameters in buckets]) where there are any
        assert all((out[f"{p}/splits"] > 0) == (world_size > 1) for p in ("fp32", "bf16-master")), out
        for key in [k for k in out if "/backward" in k and not k.startswith("unused")] + [
                k for k in out if "/step" in k]:
            assert out[key] == [], (rank, key, out[key])
        for key in [k for k in out if "/clip" in k]:  # which slots any rank counted: at most one read
            # (none at one rank, where torch's own clip runs on the local gradients)
            assert [what for what, _ in out[key]] in ([], ["nonzero", "tolist"]), (rank, key, out[key])
            assert len({where for _, where in out[key]}) <= 1, out[key]  # both on one line
        for key in [k for k in out if k.startswith("scaler")]:  # torch's step-or-skip decision
            assert [what for what, _ in out[key]] == ["item"], (rank, key, out[key])
        # Unused here: exactly one read on a rank that owns such a parameter (none at one rank,
        # where unused here is unused everywhere), none elsewhere.
        expected = 1 if world_size > 1 and out["owns_unused"] else 0
        for step in range(2):
            hits = out[f"unused/backward{step}"]
            assert len(hits) == expected, (rank, hits)
            assert all("reduction_queue.py" in where for _, where in hits), hits
            if rank == out["owner"]:
                grad = out[f"unused/grad{step}"]
                assert (grad is None) if world_size == 1 else (grad is not None and grad > 0), (rank, grad)


def _hybrid_audit(rank: int, world_size: int) -> dict[str, Any]:
    """Hybrid ZeRO-2 (2 groups of 2): a deferred micro-step, a closing one and the step."""
    model = seeded_mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, shard_size=2)
    sdp = ShardedDataParallel(model, opt)
    out: dict[str, Any] = {"splits": len(opt.plan.split_params)}
    for step in range(3):
        opt.zero_grad(set_to_none=step % 2 == 0)
        with HostReadAudit() as audit:
            with sdp.no_replicate_sync():
                _loss(sdp, "fp32", rank, 10 + step).backward()
            _loss(sdp, "fp32", rank, step).backward()
        out[f"backward{step}"] = audit.hits
        with HostReadAudit() as audit:
            opt.step()
        out[f"step{step}"] = audit.hits
    sdp.close()
    return out


@pytest.mark.distributed
def test_hybrid_zero2_backward_and_step_read_nothing_from_the_device_when_every_parameter_is_used() -> None:
    for rank, out in enumerate(run_ranks(_hybrid_audit, 4, timeout_s=120)):
        assert out["splits"] > 0, out  # Adam splits the largest layer inside the shard group
        for key in [k for k in out if k != "splits"]:
            assert out[key] == [], (rank, key, out[key])


# The per-step modules scanned for host reads; a documented one carries "host-read:" and a reason.
SCANNED = ("shardopt/nn/data_parallel", "shardopt/optim", "shardopt/comm.py", "shardopt/clipping.py",
           "shardopt/placeholders.py", "shardopt/streams.py")
READ_METHODS = {"item", "tolist", "nonzero", "synchronize"}  # synchronize: an event's or a stream's host wait


def _host_reads_in(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    found = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        what = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr in READ_METHODS:
                what = f".{func.attr}()"
            elif func.attr == "equal" and isinstance(func.value, ast.Name) and func.value.id == "torch":
                what = "torch.equal"
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
              and type(node.value.value) in (int, float)):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and not (
                        isinstance(target.slice, ast.Constant) and isinstance(target.slice.value, str)):
                    what = "t[i] = number"
        if what and "host-read:" not in lines[node.lineno - 1]:
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
            found.append(f"{where}:{node.lineno}: {what}: {lines[node.lineno - 1].strip()}")
    return found


def test_per_step_modules_have_no_undocumented_host_read() -> None:
    found = []
    for root in SCANNED:
        path = REPO / root
        for f in [path] if path.is_file() else sorted(path.rglob("*.py")):
            found += _host_reads_in(f)
    assert found == [], "a host read on a per-step path (Note [host reads per step]):\n" + "\n".join(found)


def test_the_scan_finds_each_pattern(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("t[3] = 1\nx = t.item()\ny = t.tolist()  # host-read: documented\nz = torch.equal(a, b)\n"
                      "d['key'] = 0\nevent.synchronize()\n")
    found = _host_reads_in(sample)
    assert [f.split(": ")[1] for f in found] == ["t[i] = number", ".item()", "torch.equal", ".synchronize()"], found
