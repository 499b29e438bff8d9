"""ShardedGradScaler: parity with torch's GradScaler + DDP, and inf/nan on one rank only
makes every rank skip the step and back off (fault injection)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)


def _scaler_run(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for amp_dtype in (torch.bfloat16, torch.float16):
        for wrapper in ("sdp", "ddp"):
            tag = f"{wrapper}/{str(amp_dtype).split('.')[-1]}"
            ref_model, model = seeded_mlp(), seeded_mlp()
            ref = DDP(ref_model)
            ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
            ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
            opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
            wrapped = ShardedDataParallel(model, opt, reduce_buffer_size=50) if wrapper == "sdp" else DDP(model)
            scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=3, device="cpu")
            owned = [p for i, p in enumerate(opt.params) if opt.owns(i)]
            for step in range(7):
                inject = {3: "inf", 5: "nan"}.get(step)
                x = rank_batch(rank, step)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=amp_dtype):
                    loss = wrapped(x).pow(2).mean()
                scaler.scale(loss).backward()
                if inject and rank == world_size - 1 and owned:
                    # Only the last rank sees the bad value, in a gradient only it steps.
                    owned[0].grad.view(-1)[0] = float(inject)  # type: ignore[union-attr]
                before_params = [p.detach().clone() for p in model.parameters()]
                before_state = copy.deepcopy(opt.optim.state_dict()["state"])
                scale_before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                if inject:
                    out[f"{tag}/{inject}/params_unchanged"] = max_abs_diff(before_params, model.parameters()) == 0.0
                    after_state = opt.optim.state_dict()["state"]
                    out[f"{tag}/{inject}/state_unchanged"] = all(
                        torch.equal(before_state[k][n], after_state[k][n])
                        for k in before_state for n in before_state[k]
                    )
                    out[f"{tag}/{inject}/scale_backed_off"] = scaler.get_scale() == scale_before * 0.5
                else:
                    # The reference takes the same clean steps (it never sees the bad values).
                    ref_opt.zero_grad()
                    with torch.autocast("cpu", dtype=amp_dtype):
                        ref_loss = ref(x).pow(2).mean()
                    ref_scaler.scale(ref_loss).backward()
                    ref_scaler.step(ref_opt)
                    ref_scaler.update()
            out[f"{tag}/diff_vs_torch_scaler_ddp"] = max_abs_diff(model.parameters(), ref_model.parameters())
            out[f"{tag}/final_scale"] = scaler.get_scale()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_inf_or_nan_on_one_rank_makes_every_rank_skip_and_back_off(world_size: int) -> None:
    results = run_ranks(_scaler_run, world_size, timeout_s=90)
    print(f"\nworld_size={world_size}: " + ", ".join(f"{k}={v}" for k, v in results[0].items() if "diff" in k))
    for r in results:
        for key, value in r.items():
            if key.endswith(("params_unchanged", "state_unchanged", "scale_backed_off")):
                assert value is True, (key, r)
    for key in results[0]:
        if key.endswith("final_scale"):
            assert len({r[key] for r in results}) == 1, key  # every rank agrees on the scale
        if key.endswith("diff_vs_torch_scaler_ddp"):
            # The reference skipped the two poisoned iterations entirely, as the sharded run
            # did; so the clean steps must match: exactly at 2 ranks, to 1e-6 beyond.
            assert max(r[key] for r in results) <= (0.0 if world_size == 2 else 1e-6), key


def test_scaler_rejects_unknown_device() -> None:
    with pytest.raises(ValueError, match="device must be a device type such as 'cpu' or 'cuda', got 'tpu9'"):
        ShardedGradScaler(device="tpu9")


def test_disabled_scaler_is_a_pass_through() -> None:
    scaler = ShardedGradScaler(enabled=False, device="cpu")
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    assert not scaler.is_enabled()


def test_scaler_rejects_a_process_group_that_is_not_a_group_at_construction() -> None:
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup or None .* got 'world'"):
        ShardedGradScaler(process_group="world", device="cpu")  # type: ignore[arg-type]
