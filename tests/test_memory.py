"""shardopt.memory: the ZeRO paper's numbers, and measurements that read what really happened."""

from __future__ import annotations

import time

import pytest
import torch

from shardopt import memory
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


def test_estimate_rejects_bad_inputs_with_the_value() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        memory.estimate_model_states(10, 0)
    with pytest.raises(ValueError, match="num_params must be >= 1, got 0"):
        memory.estimate_model_states(0, 2)
    with pytest.raises(ValueError, match="optimizer_bytes_per_param must be >= 0"):
        memory.estimate_model_states(10, 2, optimizer_bytes_per_param=-1)


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
