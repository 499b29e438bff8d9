"""Predicted step time from a rehearsed step's timeline and a link: compute plus the communication not hidden.

Note [the step time model]
Inputs: one step's :class:`~shardopt.app.timeline.StepTimeline` measured under the fake
group (compute time ``C``; each collective ``c`` with the compute time it was issued at,
``i_c``, and first waited at, ``w_c``, and the bytes it puts on the wire, ``b_c``, in a group
of ``g_c`` ranks) and a link (bandwidth ``B`` per rank and direction, latency ``a`` per
message round). A collective takes

    t_c = r(op, g_c) * a + b_c / B

with ``r`` the rounds of a ring: ``g - 1`` for an all-gather, a reduce-scatter and an
all-to-all (shardopt's gloo and fake paths post all ``g - 1`` messages at once, a ring takes
``g - 1`` steps), ``2 (g - 1)`` for an all-reduce, ``g - 1`` for a broadcast (a pipelined
chain) and 1 for a point-to-point exchange. An all-to-all whose pieces for some ranks are
empty sends them nothing (shardopt's point-to-point path skips empty pieces, and so does
torch's NCCL all-to-all): its ``r`` is the number of peers it really messages, the larger of
those it sends to and those it receives from (``CollectiveCall.peers``), ``g - 1`` when
every piece has bytes. ShardedDataParallel's receive rounds (Note [receive rounds]) are such
all-to-alls: at large N each round has a few senders. The bytes are shardopt's counts (Note [bytes
per group] in :mod:`shardopt.app.group_bytes`: ring all-reduce ``2 (g - 1) / g`` of the
tensor, all-gather ``(g - 1)`` shards, reduce-scatter ``(g - 1) / g`` of the input).
The step is replayed on one clock with one link that carries one collective at a time,
in issue order (one communication stream): compute advances the clock by the measured
gaps between events; issuing ``c`` starts it at ``max(clock, link free)``, and it ends
``t_c`` later; waiting for ``c`` moves the clock to ``max(clock, end of c)``; the step ends
when its compute is done and the link is idle. So a collective issued during backward and
waited at its end (gradient buckets, ZeRO-3's reduce-scatters, DDP's all-reduces) costs
only what backward's remaining compute cannot cover, a prefetched all-gather only what the
previous unit's compute cannot, and one waited as soon as it is issued (OSS's parameter
gather after the step) costs all of ``t_c``:

    predicted = C + exposed,   exposed = replayed end - C.

Overlap (``overlap``). The replay above assumes a device that computes while something
else moves the bytes: a GPU, whose NCCL kernels and network engines run beside its compute
kernels. A CPU rank has no such engine: gloo moves every byte with the rank's own cores
(TCP over the kernel's sockets, memory copies), so when its ranks' threads fill the cores, as
they do when ranks x threads >= cores, a collective's time is taken from compute, not hidden
behind it. Without overlap the step is the sum:

    predicted = C + sum over c of t_c   (exposed = every t_c).

``shardopt rehearse --overlap auto`` (the default) replays with overlap on a GPU and sums on
the CPU. Measured on this project's 2-core machine (docs/rehearse.md, "Validation"): the
overlapped replay predicted CPU ranks 10-40% low, the sum within 25%.

Not modelled: separate links for the shard and replicate groups (hybrid runs share the one
link), contention between compute and communication for memory bandwidth or cores,
in-network reduction and NCCL's tree algorithms (lower latency than ``r`` above at large
``g``), stragglers.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from shardopt.app.timeline import CollectiveCall, StepTimeline

__all__ = ["Link", "Prediction", "predict", "predict_steps", "rounds"]


def rounds(op: str, group_size: int) -> int:
    """Message rounds of one collective (Note [the step time model])."""
    if group_size <= 1:
        return 0
    if op == "exchange":
        return 1
    if op == "all_reduce":
        return 2 * (group_size - 1)
    return group_size - 1


@dataclass(frozen=True)
class Link:
    """What one rank's link moves.

    Attributes:
        gbps: bandwidth per rank and direction, in gigabits per second.
        latency_us: latency of one message round, in microseconds.

    Raises:
        ValueError: a bandwidth that is not positive or a negative latency.
    """

    gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if not self.gbps > 0:
            raise ValueError(f"--link-gbps must be > 0, got {self.gbps!r}; e.g. 400 for an NDR InfiniBand port")
        if not self.latency_us >= 0:
            raise ValueError(f"--latency-us must be >= 0, got {self.latency_us!r}; e.g. 5")

    def seconds(self, call: CollectiveCall) -> float:
        """``t_c`` of Note [the step time model]."""
        steps = rounds(call.op, call.group_size) if call.peers is None else call.peers
        return steps * self.latency_us * 1e-6 + call.wire_bytes * 8 / (self.gbps * 1e9)


@dataclass(frozen=True)
class Prediction:
    """A step's predicted time on a link.

    Attributes:
        compute_s: the measured compute time ``C``.
        comm_s: every collective's ``t_c``, summed.
        step_s: the replayed step time (Note [the step time model]).
    """

    compute_s: float
    comm_s: float
    step_s: float

    @property
    def exposed_s(self) -> float:
        """Communication not hidden behind compute."""
        return self.step_s - self.compute_s

    @property
    def hidden_s(self) -> float:
        """Communication that overlapped compute."""
        return self.comm_s - self.exposed_s


def predict(timeline: StepTimeline, link: Link, overlap: bool = True) -> Prediction:
    """Replay one step against ``link`` (Note [the step time model]).

    Args:
        timeline: the step as rehearsed.
        link: the link of the machines predicted for.
        overlap: whether communication can run beside compute (a GPU); ``False`` adds every
            collective's time to the compute (CPU ranks whose threads fill the cores).

    Returns:
        The prediction.
    """
    if not overlap:
        total = sum(link.seconds(call) for call in timeline.calls)
        return Prediction(timeline.compute_s, total, timeline.compute_s + total)
    events: list[tuple[float, int, int]] = []  # (compute time, 0 issue / 1 wait, call index)
    for index, call in enumerate(timeline.calls):
        events.append((call.issued_s, 0, index))
        waited = call.waited_s if call.waited_s is not None else timeline.compute_s
        events.append((max(waited, call.issued_s), 1, index))
    events.sort()
    clock = link_free = last = 0.0
    ends: dict[int, float] = {}
    total = 0.0
    for at, kind, index in events:
        clock += max(at - last, 0.0)
        last = max(at, last)
        if kind == 0:
            seconds = link.seconds(timeline.calls[index])
            total += seconds
            ends[index] = max(clock, link_free) + seconds
            link_free = ends[index]
        else:
            clock = max(clock, ends[index])
    clock += max(timeline.compute_s - last, 0.0)
    return Prediction(timeline.compute_s, total, max(clock, link_free))


def predict_steps(timelines: Sequence[StepTimeline], link: Link, overlap: bool = True) -> Prediction:
    """The median of :func:`predict` over several steps (each value the median of its own).

    Raises:
        ValueError: no steps.
    """
    if not timelines:
        raise ValueError("predict_steps needs at least one step's timeline")
    each = [predict(t, link, overlap) for t in timelines]
    return Prediction(statistics.median(p.compute_s for p in each), statistics.median(p.comm_s for p in each),
                      statistics.median(p.step_s for p in each))
