"""Gradient buckets for ShardedDataParallel: a static plan and the per-iteration buffers.

Bookkeeping only; the one collective goes through :mod:`shardopt.comm`.

Note [reduce to owner]
ZeRO-2 needs each gradient summed onto the one rank that owns its parameter. A bucket holds
several gradients; its send buffer is laid out by destination rank: first the gradients of
the parameters rank 0 owns, then rank 1's, and so on, each destination's part followed by
one "used" flag per parameter. One all-to-all then sends every rank exactly the part it
owns, from every rank, and the owner adds the ``N`` copies in rank order. Per rank this
sends ``(N-1)/N`` of the bucket, and the post-step all-gather of the updated parameters
sends another ``(N-1)/N`` of the parameters: together the ``2(N-1)/N`` a ring all-reduce
(DDP) sends. gloo's ``reduce`` sends the whole buffer from every rank, and its
reduce-scatter costs as much as an all-reduce, so neither is used on gloo.

The flags make "unused" decisions global without another collective: a parameter whose
flags sum to zero got no gradient on any rank, and its ``.grad`` is left untouched, as DDP
does with ``find_unused_parameters=True``. Stale data cannot be sent: every slot is written
each iteration, by a gradient or by zeros with a zero flag.

The plan must be identical on every rank (the all-to-all splits must agree), so it depends
only on parameter order, shapes, dtypes and owners, never on the order gradients arrive.
Buckets are launched strictly in index order for the same reason.

Note [host reads per step]
On a GPU, writing a Python number into one element (``flags[k] = 1``) is a blocking
host-to-device copy, and ``.tolist()``/``.item()`` wait for every kernel queued so far
(pytorch#186482): each drains the GPU from inside backward. So the flags are written with one
slice fill per destination when a bucket launches, and the owner reads the summed flags only
for the parameters it did not use itself: "used here" implies "used somewhere" (DDP's rule),
so such a parameter's gradient is decided without a read. The flags of the others are
collected as device views and read together, once per backward, after the last bucket
(``ReductionQueue.flush``); at one rank "unused here" is "unused everywhere" and nothing is
read. tests/helpers/host_reads.py counts these reads on CPU ranks (tests/test_host_reads.py).

Note [bucket pieces]
Each destination's part of a bucket is its own tensor, not a slice of one buffer, and the
owner's own part is summed straight from its send piece. A bucket of the default 2**23 fp32
elements is 32 MiB: as one buffer it is at glibc's ceiling for serving allocations from the
heap (``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB on 64-bit), so it was mmap'ed and unmapped again
every backward, and its pages faulted in anew each time. With pieces (16 MiB each at 2
ranks) the allocator reuses freed heap memory. On the 27M-parameter GPT at 2 ranks, minor
page faults per step fell from 40-59 thousand to 21-29 thousand (DDP: 11-20 thousand), and
the ZeRO-2/DDP step-time ratio of 4 interleaved bench rounds from 1.02-1.04 to 0.93-1.00.

Note [receive rounds]
The owner of a part of a bucket receives a copy of that part from every rank, ``(N-1)`` times
its share. With shares of about ``1/N`` of the bucket the copies add up to about one bucket,
but ownership comes in whole parameters (or row blocks), and at large ``N`` one rank's part of
a bucket is often a whole parameter or all it owns: its copies then add up to ``N`` times
that, however small the bucket. Measured under the fake group (27M GPT, bf16 parameters, fp32
wire, 32 MiB buckets), one bucket's receive pieces in one all-to-all were, on rank 0, 66 MB
at N = 8, 281 MB at 64, 1.1 GB at 256 and 4.6 GB at 1024 with whole parameters (it owns a
1.1M-element matrix); with split ones, on rank 0, the last and the heaviest, 39 MB at 8 and
104-115 MB at 64 to 1024 (a rank's part of the model sits in one bucket: N copies of 1/N of
the model, the model's whole gradient). So a bucket's all-to-all goes in rounds: in round
``j`` only ranks ``[jK, (j+1)K)`` send, every rank receives their pieces into at most ``K``
reused buffers and adds them to its sum, in rank order as before, so the sum is bit for bit
the single all-to-all's (tests/test_sdp_receive_rounds.py). ``K`` comes from the plan
(identical on every rank, :func:`sources_per_round`): ``K`` times the largest share fits in
twice the bucket, or ``RECEIVE_FLOOR_BYTES`` (two default buckets) if that is more. Round 0
is posted at launch, the others when the bucket is finished. Where ``N`` times the largest
share fits (shares near ``1/N``, small ``N``, and always at ``N = 2``) there is one round and
nothing changed. The bytes sent do not change; the heaviest owner's ``(N-1)`` shares of
inbound bytes bounded a bucket's reduction before and still do (each round brings it ``K``
shares while each sender sends at most one bucket), but rounds after the first wait on the
host, after backward has moved on, instead of overlapping it.

Note [small parameters share a bucket]
``reduce_buffer_size=0`` ("no buckets", fairscale's benchmark setting) still coalesces the
gradients of parameters smaller than ShardedDataParallel's ``_MIN_BUCKET_NUMEL`` elements
into buckets of that size (256 KiB in fp32): each all-to-all costs a fixed overhead per peer,
and a model of many tiny parameters (biases, norms) otherwise pays it hundreds of times a
step. Larger parameters still get a bucket of their own, and the arithmetic is the same
either way (each gradient is summed over ranks in rank order). Measured on
scripts/bench_bucketless.py (2 ranks): 1.46x fairscale's step time with one all-to-all per
parameter and two in flight, 1.22x with the byte budget of Note [reductions in flight] (in
reduction_queue.py), 0.83x with both.

Note [reduce into master gradients]
With master weights (``OSS(master_dtype=torch.float32)`` over bf16/fp16 parameters) a
bucket of low-precision gradients travels in the reduce dtype (fp32 by default, bf16 for
half the bytes): each gradient is widened exactly and scaled by ``1/N`` in the wire dtype as
it is copied in, and the owner widens each received row to the master's dtype and sums the
rows in rank order there. The sum is the owner's fp32 master gradient, never a bf16 one, so
bf16 on the wire rounds each rank's contribution once and nothing else.

Note [split parameters in buckets]
With ``OSS(split_large_params=...)`` a parameter may be owned by several ranks, each owning a
contiguous block of its dim-0 rows (Note [split plan] in :mod:`shardopt.partition`). The
bucket plan then works per block instead of per parameter: a bucket still holds whole
parameters (one gradient arrives per parameter, and a bucket is complete when every
parameter of it has arrived), but each block is an entry of its own, in its owner's part of
the send buffer with a "used" flag of its own. Copying a split parameter's gradient in writes
each block's rows (a contiguous range of the flattened gradient, as the rows are dim-0) into
its owner's part, scaled as a whole parameter's would be; the owner sums its rows in rank
order as it sums a whole gradient, and hands them over shaped ``(rows, *shape[1:])``. A rank
owns at most one block of a parameter, so the parameter still names what an owner receives.
The bytes sent are those of the unsplit plan: the all-to-all sends every rank its own part
from every rank, and a split only moves a parameter's elements between parts (plus one flag
per extra block). A parameter kept whole is one entry covering all its rows, so a plan
without split parameters is exactly the plan of whole parameters.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from shardopt import comm
from shardopt.partition import Block

__all__ = ["RECEIVE_FLOOR_BYTES", "BucketSpec", "BucketState", "GradBucket", "Reduced", "plan_buckets",
           "sources_per_round"]

RECEIVE_FLOOR_BYTES = 2 * 2**23 * 4
"""The receive buffers one bucket may hold at once even when that is more than twice the bucket
(Note [receive rounds]): two default buckets of fp32, the in-flight budget of the reduction queue."""


class BucketState(enum.Enum):
    """Where a bucket is in its iteration."""

    EMPTY = "empty"  # no buffer; nothing copied yet this iteration
    FILLING = "filling"  # buffer allocated, some gradients copied in
    IN_FLIGHT = "in_flight"  # all-to-all launched, not yet unpacked


_TRANSITIONS = {
    BucketState.EMPTY: {BucketState.FILLING},
    BucketState.FILLING: {BucketState.IN_FLIGHT},
    BucketState.IN_FLIGHT: {BucketState.EMPTY},
}


@dataclass(frozen=True)
class BucketSpec:
    """The static layout of one bucket (identical on every rank).

    Each entry is one owned block of a parameter's rows: the whole parameter, or for a
    parameter split across ranks one block per owner (Note [split parameters in buckets]).

    Attributes:
        index: launch order.
        params: the parameter of each entry, grouped by owner (owner 0's first), each group
            in model order (a split parameter appears once per block).
        owners: owner rank of each entry.
        offsets: where each entry's gradient rows start in the send buffer.
        flag_offsets: where each entry's "used" flag sits in the send buffer.
        splits: elements sent to each rank (its gradients plus its flags).
        wire_dtype: dtype on the wire.
        device: where the buffers live.
        grad_dtype: dtype of the owner's reduced gradient: the parameters' own, or their
            master's (Note [reduce into master gradients]).
        rows: the dim-0 rows ``(row_start, row_stop)`` of each entry's parameter it covers
            (all of them, ``(0, shape[0])`` or ``(0, 1)`` for a 0-dim parameter, unless the
            parameter is split).
    """

    index: int
    params: tuple[torch.nn.Parameter, ...]
    owners: tuple[int, ...]
    offsets: tuple[int, ...]
    flag_offsets: tuple[int, ...]
    splits: tuple[int, ...]
    wire_dtype: torch.dtype
    device: torch.device
    grad_dtype: torch.dtype
    rows: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        """Elements in the send buffer."""
        return sum(self.splits)

    def span(self, k: int) -> tuple[int, int]:
        """Elements ``[start, stop)`` of entry ``k``'s rows in its parameter's flattened gradient."""
        param = self.params[k]
        row_numel = param.numel() // _num_rows(param) if param.numel() else 0
        start, stop = self.rows[k]
        return start * row_numel, stop * row_numel

    def is_whole(self, k: int) -> bool:
        """Whether entry ``k`` covers all rows of its parameter."""
        return self.rows[k] == (0, _num_rows(self.params[k]))


def _num_rows(param: torch.Tensor) -> int:
    """dim-0 length (1 for a 0-dim tensor), as :mod:`shardopt.partition` counts rows."""
    return param.shape[0] if param.dim() else 1


def plan_buckets(
    params: Sequence[torch.nn.Parameter],
    owners: Sequence[int],
    num_ranks: int,
    cap_numel: int,
    wire_dtype_of: dict[torch.dtype, torch.dtype],
    grad_dtype_of: dict[torch.dtype, torch.dtype] | None = None,
    split: Mapping[int, Sequence[Block]] | None = None,
) -> list[BucketSpec]:
    """Pack parameters into buckets of at most ``cap_numel`` gradient elements.

    Parameters are taken in reverse model order (gradients arrive roughly that way in
    backward) and kept apart by (device, dtype). A parameter larger than the cap gets a
    bucket of its own; ``cap_numel=0`` gives every parameter its own bucket. A split
    parameter stays in one bucket, one entry per block (Note [split parameters in buckets]).

    Args:
        params: trainable parameters, in model order.
        owners: owner rank of each parameter.
        num_ranks: world size.
        cap_numel: gradient elements per bucket.
        wire_dtype_of: maps a parameter dtype to the dtype it is reduced in (absent: itself).
        grad_dtype_of: maps a parameter dtype to the dtype of the owner's reduced gradient
            (absent: itself), e.g. ``{torch.bfloat16: torch.float32}`` with master weights.
        split: for each parameter owned in row blocks by several ranks, by position in
            ``params``, its blocks (``Block.param`` is that position; contiguous, in row
            order, at most one per rank). Absent: each parameter whole to ``owners[i]``.

    Returns:
        The bucket specs, in launch order.

    Raises:
        ValueError: a parameter's blocks do not tile its rows in order, or give one rank
            two blocks of it.
    """
    blocks_of = _blocks(params, owners, split or {})
    open_buckets: dict[tuple[str, torch.dtype], list[int]] = {}
    groups: list[list[int]] = []
    for i in reversed(range(len(params))):
        key = (str(params[i].device), params[i].dtype)
        current = open_buckets.get(key)
        size = sum(params[j].numel() for j in current) if current else 0
        if current is None or size + params[i].numel() > cap_numel:
            current = []
            groups.append(current)
            open_buckets[key] = current
        current.append(i)
    specs = []
    for index, members in enumerate(groups):
        ordered = sorted((b for j in members for b in blocks_of[j]), key=lambda b: (b.owner, b.param, b.row_start))
        offsets, flag_offsets, splits = [], [], []
        cursor = 0
        for rank in range(num_ranks):
            mine = [b for b in ordered if b.owner == rank]
            start = cursor
            for b in mine:
                offsets.append(cursor)
                cursor += params[b.param].numel() // _num_rows(params[b.param]) * b.num_rows if b.num_rows else 0
            for _ in mine:
                flag_offsets.append(cursor)
                cursor += 1
            splits.append(cursor - start)
        first = params[ordered[0].param]
        specs.append(
            BucketSpec(
                index=index,
                params=tuple(params[b.param] for b in ordered),
                owners=tuple(b.owner for b in ordered),
                offsets=tuple(offsets),
                flag_offsets=tuple(flag_offsets),
                splits=tuple(splits),
                wire_dtype=wire_dtype_of.get(first.dtype, first.dtype),
                device=first.device,
                grad_dtype=(grad_dtype_of or {}).get(first.dtype, first.dtype),
                rows=tuple((b.row_start, b.row_stop) for b in ordered),
            )
        )
    return specs


def _blocks(params: Sequence[torch.nn.Parameter], owners: Sequence[int],
            split: Mapping[int, Sequence[Block]]) -> list[tuple[Block, ...]]:
    """Each parameter's blocks: its ``split`` ones, checked, or one whole block on its owner."""
    out = []
    for j, p in enumerate(params):
        rows = _num_rows(p)
        blocks = tuple(split.get(j, ())) or (Block(j, 0, rows, owners[j]),)
        cuts = [(b.row_start, b.row_stop) for b in blocks]
        tiled = (all(b.param == j for b in blocks) and cuts[0][0] == 0 and cuts[-1][1] == rows
                 and all(a[1] == b[0] for a, b in itertools.pairwise(cuts)))
        if not tiled or len({b.owner for b in blocks}) != len(blocks):
            raise ValueError(
                f"split[{j}] = {cuts} (owners {[b.owner for b in blocks]}) for a parameter of {rows} rows: the blocks "
                "of a split parameter must tile rows 0..shape[0] in order with one block per owner; pass the blocks "
                "of OSS.plan for that parameter"
            )
        out.append(blocks)
    return out


def sources_per_round(spec: BucketSpec) -> int:
    """How many ranks send in one round of ``spec``'s all-to-all (Note [receive rounds]).

    Args:
        spec: the bucket.

    Returns:
        ``K``: at least 2, and such that ``K`` times the largest share of the bucket, in the
        wire dtype, is at most ``max(2 * spec bytes, RECEIVE_FLOOR_BYTES)``; the number of
        ranks when every rank's share is empty. ``K >= N`` means one round.
    """
    itemsize = spec.wire_dtype.itemsize
    share = max(spec.splits, default=0) * itemsize
    if share == 0:
        return max(2, len(spec.splits))
    return max(2, max(2 * spec.numel * itemsize, RECEIVE_FLOOR_BYTES) // share)


class Reduced(NamedTuple):
    """One reduced gradient this rank owns, as :meth:`GradBucket.finish` hands it over."""

    param: torch.nn.Parameter
    grad: torch.Tensor | None
    """The summed gradient (of this rank's rows, shaped ``(rows, *shape[1:])``, for a split
    parameter), or ``None`` when it is known that no rank had one."""
    used: torch.Tensor | None
    """``None`` when ``grad`` is decided; else the summed flag (a 1-element device tensor): the
    gradient counts only if it is above zero, read later with the others (Note [host reads
    per step])."""


class GradBucket:
    """One bucket's buffers and progress through an iteration: its send pieces while it
    fills, and once launched its pending all-to-all and receive pieces, until :meth:`finish`
    (the all-to-all in rounds where one would receive too much: Note [receive rounds]).

    Args:
        spec: the static layout.
        rank: this process's rank.
        scale: factor applied to each gradient as it is copied in (``1 / world_size``).
    """

    def __init__(self, spec: BucketSpec, rank: int, scale: float) -> None:
        self.spec = spec
        self._rank = rank
        self._scale = scale
        self._entries: dict[torch.nn.Parameter, tuple[int, ...]] = {}  # a split parameter has several
        for k, p in enumerate(spec.params):
            self._entries[p] = (*self._entries.get(p, ()), k)
        self._spans = [spec.span(k) for k in range(len(spec.params))]
        self.state = BucketState.EMPTY
        self._send: list[torch.Tensor] | None = None
        self._recv: list[torch.Tensor] = []  # the pieces of the round in flight, in rank order
        self._pool: list[torch.Tensor] = []  # receive buffers, reused by later rounds
        self._group: comm.ProcessGroup | None = None
        self._per_round = sources_per_round(spec)
        self._owns = rank in spec.owners
        self._pending: comm.PendingWork | None = None
        self._spent: list[torch.Tensor] = []
        self._filled: set[int] = set()
        self._used_here: frozenset[int] = frozenset()
        # Where each parameter's gradient and flag sit inside its owner's piece.
        base = [sum(spec.splits[:r]) for r in range(len(spec.splits))]
        self._slot = [(o, spec.offsets[k] - base[o], spec.flag_offsets[k] - base[o]) for k, o in enumerate(spec.owners)]
        # Each destination's flags are contiguous (plan_buckets): one range per owner.
        self._flag_ranges: dict[int, tuple[int, int]] = {}
        for owner, _, flag in self._slot:
            lo, hi = self._flag_ranges.get(owner, (flag, flag + 1))
            self._flag_ranges[owner] = (min(lo, flag), max(hi, flag + 1))

    def _allocate(self) -> list[torch.Tensor]:
        """One send piece per destination (Note [bucket pieces])."""
        return [torch.empty(n, dtype=self.spec.wire_dtype, device=self.spec.device) for n in self.spec.splits]

    def _to(self, state: BucketState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise AssertionError(f"[rank {self._rank}] bucket {self.spec.index}: {self.state.name} -> {state.name}")
        self.state = state

    @property
    def nbytes(self) -> int:
        """Bytes of the send buffer (what the bucket holds while in flight)."""
        return self.spec.numel * self.spec.wire_dtype.itemsize

    @property
    def holds_buffers(self) -> bool:
        """Whether the bucket holds send or receive pieces (only between its first gradient
        of an iteration and :meth:`finish`, or :meth:`release` when finish kept them)."""
        return self._send is not None or bool(self._recv) or bool(self._pool) or bool(self._spent)

    @property
    def complete(self) -> bool:
        """Every parameter of the bucket has its gradient copied in."""
        return len(self._filled) == len(self.spec.params)

    def holds(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param``'s gradient is already in the bucket this iteration."""
        return self._entries[param][0] in self._filled

    def add(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Copy ``grad * scale`` into the parameter's slot, or each block's rows into its
        owner's slot for a split parameter (the flags are set at :meth:`launch`).

        A gradient narrower than the wire (bf16 into an fp32 bucket) is widened exactly
        first and scaled in the wire dtype; otherwise the product is rounded to the wire.
        """
        if self.state is BucketState.EMPTY:
            self._send = self._allocate()
            self._to(BucketState.FILLING)
        if self.state is not BucketState.FILLING:
            raise AssertionError(
                f"[rank {self._rank}] a gradient for a parameter of bucket {self.spec.index} arrived after "
                "the bucket was sent: a parameter got two gradients in one backward pass"
            )
        entries = self._entries[param]
        if entries[0] in self._filled:
            raise AssertionError(f"[rank {self._rank}] parameter {entries[0]} of bucket {self.spec.index} filled twice")
        assert self._send is not None
        flat = grad.reshape(-1)
        for k in entries:  # one per owned block (Note [split parameters in buckets])
            owner, start, _ = self._slot[k]
            lo, hi = self._spans[k]
            slot = self._send[owner][start : start + hi - lo]
            source = flat if len(entries) == 1 else flat[lo:hi]
            if grad.dtype.itemsize < slot.dtype.itemsize:
                slot.copy_(source).mul_(self._scale)
            else:
                torch.mul(source, self._scale, out=slot)
            self._filled.add(k)

    def launch(self, group: comm.ProcessGroup | None, num_ranks: int) -> None:
        """Set the flags, zero the slots nobody filled and send (the first round: Note [receive
        rounds]); the bucket keeps the pending work and the received pieces (this rank's own is
        its send piece) until :meth:`finish`. Only slice writes: nothing waits for the device
        (Note [host reads per step])."""
        if self.state is BucketState.EMPTY:
            self._send = self._allocate()
            self._to(BucketState.FILLING)
        assert self._send is not None
        for owner, (lo, hi) in self._flag_ranges.items():
            self._send[owner][lo:hi].fill_(1)
        for k in range(len(self.spec.params)):
            if k not in self._filled:
                owner, start, flag = self._slot[k]
                lo, hi = self._spans[k]
                self._send[owner][start : start + hi - lo].zero_()
                self._send[owner][flag : flag + 1].zero_()
        self._group = group
        self._post_round(0, num_ranks)
        self._used_here = frozenset(self._filled)
        self._filled.clear()
        self._to(BucketState.IN_FLIGHT)

    def _post_round(self, j: int, num_ranks: int) -> None:
        """Post round ``j`` of the all-to-all (Note [receive rounds]): the ranks of its window
        send every rank its piece, and every rank receives theirs, the own one being its send
        piece and the others landing in the reused receive buffers."""
        assert self._send is not None
        me, k = self._rank, self._per_round
        window = range(j * k, min(num_ranks, (j + 1) * k))
        nothing = self._send[me].new_empty(0)
        outputs = [nothing] * num_ranks
        others = [source for source in window if source != me]
        for slot, source in enumerate(others):
            outputs[source] = self._buffer(slot)
        if me in window:
            outputs[me] = self._send[me]
        inputs = self._send if me in window else [nothing] * num_ranks
        self._pending = comm.all_to_all_pieces(outputs, inputs, self._group,
                                               label=f"shardopt::sdp::reduce::bucket{self.spec.index}")
        self._recv = [outputs[source] for source in window]

    def _buffer(self, slot: int) -> torch.Tensor:
        """The ``slot``-th receive buffer of a round (one share in the wire dtype), made on first use."""
        while len(self._pool) <= slot:
            self._pool.append(torch.empty(self.spec.splits[self._rank], dtype=self.spec.wire_dtype,
                                          device=self.spec.device))
        return self._pool[slot]

    def finish(self, num_ranks: int, release: bool = True) -> list[Reduced]:
        """Wait for the all-to-all, then sum the received copies (rank order) into this rank's
        reduced gradients and release the bucket's pieces (or, with ``release=False``, keep
        them until :meth:`release`: Note [reductions on a side stream] in ``streams``).

        Returns:
            A :class:`Reduced` for each parameter this rank owns (rows of) in the bucket.
        """
        total = self.finish_sum(num_ranks, release)
        return [] if total is None else self.items(total, alone=num_ranks == 1)

    def finish_sum(self, num_ranks: int, release: bool = True) -> torch.Tensor | None:
        """As :meth:`finish`, but return this rank's part of the bucket summed over the group:
        its entries' rows then their "used" flags, one tensor in the gradient dtype (``None``
        when it owns nothing here), for :meth:`items` (Note [hybrid reduction] in ``replicas``
        all-reduces it across replicas first)."""
        assert self._pending is not None, f"[rank {self._rank}] bucket {self.spec.index} finished without being launched"
        total: torch.Tensor | None = None
        for j in range(-(-num_ranks // self._per_round)):  # Note [receive rounds]
            if j:
                self._post_round(j, num_ranks)
            pending, pieces = self._pending, self._recv
            self._pending, self._recv = None, []
            assert pending is not None
            pending.wait()
            if self._owns:
                total = self._add(total, pieces)
        self._to(BucketState.EMPTY)
        # A piece the sum was made in now holds the owner's gradients and stays.
        self._spent = [piece for piece in self._pool + (self._send or []) if piece is not total]
        self._pool, self._send = [], None
        if release:
            self.release()
        return total

    def release(self) -> None:
        """Free the pieces of the last transfer (Note [release scratch buffers] in
        shardopt.comm): only once no stream can still read them."""
        for piece in self._spent:
            comm.release_storage(piece)
        self._spent = []

    def _add(self, total: torch.Tensor | None, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Add one round's received pieces, in rank order, to the owner's sum so far (``None``
        before rank 0's piece).

        Note [sum in place]: the sum is made in rank 0's received piece when it already has the
        gradient dtype (no new buffer, no copy), else in one widened copy of it, the other rows
        added in their wire dtype (a mixed-dtype add computes in the wider dtype, exactly as
        widening each row first did, without a widened copy per row). A receive buffer that
        becomes the sum leaves the pool, so a later round does not overwrite it.
        """
        for piece in pieces:
            if total is None:
                total = piece if piece.dtype == self.spec.grad_dtype else piece.to(self.spec.grad_dtype)
                self._pool = [buffer for buffer in self._pool if buffer is not total]
            else:
                total.add_(piece)
        assert total is not None, f"[rank {self._rank}] bucket {self.spec.index}: a round without pieces"
        return total

    def items(self, total: torch.Tensor, alone: bool) -> list[Reduced]:
        """This rank's reduced gradients, as views of ``total`` (from :meth:`finish_sum`).

        Args:
            total: this rank's part of the bucket, summed over every rank that reduces.
            alone: no other rank reduces (then unused here is unused everywhere).
        """
        mine = [k for k, owner in enumerate(self.spec.owners) if owner == self._rank]
        base = self.spec.offsets[mine[0]]
        out: list[Reduced] = []
        for k in mine:
            param = self.spec.params[k]
            start = self.spec.offsets[k] - base
            lo, hi = self._spans[k]
            grad = total[start : start + hi - lo]
            if self.spec.is_whole(k):
                grad = grad.view_as(param)
            else:  # this rank's rows of a split parameter (Note [split parameters in buckets])
                row_start, row_stop = self.spec.rows[k]
                grad = grad.view(row_stop - row_start, *param.shape[1:])
            if k in self._used_here or alone:
                # Used here, so used somewhere; alone, unused here is unused everywhere.
                out.append(Reduced(param, grad if k in self._used_here else None, None))
            else:
                flag = self.spec.flag_offsets[k] - base
                out.append(Reduced(param, grad, total[flag : flag + 1]))
        return out
