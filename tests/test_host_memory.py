"""Host buffers placed for the host step (Note [host buffer placement] in shardopt.host_memory):
each large buffer starts at its slot's offset within a 4 KiB page, is backed by huge pages
where the kernel allows it, has a storage of exactly its bytes that lives as long as a view of
it, and is seen by dispatch modes; an offloaded OSS's masters, gradient buffer and flat Adam
state are placed (the state once, after the step that created it, or after a load) and its
training equals the same run on torch's own allocations bit for bit (the same kernels over
the same values in the same order; only the addresses differ).
"""

from __future__ import annotations

import gc
import mmap
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardopt.host_memory as host_memory
from shardopt import memory
from shardopt.app.storage_trace import StorageTracker
from shardopt.host_memory import SLOT_OFFSETS, host_empty, is_placed, place_state, placed_bytes
from shardopt.optim import OSS
from shardopt.testing import run_ranks

F32 = torch.float32
BIG = 600_000  # 2.4 MB of fp32, 1.2 MB of bf16: over MIN_PLACED_BYTES


def _mappings() -> list[tuple[int, int, dict[str, int]]]:
    """``/proc/self/smaps`` as (start, end, {field: kB})."""
    out: list[tuple[int, int, dict[str, int]]] = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            out.append((start, end, {}))
        elif head.endswith(":") and len(line.split()) >= 2 and line.split()[1].isdigit():
            out[-1][2][head[:-1]] = int(line.split()[1])
    return out


def _mapping_of(address: int) -> dict[str, int] | None:
    return next((fields for start, end, fields in _mappings() if start <= address < end), None)


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[")[1].split("]")[0]


def test_each_slot_starts_at_its_offset_with_a_storage_of_exactly_its_bytes() -> None:
    if sys.platform != "linux":
        pytest.skip("placement maps memory with POSIX mmap flags")
    for slot in range(len(SLOT_OFFSETS) + 2):
        for dtype in (F32, torch.bfloat16):
            t = host_empty(BIG, dtype, slot)
            assert t.shape == (BIG,) and t.dtype == dtype and t.storage_offset() == 0
            assert t.data_ptr() % 4096 == SLOT_OFFSETS[slot % len(SLOT_OFFSETS)], (slot, dtype, t.data_ptr() % 4096)
            assert t.untyped_storage().nbytes() == BIG * dtype.itemsize
            assert is_placed(t) and not is_placed(t[1:])
    small = host_empty(1000, F32, 3)  # under MIN_PLACED_BYTES: torch's own
    assert small.untyped_storage().nbytes() == 4000 and not is_placed(small)
    assert not is_placed(torch.empty(BIG))


def _control_huge_kb(nbytes: int) -> int:
    """AnonHugePages (kB) of a private anonymous mapping advised directly: what the kernel gives now."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    view = torch.frombuffer(mapping, dtype=torch.uint8)
    view.fill_(1)
    kb = (_mapping_of(view.data_ptr()) or {}).get("AnonHugePages", 0)
    del view
    mapping.close()
    return kb


def test_huge_pages_back_a_large_buffer_where_the_kernel_allows_them() -> None:
    if sys.platform != "linux" or _thp_mode() not in ("always", "madvise") or not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip(f"transparent huge pages unavailable (mode {_thp_mode()!r})")
    t = host_empty(16 << 20, F32, 1)  # 64 MiB
    t.fill_(1.0)  # the first touch faults the pages in, huge where advised
    huge_kb = (_mapping_of(t.data_ptr()) or {}).get("AnonHugePages", 0)
    if huge_kb == 0 and _control_huge_kb(64 << 20) == 0:
        pytest.skip("the kernel has no free huge page now (a control mapping advised directly got none either)")
    assert huge_kb >= 32 * 1024, huge_kb  # at least half of the 64 MiB on 2 MiB pages
    if _thp_mode() == "madvise":  # the control: torch's own allocation stays on 4 KiB pages
        plain = torch.empty(16 << 20)
        plain.fill_(1.0)
        assert (_mapping_of(plain.data_ptr()) or {}).get("AnonHugePages", 0) == 0


def test_a_placed_buffer_lives_as_long_as_a_view_and_is_unmapped_after() -> None:
    if sys.platform != "linux":
        pytest.skip("reads /proc/self/smaps")
    t = host_empty(BIG, F32, 2)
    t.copy_(torch.arange(BIG, dtype=F32))
    address = t.data_ptr()
    view = t[10:20]
    del t
    gc.collect()
    assert _mapping_of(address) is not None and view.tolist() == [float(x) for x in range(10, 20)]
    assert host_memory._placed and address in host_memory._placed
    del view
    gc.collect()
    assert _mapping_of(address) is None and address not in host_memory._placed


def test_place_state_moves_each_matching_tensor_once_and_keeps_its_values() -> None:
    if sys.platform != "linux":
        pytest.skip("placement maps memory with POSIX mmap flags")
    like = torch.empty(BIG)
    moments = torch.randn(BIG), torch.randn(BIG).abs()
    state: dict[str, Any] = {"step": torch.tensor(3.0), "exp_avg": moments[0].clone(),
                             "exp_avg_sq": moments[1].clone(), "other": torch.randn(7), "lr": 0.1}
    place_state(state, like, first_slot=2)
    assert is_placed(state["exp_avg"]) and is_placed(state["exp_avg_sq"])
    assert state["exp_avg"].data_ptr() % 4096 == SLOT_OFFSETS[2]
    assert state["exp_avg_sq"].data_ptr() % 4096 == SLOT_OFFSETS[3]
    assert torch.equal(state["exp_avg"], moments[0]) and torch.equal(state["exp_avg_sq"], moments[1])
    assert not is_placed(state["step"]) and state["lr"] == 0.1 and state["other"].numel() == 7
    placed = dict(state)
    place_state(state, like, first_slot=2)  # already placed: nothing moves
    assert all(state[k] is placed[k] for k in state)


def test_a_dispatch_mode_counts_a_placed_buffer_as_torch_allocations() -> None:
    """``shardopt rehearse`` measures host memory with a dispatch-mode tracker: a placed buffer
    must count as what it is (its exact bytes), like ``torch.empty``."""
    with StorageTracker("cpu") as tracker:
        before = tracker.live_bytes
        kept = host_empty(BIG, F32, 1)
        assert tracker.live_bytes - before == BIG * 4
        del kept
        gc.collect()
        assert tracker.live_bytes == before


def test_heap_readings_count_placed_buffers_as_torchs_own() -> None:
    """The bench's per-rank host memory (heap_bytes) must see a placed buffer as it sees torch.empty's."""
    if memory.heap_bytes() is None:
        pytest.skip("heap readings need glibc's mallinfo2")
    before = memory.heap_bytes()
    kept = host_empty(BIG, F32, 1)
    slack = 64 << 10  # Python's own small allocations between the readings (the finalizer, the tensor object)
    assert BIG * 4 <= memory.heap_bytes() - before < BIG * 4 + slack and placed_bytes() >= BIG * 4
    del kept
    gc.collect()
    assert abs(memory.heap_bytes() - before) < slack


def _model() -> nn.Module:
    torch.manual_seed(0)  # 2 x 262,144 + 2 x 512 aligned fp32 elements: a 2.1 MB flat group
    return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512))


def _train(placed: bool, delay: int | None) -> tuple[list[torch.Tensor], dict[str, Any], dict[str, bool]]:
    host_memory.MIN_PLACED_BYTES = 1 << 20 if placed else 1 << 62
    model = _model()
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True, offload="cpu",
              delay_update_after=delay)
    seen: dict[str, bool] = {}
    first: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        opt.zero_grad()
        model(torch.randn(16, 512, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.finish_update()
        flat_state = next(iter(opt.optim.state.values()))
        if step == 0:
            first = {k: v for k, v in flat_state.items() if v.numel() > 1}
        if step == 2:  # placed once: the same tensors two steps later
            seen["placed_once"] = set(first) == {"exp_avg", "exp_avg_sq"} and all(flat_state[k] is v
                                                                                 for k, v in first.items())
        if step == 3:  # a load replaces the state with torch's tensors: the next step places them again
            opt.consolidate_state_dict(0)
            opt.load_state_dict(opt.state_dict())
            seen["load_unplaced"] = not any(is_placed(v) for v in next(iter(opt.optim.state.values())).values())
    flat_state = next(iter(opt.optim.state.values()))
    seen["state_placed"] = all(is_placed(v) for k, v in flat_state.items() if k != "step")
    seen["buffers_placed"] = all(is_placed(t) for t in opt.offloaded_buffers())
    host_memory.MIN_PLACED_BYTES = 1 << 20
    opt.consolidate_state_dict(0)
    return [p.detach().clone() for p in model.parameters()], opt.state_dict(), seen


def _placed_vs_unplaced(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for delay in (None, 0):
        params, state, seen = _train(True, delay)
        ref_params, ref_state, ref_seen = _train(False, delay)
        out[f"delay={delay}"] = {
            "params": all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True)),
            "state": all(torch.equal(a[k], b[k]) for a, b in zip(state["state"].values(), ref_state["state"].values(),
                                                                  strict=True) for k in a),
            "placed": seen, "unplaced": ref_seen}
    return out


@pytest.mark.distributed
def test_offloaded_training_on_placed_buffers_equals_torchs_allocations_bit_for_bit() -> None:
    if sys.platform != "linux":
        pytest.skip("placement maps memory with POSIX mmap flags")
    for delay, r in run_ranks(_placed_vs_unplaced, 1, timeout_s=180)[0].items():
        assert r["params"] and r["state"], (delay, r)
        assert all(r["placed"].values()), (delay, r["placed"])
        assert r["unplaced"]["load_unplaced"] and not r["unplaced"]["state_placed"], (delay, r["unplaced"])
