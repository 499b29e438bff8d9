"""The offloaded optimizer's copies on a side stream (Note [offload copies on a side stream] in
shardopt/optim/offload_copies.py), checked on CPU ranks against a simulated device.

The copy stream's operations are replaced by :class:`SimStreams`: the compute stream ``S0`` and
the reduction stream ``R`` run at once, in host order, as the CPU does, but a copy issued on the
copy stream ``C`` only runs when something waits for it: the host (``host_wait``), or ``S0``/``R``
(``wait_event``, ``wait_stream``), whose later work then sees it. So a reader that does not wait
reads stale bytes, and the results differ from the blocking path's; a copy whose source was
dropped before it ran is caught when it runs, and so is a download or an upload that casts (on a
GPU that copy goes through pageable memory and blocks the host); an upload reads the buffer the
host rounded its master into when it runs, so a rounding that overwrote it too early shows. The log of records, waits and copies is
also checked per copy: for a download, an event recorded on the stream current when the gradient
arrived, ``C`` waiting for it, the copy, an event on ``C``, and a host wait before any host
reader or step; for an upload, and for a mirror's gradient handed back to DDP's ``param.grad``,
``C`` waiting for ``S0``, the copy, an event, and ``S0`` waiting (on the device) for it before
the next forward. Training must equal the blocking path bit for bit, under ShardedDataParallel
(ZeRO-2, its own reductions in host order or on a simulated side stream) and under DDP (ZeRO-1,
whose gradients the fold downloads), with one host wait per step.
:func:`test_the_simulation_catches_each_missing_wait` removes each wait and expects a failure.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import shardopt.nn.data_parallel.sharded_ddp as sharded_ddp
import shardopt.optim.offload_copies as offload_copies
from shardopt import grad_norms
from shardopt.nn import ShardedDataParallel
from shardopt.optim import OSS, ShardedGradScaler
from shardopt.optim.flat_masters import FlatGroup
from shardopt.optim.masters import MasterWeights
from shardopt.streams import StreamOps
from shardopt.testing import run_ranks
from tests.helpers.masters import loss_of
from tests.helpers.oss import state_entries_equal

pytestmark = pytest.mark.distributed

F32, BF16 = torch.float32, torch.bfloat16
STEPS = 4
MODES = ("plain", "accumulate", "three", "drop", "carry", "no_sync", "clip", "scaler", "norms", "delayed")
ZERO1_MODES = ("plain", "accumulate", "carry", "no_sync", "clip", "scaler", "norms", "delayed")


# ---------------------------------------------------------------------- the simulated device


@dataclass(frozen=True)
class SimEvent:
    """An event: the stream it was recorded on, its number, and for ``C`` how many copies precede it."""

    stream: str
    number: int
    position: int


class SimDevice:
    """The state one simulated GPU's stream operations share: the current stream, ``C``'s queue
    of copies, the log and the protocol problems found while running."""

    def __init__(self) -> None:
        self.current = "S0"
        self.queue: list[tuple[str, torch.Tensor, weakref.ref[torch.Tensor], int]] = []  # (kind, dst, src, position)
        self.ran = 0  # copies of C run so far
        self.host_waited = 0  # copies of C the host has waited for
        self.events = 0
        self.log: list[tuple[Any, ...]] = []
        self.problems: list[str] = []
        self.host_storages: Callable[[], set[int]] = set
        self.param_storages: Callable[[], set[int]] = set

    def run(self, position: int) -> None:
        """Run C's copies up to ``position`` (something waited for them)."""
        while self.ran < position:
            kind, dst, src_ref, at = self.queue[self.ran]
            src = src_ref()
            if src is None:
                self.problems.append(f"{kind} copy {at} ran after its source was dropped")
            else:
                with torch.no_grad():  # as the device copies: outside autograd
                    dst.copy_(src)
            self.ran += 1

    def probe(self, name: str) -> None:
        """Check what must hold when the host reaches ``name``."""
        self.log.append(("probe", name))
        if name in ("host_step", "reader") and self.host_waited < len(self.queue):
            self.problems.append(f"{name}: the host did not wait for copies {self.host_waited + 1}..{len(self.queue)}")
        if name == "forward":
            late = [at for kind, _, _, at in self.queue[self.ran:] if kind in ("up", "back")]
            if late:
                self.problems.append(f"forward: uploads or hand-backs {late} not waited for")


class SimStreams(StreamOps):
    """The stream operations of a :class:`SimDevice` with side stream ``side`` ("C" or "R")."""

    def __init__(self, device: SimDevice, side: str) -> None:
        self.device = device
        self.side = side

    def current(self) -> Any:
        return self.device.current

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        self.device.log.append(("wait_stream", waiter, waitee))
        if waitee == "C" and waiter != "C":
            self.device.run(len(self.device.queue))

    def record_event(self, stream: Any) -> Any:
        d = self.device
        d.events += 1
        event = SimEvent(stream, d.events, len(d.queue) if stream == "C" else 0)
        d.log.append(("record", stream, event.number))
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        self.device.log.append(("wait_event", stream, event.number))
        if event.stream == "C" and stream != "C":
            self.device.run(event.position)

    def host_wait(self, event: Any) -> None:
        d = self.device
        d.log.append(("host_wait", event.number))
        if event.stream == "C":
            d.run(event.position)
            d.host_waited = max(d.host_waited, event.position)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        d = self.device
        if d.current != "C":
            dst.copy_(src)
            return
        if src.untyped_storage().data_ptr() not in d.host_storages():
            kind = "down"  # a device gradient to the host
        else:  # a master into its parameter, or a mirror's gradient back into DDP's
            kind = "up" if dst.untyped_storage().data_ptr() in d.param_storages() else "back"
        if kind == "up":  # the host wrote this source again (a master, or its rounding) before it waited for the last read
            unwaited = [at for k, _, ref, at in d.queue[d.host_waited:] if k == "up" and (old := ref()) is not None
                        and old.data_ptr() == src.data_ptr()]
            if unwaited:
                d.problems.append(f"upload {len(d.queue) + 1}: the host rewrote its source before upload {unwaited[-1]} "
                                  "landed")
        d.queue.append((kind, dst, weakref.ref(src), len(d.queue) + 1))
        d.log.append(("copy", kind, len(d.queue)))
        if kind in ("down", "up") and dst.dtype != src.dtype:
            name = {"down": "download", "up": "upload"}[kind]
            d.problems.append(f"{name} {len(d.queue)} casts {src.dtype} to {dst.dtype} (through pageable memory)")

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        previous, self.device.current = self.device.current, stream
        try:
            yield
        finally:
            self.device.current = previous


def recorded_on(log: list[tuple[Any, ...]]) -> dict[int, str]:
    """The stream each event of ``log`` was recorded on, by number."""
    return {e[2]: e[1] for e in log if e[0] == "record"}


def order_problems(log: list[tuple[Any, ...]]) -> list[str]:
    """Every download and upload in ``log`` that breaks the protocol's order, as text."""
    problems = []
    stream_of = recorded_on(log)
    last_copy = -1
    last_step = -1
    for k, entry in enumerate(log):
        if entry[0] == "probe" and entry[1] == "host_step":
            last_step = k
        if entry[0] != "copy":
            continue
        since = log[last_copy + 1 : k]
        name = {"down": "download", "up": "upload", "back": "hand-back"}[entry[1]]
        if entry[1] == "down":  # an event on the producer, C waits for it, the copy, an event on C
            waited = [e[2] for e in since if e[0] == "wait_event" and e[1] == "C"]
            if not any(stream_of.get(n) not in (None, "C") for n in waited):
                problems.append(f"download {entry[2]}: C did not wait for the stream that produced the gradient")
        elif not any(e == ("wait_stream", "C", "S0") for e in log[last_step + 1 : k]):
            problems.append(f"{name} {entry[2]}: C did not wait for S0 before overwriting its destination")
        if k + 1 >= len(log) or log[k + 1][:2] not in (("record", "C"), ("copy", entry[1])):
            problems.append(f"{name} {entry[2]}: no event recorded on C after it")
        last_copy = k
    return problems


# ---------------------------------------------------------------------- training


def mlp(dtype: torch.dtype) -> nn.Module:
    """Aligned weights and two unaligned biases; the 64 x 64 weight is split at 2 ranks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(),
                         nn.Linear(48, 4)).to(dtype)


@dataclass(frozen=True)
class Config:
    stage: str  # "zero2" (split), "zero2-whole", "zero1" (DDP)
    reductions: str  # ShardedDataParallel's streams: "host" order, or a simulated "side" stream R
    dtype: torch.dtype
    mode: str
    budget: str = "default"  # "tiny": every download past the first retires the oldest


def _probes(device: SimDevice, model: nn.Module) -> Callable[[], None]:
    """Log the host step, the host's readers and each forward; returns the undo."""
    originals = (FlatGroup.point_step_grads, FlatGroup.take_grads)

    def step_probe(self: FlatGroup, *args: Any, **kwargs: Any) -> Any:
        device.probe("host_step")
        return originals[0](self, *args, **kwargs)

    def reader_probe(self: FlatGroup, *args: Any, **kwargs: Any) -> Any:
        device.probe("reader")
        return originals[1](self, *args, **kwargs)

    FlatGroup.point_step_grads = step_probe  # type: ignore[method-assign]
    FlatGroup.take_grads = reader_probe  # type: ignore[method-assign]
    handle = model.register_forward_pre_hook(lambda *_: device.probe("forward"))

    def undo() -> None:
        FlatGroup.point_step_grads, FlatGroup.take_grads = originals  # type: ignore[method-assign]
        handle.remove()

    return undo


def train(rank: int, config: Config, device: SimDevice | None) -> dict[str, Any]:
    """Five steps of ``config``; with ``device``, the copies (and with ``reductions="side"``
    ShardedDataParallel's reductions) run on its simulated streams."""
    streams_for, copy_streams_for, budget = (sharded_ddp.streams_for, offload_copies.copy_streams_for,
                                             offload_copies.COPY_BYTES_IN_FLIGHT)
    if device is not None:
        offload_copies.copy_streams_for = lambda _: SimStreams(device, "C")  # type: ignore[assignment]
        if config.reductions == "side":
            sharded_ddp.streams_for = lambda *_: SimStreams(device, "R")  # type: ignore[assignment]
        if config.budget == "tiny":
            offload_copies.COPY_BYTES_IN_FLIGHT = 1  # type: ignore[misc]
    try:
        return _train(rank, config, device)
    finally:
        sharded_ddp.streams_for, offload_copies.copy_streams_for = streams_for, copy_streams_for  # type: ignore[assignment]
        offload_copies.COPY_BYTES_IN_FLIGHT = budget  # type: ignore[misc]


def _train(rank: int, config: Config, device: SimDevice | None) -> dict[str, Any]:
    dtype, mode = config.dtype, config.mode
    model = mlp(dtype)
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2, weight_decay=0.1, offload="cpu",
              master_dtype=F32 if dtype != F32 else None, split_large_params=config.stage == "zero2",
              delay_update_after=1 if mode == "delayed" else None)
    wrapped: nn.Module = DDP(model) if config.stage == "zero1" else ShardedDataParallel(model, opt)
    undo = lambda: None  # noqa: E731
    if device is not None:
        device.host_storages = lambda: {t.untyped_storage().data_ptr() for t in opt.offloaded_buffers()}
        device.param_storages = lambda: {p.untyped_storage().data_ptr() for p in model.parameters()}
        undo = _probes(device, model)
    scaler = ShardedGradScaler(init_scale=2.0**8, growth_interval=2, device="cpu") if mode == "scaler" else None
    out: dict[str, Any] = {"params": [], "norms": [], "host_waits": []}
    try:
        for step in range(STEPS):
            if mode != "carry" or step % 2 == 0:  # carry: gradients summed across steps
                opt.zero_grad(set_to_none=step % 2 == 0)
            micro = {"accumulate": 2, "drop": 3, "no_sync": 2, "three": 3}.get(mode, 1)
            for k in range(micro):
                if mode == "drop" and k == 2:
                    opt.zero_grad()  # the first two micro-batches' gradients (one staged) are discarded
                loss = loss_of(wrapped, rank, 10 * step + k, dtype)
                with wrapped.no_sync() if mode == "no_sync" and k == 0 else contextlib.nullcontext():
                    (scaler.scale(loss) if scaler is not None else loss).backward()
            if mode == "norms":
                out["norms"].append([float(v) for v in grad_norms(wrapped).values()])
            if mode == "clip":
                out["norms"].append(float(opt.clip_grad_norm(0.05)))
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            out["params"].append([p.detach().clone() for p in model.parameters()])
            if device is not None:
                out["host_waits"].append(sum(1 for e in device.log if e[0] == "host_wait"))
        opt.finish_update()
        out["params"].append([p.detach().clone() for p in model.parameters()])
        out["state"] = opt.state_dict(all_ranks=True)["state"]
    finally:
        undo()
        if isinstance(wrapped, ShardedDataParallel):
            wrapped.close()
    return out


def configs(world_size: int) -> list[Config]:
    out = [Config("zero2", reductions, dtype, mode) for reductions in ("host", "side") for dtype in (F32, BF16)
           for mode in MODES]
    out += [Config("zero2-whole", "side", BF16, mode) for mode in ("plain", "accumulate", "delayed")]
    out += [Config("zero2", "side", dtype, mode, "tiny") for dtype in (F32, BF16) for mode in ("plain", "three")]
    out += [Config("zero1", "host", dtype, mode) for dtype in (F32, BF16) for mode in ZERO1_MODES]
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (all(torch.equal(x, y) for xs, ys in zip(a["params"], b["params"], strict=True)
                for x, y in zip(xs, ys, strict=True))
            and state_entries_equal(a["state"], b["state"]) and a["norms"] == b["norms"])


def _protocol(rank: int, world_size: int, selected: list[Config] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config in selected or configs(world_size):
        blocking = train(rank, config, None)
        device = SimDevice()
        simulated = train(rank, config, device)
        tag = f"{config.stage}/{config.reductions}/{config.dtype}/{config.mode}/{config.budget}"
        waits = simulated["host_waits"]
        out[tag] = {"same": _same(simulated, blocking),
                    "problems": device.problems + order_problems(device.log),
                    "downloads": sum(1 for e in device.log if e[:2] == ("copy", "down")),
                    "uploads": sum(1 for e in device.log if e[:2] == ("copy", "up")),
                    "hand_backs": sum(1 for e in device.log if e[:2] == ("copy", "back")),
                    "device_waits_on_c": sum(1 for e in device.log if e[0] == "wait_event" and e[1] != "C"
                                             and recorded_on(device.log).get(e[2]) == "C"),
                    "host_waits_per_step": [b - a for a, b in zip([0, *waits], waits, strict=False)]}
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_offload_copies_on_a_side_stream_keep_the_protocol_and_change_no_result(world_size: int) -> None:
    results = run_ranks(_protocol, world_size, timeout_s=600)
    for rank, out in enumerate(results):
        assert out, "no configuration ran"
        for tag, r in out.items():
            assert r["same"], (rank, tag, r)
            assert r["problems"] == [], (rank, tag, r["problems"][:5])
            assert r["uploads"] > 0 and r["device_waits_on_c"] > 0, (rank, tag, r)  # every rank owns something
            assert r["downloads"] > 0, (rank, tag, r)  # DDP's gradients too, at the fold (ZeRO-1)
            # a mirror's gradient goes back to DDP's param.grad (ZeRO-1, fp32); ShardedDataParallel's stays
            assert (r["hand_backs"] > 0) == tag.startswith(f"zero1/host/{F32}"), (rank, tag, r)
            per_step = r["host_waits_per_step"]
            if "/three/" in tag:  # a third backward pass lands the second's staged gradients first
                assert all(n in (1, 2) for n in per_step), (rank, tag, per_step)
            else:  # the one documented host wait per step
                assert per_step == [1] * STEPS, (rank, tag, per_step)


def _without(method: Callable[..., Any], cut: Callable[[], Callable[[], None]]) -> Callable[..., Any]:
    """``method`` run with ``cut()`` applied (it returns the undo): one wait removed inside one call."""
    def mutated(*args: Any, **kwargs: Any) -> Any:
        undo = cut()
        try:
            return method(*args, **kwargs)
        finally:
            undo()

    return mutated


def _cut(owner: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    return lambda: setattr(owner, name, original)


def _skip_c_waits(wait_event: Callable[..., None]) -> Callable[..., None]:
    def skipped(self: SimStreams, stream: Any, event: Any) -> None:
        if stream != "C":
            wait_event(self, stream, event)

    return skipped


def _skip_waits_on_c(wait_event: Callable[..., None]) -> Callable[..., None]:
    def skipped(self: SimStreams, stream: Any, event: Any) -> None:
        if stream == "C":
            wait_event(self, stream, event)

    return skipped


ZERO1, ZERO2 = ("zero1/",), ("zero1/", "zero2/")
MUTATIONS: dict[str, tuple[Callable[[], None], int, tuple[str, ...]]] = {
    "no host wait": (lambda: setattr(SimStreams, "host_wait", lambda self, event: None), 1, ZERO2),
    "no wait before the gather sends": (
        lambda: setattr(offload_copies.Uploads, "wait_for", lambda self, params: None), 2, ZERO2),
    "no wait before the next forward": (
        lambda: setattr(offload_copies.OffloadCopies, "join_uploads", lambda self: None), 1, ZERO2),
    "no wait for the producer": (lambda: setattr(SimStreams, "wait_event", _skip_c_waits(SimStreams.wait_event)), 1,
                                 ZERO2),
    "no land in the fold": (lambda: setattr(MasterWeights, "fold_grads", _without(
        MasterWeights.fold_grads, lambda: _cut(offload_copies.OffloadCopies, "land", lambda self: None))), 1, ZERO2),
    "no wait after the hand-back": (lambda: setattr(offload_copies.OffloadCopies, "hand_back", _without(
        offload_copies.OffloadCopies.hand_back,
        lambda: _cut(SimStreams, "wait_event", _skip_waits_on_c(SimStreams.wait_event)))), 1, ZERO1),
    "a download that casts": (lambda: setattr(FlatGroup, "_cast_buffer", lambda self, grad: None), 1, ZERO1),
    "an upload that casts": (lambda: setattr(MasterWeights, "_rounding", lambda self, index, param: None), 1, ZERO2),
}
"""Each removes one wait of the protocol (the last one in the simulation: the library still calls
it, or one call of the library runs without it), the world size where its absence shows (the
gather waits only where there is a gather, and the wait after it matters only where there is
none) and the stages (ZeRO-1 under DDP, ZeRO-2) where it must be caught. ``a download that
casts`` makes bf16 gradients go to the fp32 gradient buffer in one copy; ``an upload that casts``
copies fp32 masters into bf16 parameters in one copy (the path before the rounding buffers). Without the wait after
the hand-back, a step that uploads is still right (the gather's and the next forward's waits come
later on ``C``); a delayed step, which uploads only at the next step, is not."""


def _mutated(rank: int, world_size: int, mutation: str) -> dict[str, Any]:
    MUTATIONS[mutation][0]()
    selected = [Config("zero2", "side", BF16, "accumulate"), Config("zero2", "side", F32, "plain"),
                Config("zero1", "host", BF16, "plain"), Config("zero1", "host", F32, "carry"),
                Config("zero1", "host", F32, "delayed")]
    return _protocol(rank, world_size, selected)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_simulation_catches_each_missing_wait(mutation: str) -> None:
    _, world_size, stages = MUTATIONS[mutation]
    results = run_ranks(_mutated, world_size, mutation, timeout_s=300)
    caught = [tag for out in results for tag, r in out.items() if not r["same"] or r["problems"]]
    for stage in stages:
        assert any(tag.startswith(stage) for tag in caught), f"removing the wait ({mutation}) went unnoticed in {stage}"


def _upload_twice(guarded: bool) -> tuple[list[str], torch.Tensor, int]:
    """Two uploads of a master into its bf16 parameter through one rounding buffer, with no land
    between (the library's order always lands in between: the fold, a load or a rebuild)."""
    device, saved = SimDevice(), offload_copies.copy_streams_for
    offload_copies.copy_streams_for = lambda _: SimStreams(device, "C")  # type: ignore[assignment]
    param, master = torch.zeros(64, dtype=BF16), torch.full((64,), 1.0 + 2**-9, dtype=F32)
    via = torch.empty(64, dtype=BF16)
    device.host_storages = lambda: {master.untyped_storage().data_ptr(), via.untyped_storage().data_ptr()}
    device.param_storages = lambda: {param.untyped_storage().data_ptr()}
    copies = offload_copies.OffloadCopies()
    try:
        copies.upload([(param, param, master, via)])
        master.fill_(3.0)  # as a step would, had it not landed first
        if not guarded:
            copies._rounded_unlanded = False
        copies.upload([(param, param, master, via)])
        copies.join_uploads()
    finally:
        offload_copies.copy_streams_for = saved  # type: ignore[assignment]
    return device.problems, param, sum(1 for e in device.log if e[0] == "host_wait")


def test_an_upload_waits_for_the_last_one_before_it_rounds_into_the_same_buffer() -> None:
    problems, param, host_waits = _upload_twice(guarded=True)
    assert problems == [] and host_waits == 1 and torch.equal(param, torch.full((64,), 3.0, dtype=BF16))
    problems, _, host_waits = _upload_twice(guarded=False)  # the guard removed: the simulation sees the rewrite
    assert host_waits == 0 and any("rewrote its source" in p for p in problems), problems


def _rne_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 round to nearest, ties to even, on the bits (what the CUDA cast, ``__float2bfloat16``,
    computes for every non-NaN value): add 0x7FFF plus the kept part's lowest bit, drop the low 16."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(torch.int32).to(torch.int16).view(BF16)  # wraps into int16's range: the same 16 bits


@pytest.mark.parametrize("numel", [15, 4096])
def test_the_host_rounds_fp32_to_bf16_to_nearest_even_as_the_device_cast(numel: int) -> None:
    """Note [offload copies on a side stream], 4: the host rounding (``Tensor.copy_`` on the CPU, the
    scalar tail and the vector body) gives the bits the device cast gives, for every upper half of an
    fp32 word (every sign, exponent, subnormals, infinities) under low halves around the tie."""
    high = torch.arange(2**16, dtype=torch.int64) << 16
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234, 0xC000], dtype=torch.int64)
    words = (high[:, None] | low[None, :]).reshape(-1).to(torch.int32)  # int64 -> int32 wraps: the same 32 bits
    values = words.view(F32)
    finite = ~values.isnan()
    for chunk in values[finite].split(numel):
        got = torch.empty(chunk.shape, dtype=BF16).copy_(chunk)
        assert torch.equal(got.view(torch.int16), _rne_bf16(chunk).view(torch.int16)), chunk
    assert torch.empty(values.shape, dtype=BF16).copy_(values)[~finite].isnan().all()  # NaN stays NaN (payload may differ)
