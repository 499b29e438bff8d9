"""shardopt.memory: the ZeRO paper's numbers, and measurements that read what really happened."""

from __future__ import annotations

import time

import pytest
import torch

from shardopt import memory
from shardopt.app.shapes import SHAPE_PRESETS
from shardopt.testing import run_ranks

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)

MiB = 2**20


def test_estimate_reproduces_zero_paper_example() -> None:
    est = memory.estimate_model_states(7_500_000_000, 64)  # mixed-precision Adam, K=12
    got = [round(v / 1e9, 1) for v in (est.ddp, est.stage1, est.stage2, est.stage3)]
    assert got == [120.0, 31.4, 16.6, 1.9]


def test_estimate_fp32_uses_four_byte_params_and_k8() -> None:
    est = memory.estimate_model_states(1000, 4, mixed_precision=False)
    assert (est.ddp, est.stage1, est.stage2, est.stage3) == (16000, 8000 + 2000, 4000 + 3000, 4000)
    custom = memory.estimate_model_states(1000, 1, optimizer_bytes_per_param=0)
    assert custom.ddp == custom.stage1 == custom.stage2 == custom.stage3 == 4000


def test_estimate_counts_fp32_master_gradients_during_the_step() -> None:
    # ZeRO-2 with fp32 masters: the owner's gradient share is fp32 (4 bytes) from the reduction to the end of
    # the step, where the paper counts 2: 2 Psi + (4 + 12) Psi / N, and ZeRO-1 4 Psi + (12 + 4 - 2) Psi / N
    est = memory.estimate_model_states(7_500_000_000, 64)
    assert (round(est.stage1_at_step / 1e9, 2), round(est.stage2_at_step / 1e9, 3)) == (31.64, 16.875)
    assert est.master_grad_bytes == 4 and est.as_dict()["stage2_at_step_bytes"] == est.stage2_at_step
    small = memory.estimate_model_states(1000, 4)
    assert (small.stage1_at_step, small.stage2_at_step) == (4000 + 3500, 2000 + 4000)
    fp32 = memory.estimate_model_states(1000, 4, mixed_precision=False)
    assert fp32.master_grad_bytes is None
    assert (fp32.stage1_at_step, fp32.stage2_at_step) == (fp32.stage1, fp32.stage2)


def test_estimate_offload_with_the_delayed_update_adds_4_bytes_per_owned_parameter_to_zero1_and_zero2_offload() -> None:
    for mixed in (True, False):
        plain, delayed = memory.estimate_offload(8, mixed), memory.estimate_offload(8, mixed, delayed_update=True)
        for a, b in zip(plain, delayed, strict=True):
            copy = a.offload and a.stage in ("ZeRO-1", "ZeRO-2")  # ZeRO-3's offload keeps no OSS
            assert (b.host, b.host_peak, b.delayed_update) == ((a.host + 4 / 8, a.host_peak + 4 / 8, True) if copy
                                                               else (a.host, a.host_peak, False)), (a, b)
            assert (b.stage, b.offload, b.device, b.world_size) == (a.stage, a.offload, a.device, a.world_size)
        assert next(r for r in delayed if r.stage == "ZeRO-2" and r.offload).host == 20 / 8
        assert next(r for r in delayed if r.stage == "ZeRO-1" and r.offload).as_dict()["delayed_update"] is True


def test_estimate_rejects_bad_inputs_with_the_value() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        memory.estimate_model_states(10, 0)
    with pytest.raises(ValueError, match="num_params must be >= 1, got 0"):
        memory.estimate_model_states(0, 2)
    with pytest.raises(ValueError, match="optimizer_bytes_per_param must be >= 0"):
        memory.estimate_model_states(10, 2, optimizer_bytes_per_param=-1)


def test_llama3_8b_whole_parameter_plan_is_4_19_16_7_67x_off_and_the_split_plan_within_1_05() -> None:
    shapes = SHAPE_PRESETS["llama3-8b"].shapes()
    # a rough count gives 4.19x, 16.8x and 67x: the heaviest rank holds a whole 525M-parameter embedding
    # (16.747x at 256 ranks); the row-split plan cuts it and the head (and at 256+ ranks the MLPs) by rows
    for ranks, unsplit in ((64, 4.19), (256, 16.75), (1024, 66.99)):
        plan = memory.estimate_plans(shapes, ranks)
        assert round(plan.unsplit_imbalance, 2) == unsplit, (ranks, plan.unsplit_imbalance)
        assert plan.split_imbalance <= 1.05, (ranks, plan.split_imbalance)
        assert plan.unsplit_heaviest_params == 128256 * 4096
        # ZeRO-2, mixed: 2 bytes replicated + 14 on the heaviest rank's own parameters
        assert plan.stage2(False) == 2 * 8_030_261_248 + 14 * 128256 * 4096
        assert plan.stage2(True) <= 1.05 * plan.formula.stage2
    at_1024 = memory.estimate_plans(shapes, 1024)
    assert round(at_1024.formula.stage2 / 1e9, 1) == 16.2 and round(at_1024.stage2(False) / 1e9, 1) == 23.4


def test_plan_estimate_counts_the_heaviest_ranks_own_parameters() -> None:
    # 3 ranks, a 6x64 matrix and two 128-element vectors (640 parameters): whole, one rank owns the
    # 384-element matrix; split (cuts on 64-element quanta, as OSS cuts: a row of the matrix, 64 elements
    # of a vector), the vectors go to ranks 0 and 1 and the matrix's rows fill the ranks to 640/3 rounded
    # down to whole rows: 1 row to rank 0, 1 to rank 1, 4 to rank 2 (256 elements, within one row of 640/3)
    shapes = [(6, 64), (128,), (128,)]
    plan = memory.estimate_plans(shapes, 3, mixed_precision=False)
    assert (plan.unsplit_heaviest_params, plan.unsplit_imbalance) == (384, 384 / (640 / 3))
    assert plan.split_param_count == 1 and plan.split_heaviest_params == 256
    assert plan.stage1(False) == 8 * 640 + 8 * 384 and plan.stage2(True) == 4 * 640 + 12 * 256
    assert plan.stage2_at_step(True) == plan.stage2(True)  # fp32: no master gradients
    mixed = memory.estimate_plans(shapes, 3)
    assert mixed.stage2_at_step(False) == mixed.stage2(False) + 2 * 384
    assert mixed.as_dict()["stage1_split_at_step_bytes"] == mixed.stage1_at_step(True)
    tiny = memory.estimate_plans([(6, 2), (4,), (4,)], 3)  # rows of 2 elements: a quantum is 32 rows, more
    assert tiny.split_param_count == 0  # than the matrix has, so nothing can be cut on an aligned boundary
    with pytest.raises(ValueError, match="shapes must describe at least one parameter element, got 0 shapes"):
        memory.estimate_plans([], 2)


def test_heap_reads_a_10_mib_tensor_as_10_mib() -> None:
    before = memory.heap_bytes()
    assert before is not None, memory.capabilities()
    t = torch.ones(10 * MiB // 4)
    during = memory.heap_bytes()
    del t
    after = memory.heap_bytes()
    assert during is not None and after is not None
    assert abs((during - before) - 10 * MiB) < 0.05 * MiB, (during - before) / MiB
    assert abs(after - before) < 0.05 * MiB, (after - before) / MiB


def _all_reduce_bytes(rank: int, world_size: int, numel: int) -> int:
    from shardopt import comm

    t = torch.ones(numel)
    comm.all_reduce(t, None).wait()  # warm the connections up
    recorder = memory.MemoryRecorder()
    with recorder.step():
        comm.all_reduce(t, None).wait()
    assert recorder.steps[0].seconds > 0
    sent = recorder.steps[0].bytes_sent
    assert sent is not None
    return sent


def test_bytes_sent_reads_a_4_mib_all_reduce_at_2_ranks_as_4_mib() -> None:
    sent = run_ranks(_all_reduce_bytes, 2, MiB, timeout_s=60)
    for value in sent:
        assert 3.95 * MiB <= value <= 4.2 * MiB, [v / MiB for v in sent]


def test_recorder_keeps_labelled_samples_peak_and_step_stats() -> None:
    rec = memory.MemoryRecorder()
    rec.start()
    big = torch.zeros(4 * MiB // 4)
    assert rec.sample("forward") == pytest.approx(4 * MiB, abs=0.1 * MiB)
    del big
    rec.sample("step")
    with rec.step():
        time.sleep(0.01)
    with rec.step():
        pass
    assert rec.peak() == rec.last("forward")
    assert rec.last("step") is not None and rec.last("step") < MiB  # type: ignore[operator]
    assert rec.last("backward") is None
    assert len(rec.steps) == 2 and rec.median_step_s() is not None
    assert rec.mean_bytes_sent() is not None and rec.mean_bytes_sent() >= 0  # type: ignore[operator]


def test_unavailable_sources_read_none_and_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "_MALLINFO2", None)
    monkeypatch.setattr(memory, "_HEAP_SOURCE", "heap measurement needs glibc's mallinfo2 (Linux); this is test")
    monkeypatch.setattr(memory, "_IO_PATH", "/nonexistent/io")
    assert memory.heap_bytes() is None and memory.bytes_sent() is None
    caps = memory.capabilities()
    assert "mallinfo2" in str(caps["heap"]) and "unavailable" in str(caps["bytes_sent"])
    rec = memory.MemoryRecorder()
    rec.start()
    assert rec.sample("step") is None and rec.peak() is None
    with rec.step():
        pass
    assert rec.steps[0].bytes_sent is None and rec.mean_bytes_sent() is None
