"""The side-stream protocol of ZeRO-2 reductions (Note [reductions on a side stream] in
shardopt/nn/data_parallel/streams.py), checked on CPU ranks: the queue's stream operations are
replaced by a recorder that logs them beside each bucket's launch, finish and release, and the
order is checked per bucket; the parameters equal those of the host-order path bit for bit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import shardopt.nn.data_parallel.reduction_queue as reduction_queue
import shardopt.nn.data_parallel.sharded_ddp as sharded_ddp
from shardopt.nn import ShardedDataParallel
from shardopt.nn.data_parallel.grad_buckets import GradBucket
from shardopt.optim import OSS
from shardopt.streams import StreamOps
from shardopt.testing import run_ranks
from tests.helpers.data import max_abs_diff, rank_batch, seeded_mlp

pytestmark = pytest.mark.distributed


class RecordingStreams(StreamOps):
    """Stream operations that log what they would do; "S0" is the compute stream, "R" the side."""

    side = "R"

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log
        self.current_stream = "S0"
        self._events = 0

    def current(self) -> Any:
        return self.current_stream

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        self.log.append(("wait_stream", waiter, waitee))

    def record_event(self, stream: Any) -> Any:
        self._events += 1
        self.log.append(("record", stream, self._events))
        return self._events

    def wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(("wait_event", stream, event))

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        previous, self.current_stream = self.current_stream, stream
        self.log.append(("enter", stream))
        try:
            yield
        finally:
            self.log.append(("exit", stream))
            self.current_stream = previous


def _logged(log: list[tuple[Any, ...]], streams: RecordingStreams) -> None:
    """Log each bucket's launch, finish and release with the stream current at the time."""
    for name in ("launch", "finish", "release"):
        original = getattr(GradBucket, name)

        def wrapper(self: GradBucket, *args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            log.append((_name, self.spec.index, streams.current_stream))
            return _original(self, *args, **kw)

        setattr(GradBucket, name, wrapper)


def _train(rank: int, streams: StreamOps | None, steps: int = 3) -> list[torch.Tensor]:
    model = seeded_mlp(width=32)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
    if streams is not None:
        sharded_ddp.streams_for = lambda device, group: streams  # type: ignore[assignment]
    sdp = ShardedDataParallel(model, opt, reduce_buffer_size=300)
    for step in range(steps):
        opt.zero_grad()
        sdp(rank_batch(rank, step)).pow(2).mean().backward()
        opt.step()
    sdp.close()
    return [p.detach().clone() for p in model.parameters()]


def _check_order(log: list[tuple[Any, ...]]) -> list[str]:
    """Every violation of the protocol in ``log``, as text."""
    problems = []
    last_record = 0
    finished_before: dict[int, int] = {}  # bucket -> the event recorded after its finish
    waited_up_to = 0
    for i, entry in enumerate(log):
        kind = entry[0]
        if kind == "launch":
            if entry[2] != "R":
                problems.append(f"{i}: bucket {entry[1]} launched on {entry[2]}")
            if not any(e == ("wait_stream", "R", "S0") for e in log[max(0, i - 3):i]):
                problems.append(f"{i}: bucket {entry[1]} launched without R waiting for S0 first")
        elif kind == "finish":
            if entry[2] != "R":
                problems.append(f"{i}: bucket {entry[1]} finished on {entry[2]}")
            finished_before[entry[1]] = last_record + 1  # the next event recorded covers it
        elif kind == "record":
            last_record = entry[2]
            if entry[1] != "R":
                problems.append(f"{i}: event recorded on {entry[1]}")
        elif kind == "wait_event":
            if entry[1] != "S0":
                problems.append(f"{i}: {entry[1]} waited for an event")
            waited_up_to = max(waited_up_to, entry[2])
        elif kind == "release" and entry[1] in finished_before and finished_before[entry[1]] > waited_up_to:
            problems.append(f"{i}: bucket {entry[1]} released before S0 waited for its reduction")
    return problems


def _streams_protocol(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    host = _train(rank, None)
    for budget in ("default", "tiny"):
        log: list[tuple[Any, ...]] = []
        streams = RecordingStreams(log)
        _logged(log, streams)
        if budget == "tiny":  # every launch past the first retires the oldest bucket
            reduction_queue.MAX_BYTES_IN_FLIGHT = 1
        side = _train(rank, streams)
        out[f"{budget}/diff"] = max_abs_diff(side, host)
        out[f"{budget}/problems"] = _check_order(log)
        out[f"{budget}/launches"] = sum(1 for e in log if e[0] == "launch")
        out[f"{budget}/joins"] = sum(1 for e in log if e[0] == "wait_event")
        out[f"{budget}/releases"] = sum(1 for e in log if e[0] == "release")
    return out


def test_side_stream_protocol_orders_launch_finish_and_free_and_changes_no_result() -> None:
    for out in run_ranks(_streams_protocol, 2, timeout_s=120):
        for budget in ("default", "tiny"):
            assert out[f"{budget}/diff"] == 0.0, out
            assert out[f"{budget}/problems"] == [], out[f"{budget}/problems"]
            assert out[f"{budget}/launches"] > 3 and out[f"{budget}/releases"] == out[f"{budget}/launches"], out
        steps = 3
        assert out["default/joins"] == steps, out  # one join per backward
        assert out["tiny/joins"] == out["tiny/launches"], out  # every retire waits, then the join
