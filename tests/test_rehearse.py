"""``shardopt rehearse``'s library side: one rank of N under torch's fake group (shardopt.app.rehearse).

The memory categories against the measured peak and against independent counts (FSDP's row
slots, Adam's two moments and its 0-dim steps, DDP's bucket), the tracker against torch's own
CPU allocator events (the profiler's memory records), the fake rank against a real 2-rank
gloo run, the build that never holds an fp32 copy of the model, and the step-time model on
hand-made timelines."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from shardopt.app.decoder import Decoder, scaled
from shardopt.app.precision import Precision
from shardopt.app.rehearse import CATEGORIES, RehearsalConfig, heaviest_rank, rehearse_on_group, rehearse_rank
from shardopt.app.rehearse_build import ModelSpec, build_rank, model_spec, num_params
from shardopt.app.shapes import SHAPE_PRESETS
from shardopt.app.step_model import Link, predict, predict_steps, rounds
from shardopt.app.storage_trace import StorageTracker
from shardopt.app.timeline import CollectiveCall, StepTimeline
from shardopt.testing import run_ranks

TINY = model_spec("tiny", None)  # the built-in GPT: 42,880 parameters in 29 tensors, 32 positions
BF16M, FP32 = Precision("bf16-master"), Precision("fp32")


def _config(mode: str, precision: Precision = BF16M, world_size: int = 4, **kwargs: object) -> RehearsalConfig:
    options: dict[str, object] = {"batch_size": 2, "seq_len": 16, **kwargs}
    return RehearsalConfig(TINY, mode, precision, world_size, **options)  # type: ignore[arg-type]


def test_categories_sum_to_the_measured_peak_in_every_mode() -> None:
    cases = [("ddp", Precision("bf16"), None), ("zero1", BF16M, None), ("zero2", BF16M, None),
             ("zero2-split", FP32, None), ("zero2-hybrid", BF16M, 2), ("zero3", BF16M, None)]
    for mode, precision, shard_size in cases:
        result = rehearse_rank(_config(mode, precision, shard_size=shard_size), 3)
        parts = {name: getattr(result.memory, name) for name in CATEGORIES}
        assert result.replay_matched, (mode, result.peak_bytes, result.memory)
        assert sum(parts.values()) == result.peak_bytes == result.memory.total, (mode, parts)
        assert min(parts.values()) >= 0 and parts["params"] > 0 and parts["optimizer"] > 0, (mode, parts)
        assert result.needed_bytes >= result.peak_bytes and len(result.timelines) == 1, mode


def test_model_state_categories_equal_independent_counts() -> None:
    numel, shapes = num_params(TINY)
    tensors = len(shapes)
    # fp32 DDP: every parameter, Adam's two moments and one 4-byte step per tensor, one bucket of all gradients
    ddp = rehearse_rank(_config("ddp", FP32), 0).memory
    assert (ddp.params, ddp.optimizer, ddp.comm) == (4 * numel, 8 * numel + 4 * tensors, 4 * numel)
    # ZeRO-3 at N = 4: each rank keeps ceil(rows / 4) row slots of every parameter (Note [flat parameter layout])
    slots = sum(math.ceil(s[0] / 4) * math.prod(s[1:]) for s in shapes)
    zero3 = rehearse_rank(_config("zero3", FP32), 1).memory
    assert zero3.params == 4 * slots and zero3.optimizer == 2 * zero3.params + 4 * tensors


def test_tracker_peak_equals_the_cpu_allocators_peak_in_the_profilers_memory_events() -> None:
    # An independent reading: every CPU allocation and free torch's allocator reports to the profiler,
    # kernels' scratch included; its running total from the start is the allocator's peak.
    for mode in ("zero2", "zero3"):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = rehearse_rank(_config(mode), 1)
        events = sorted((e for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
                         if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU),
                        key=lambda e: e.start_ns())
        total = peak = 0
        for event in events:
            total += event.nbytes()
            peak = max(peak, total)
        assert peak == result.needed_bytes, (mode, peak, result.needed_bytes)


def test_tracker_sees_storage_resizes_and_frees() -> None:
    with StorageTracker("cpu") as tracker:
        a = torch.ones(1000)
        assert tracker.live_bytes == 4000
        a.untyped_storage().resize_(0)  # not a dispatched operator: the tracker wraps resize_
        assert tracker.live_bytes == 0
        a.untyped_storage().resize_(8000)
        assert tracker.live_bytes == 8000 and tracker.peak_bytes == 8000
        del a
        assert tracker.live_bytes == 0
    assert "resize_" not in torch.UntypedStorage.__dict__


def _real(rank: int, world_size: int, configs: list[RehearsalConfig]) -> list[int]:
    return [rehearse_on_group(config).peak_bytes for config in configs]


@pytest.mark.distributed
def test_fake_rehearsal_at_two_ranks_matches_a_real_gloo_run_within_5_percent() -> None:
    configs = [replace(_config(mode, world_size=2), steps=3) for mode in ("zero1", "zero2", "zero3")]
    real = run_ranks(_real, 2, configs, timeout_s=300)
    for index, config in enumerate(configs):
        for rank in (0, 1):
            rehearsed = rehearse_rank(config, rank).peak_bytes
            # the same builder and steps on a real group; the bar is 5%, and the bytes are in fact identical
            assert abs(real[rank][index] / rehearsed - 1) <= 0.05, (config.mode, rank, real[rank][index], rehearsed)


def test_build_never_holds_an_fp32_copy_of_the_model() -> None:
    shape = scaled(SHAPE_PRESETS["llama3-8b"], 128)  # 490k parameters, 32 layers
    spec = ModelSpec("llama3-8b/128", partial(Decoder, shape), shape.vocab_size)
    numel, _ = num_params(spec)
    zero3 = rehearse_rank(RehearsalConfig(spec, "zero3", BF16M, 8, seq_len=8), 1)
    # one unit at a time: the embedding (or head) in fp32 and its flat copy, not the 32 layers
    assert zero3.build_peak_bytes < 2 * numel, (zero3.build_peak_bytes, 4 * numel)  # half an fp32 copy
    zero2 = rehearse_rank(RehearsalConfig(spec, "zero2", BF16M, 8, seq_len=8), 1)
    # bf16 parameters (2 bytes each) and this rank's fp32 masters, never 4 bytes per parameter
    assert zero2.build_peak_bytes < 3 * numel, (zero2.build_peak_bytes, 4 * numel)


def test_activation_checkpointing_lowers_the_peak() -> None:
    for mode in ("zero2", "zero3"):
        plain = rehearse_rank(_config(mode, seq_len=32), 0)
        recomputed = rehearse_rank(_config(mode, seq_len=32, checkpointing=True), 0)
        assert recomputed.peak_bytes < plain.peak_bytes, mode


def test_heaviest_rank_follows_the_ownership_plan() -> None:
    _, shapes = num_params(TINY)
    assert heaviest_rank("zero3", shapes, 8, None, 2) is None and heaviest_rank("ddp", shapes, 8, None, 2) is None
    for mode in ("zero1", "zero2", "zero2-split"):
        rank = heaviest_rank(mode, shapes, 8, None, 2)
        assert rank is not None and 0 <= rank < 8
    assert heaviest_rank("zero2-hybrid", shapes, 64, 4, 2) in range(4)


def test_ddp_all_reduce_under_the_fake_group_is_waited_at_the_end_of_backward() -> None:
    # the rehearsal's DDP hook leaves the all-reduce pending; Built.finish_backward waits it, as DDP's reducer does
    timeline = rehearse_rank(_config("ddp", FP32), 0).timelines[0]
    (call,) = timeline.calls
    assert call.op == "all_reduce" and call.waited_s is not None and call.waited_s >= call.issued_s
    assert call.sent_bytes == 2 * 3 / 4 * 4 * 42880  # a ring all-reduce of every fp32 gradient over 4 ranks


def _call(issued: float, waited: float | None, nbytes: float, op: str = "all_gather_into",
          group_size: int = 2) -> CollectiveCall:
    return CollectiveCall(op, "test", group_size, "world", nbytes, nbytes, issued, waited)


def test_step_model_hides_what_compute_covers_and_charges_the_rest() -> None:
    link = Link(gbps=8.0, latency_us=0.0)  # 1 GB/s: 1e8 bytes take 0.1 s
    # issued at 0, waited at the end of 1 s of compute: hidden
    assert predict(StepTimeline(1.0, 1.0, (_call(0.0, 1.0, 1e8),)), link).step_s == pytest.approx(1.0)
    # longer than the compute after it: the tail shows
    assert predict(StepTimeline(1.0, 1.0, (_call(0.95, 1.0, 1e8),)), link).step_s == pytest.approx(1.05)
    # waited as soon as issued: all of it shows
    assert predict(StepTimeline(1.0, 1.0, (_call(0.5, 0.5, 1e8),)), link).step_s == pytest.approx(1.1)
    # two at once share the one link, in issue order
    both = predict(StepTimeline(1.0, 1.0, (_call(0.0, 0.1, 1e8), _call(0.0, 0.1, 1e8))), link)
    assert both.step_s == pytest.approx(1.1) and both.comm_s == pytest.approx(0.2)
    assert both.exposed_s == pytest.approx(0.1) and both.hidden_s == pytest.approx(0.1)
    # never waited in the step: it still ends before the step does
    assert predict(StepTimeline(1.0, 1.0, (_call(0.9, None, 2e8),)), link).step_s == pytest.approx(1.1)


def test_step_model_without_overlap_adds_every_collective_to_compute() -> None:
    link = Link(gbps=8.0, latency_us=0.0)
    # the same step as above: hidden with overlap, added in full without (a CPU rank's cores move the bytes)
    timeline = StepTimeline(1.0, 1.0, (_call(0.0, 1.0, 1e8), _call(0.5, 0.5, 1e8), _call(0.9, None, 2e8)))
    assert predict(timeline, link).step_s == pytest.approx(1.2)
    serial = predict(timeline, link, overlap=False)
    assert serial.step_s == pytest.approx(1.4) and serial.comm_s == pytest.approx(0.4)
    assert serial.exposed_s == pytest.approx(0.4) and serial.hidden_s == pytest.approx(0.0)
    assert predict_steps([timeline, timeline], link, overlap=False).step_s == pytest.approx(1.4)


def test_step_model_charges_a_sparse_all_to_all_the_peers_it_messages() -> None:
    link = Link(gbps=1e9, latency_us=10.0)
    dense = CollectiveCall("all_to_all_pieces", "test", 8, "world", 0.0, 0.0, 0.0, 0.0, peers=7)
    sparse = CollectiveCall("all_to_all_pieces", "test", 8, "world", 0.0, 0.0, 0.0, 0.0, peers=2)
    unknown = CollectiveCall("all_to_all_pieces", "test", 8, "world", 0.0, 0.0, 0.0, 0.0)
    assert link.seconds(dense) == pytest.approx(link.seconds(unknown)) == pytest.approx(7 * 10e-6)
    assert link.seconds(sparse) == pytest.approx(2 * 10e-6)


def test_recorded_all_to_all_peers_count_the_ranks_with_bytes() -> None:
    # at N = 1024 most ranks own no part of a bucket of the 27M GPT, and ShardedDataParallel's
    # receive rounds (Note [receive rounds]) have few senders: rank 0 messages far fewer than
    # N - 1 peers in most of its all-to-alls, and none in some
    config = RehearsalConfig(model_spec("27m", None), "zero2-split", Precision("bf16-master"), 1024, batch_size=1,
                             seq_len=16, steps=4, threads=1)
    calls = [c for c in rehearse_rank(config, 0).timelines[0].calls if c.op.startswith("all_to_all")]
    peers = [c.peers for c in calls]
    assert calls and all(p is not None and 0 <= p <= 1023 for p in peers), peers
    assert sum(p for p in peers if p is not None) < 1023 * len(calls) / 2, peers
    assert any(c.peers == 0 and c.sent_bytes == 0 for c in calls), peers


def test_step_model_latency_counts_ring_rounds() -> None:
    assert [rounds(op, 4) for op in ("all_gather_into", "reduce_scatter", "all_reduce", "exchange")] == [3, 3, 6, 1]
    assert rounds("all_reduce", 1) == 0
    link = Link(gbps=1e9, latency_us=10.0)
    assert link.seconds(_call(0, 0, 0.0, "all_reduce", 8)) == pytest.approx(14 * 10e-6)
    with pytest.raises(ValueError, match="--link-gbps must be > 0"):
        Link(0.0, 1.0)
    with pytest.raises(ValueError, match="--latency-us must be >= 0"):
        Link(1.0, -1.0)
    with pytest.raises(ValueError, match="predict_steps needs at least one step's timeline"):
        predict_steps([], link)


def test_build_rank_refuses_what_it_cannot_build() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match=r"--precision bf16: mode 'zero3' is rehearsed at fp32 or bf16-master"):
            build_rank(TINY, "zero3", Precision("bf16"), torch.device("cpu"), shard_size=None, checkpointing=False,
                       batch_size=1, seed=0)
        with pytest.raises(ValueError, match=r"--mode 'fsdp2' is not rehearsed"):
            build_rank(TINY, "fsdp2", FP32, torch.device("cpu"), shard_size=None, checkpointing=False, batch_size=1,
                       seed=0)
        no_blocks = replace(TINY, build=lambda: torch.nn.Embedding(4, 4), name="emb")
        with pytest.raises(ValueError, match=r"--activation-checkpointing: --model 'emb' has no nn.ModuleList"):
            build_rank(no_blocks, "zero2", FP32, torch.device("cpu"), shard_size=None, checkpointing=True,
                       batch_size=1, seed=0)
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match=r"--ranks: rank 4 is not in \[0, 4\)"):
        rehearse_rank(_config("zero2"), 4)


def test_rehearse_rank_refuses_a_process_that_has_a_group_and_trackers_refuse_nesting() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="rehearse makes its own fake default process group"):
            rehearse_rank(_config("zero2", world_size=2), 0)
    finally:
        dist.destroy_process_group()
    with StorageTracker("cpu"), pytest.raises(RuntimeError, match="a StorageTracker is already entered"):
        StorageTracker("cpu").__enter__()
