"""Pure, deterministic assignment of parameters to ranks.

Everything here is plain Python over integers: no torch, no process group, no ``id()``. The
same sizes and world size give the same :class:`Partition` on every rank, which is what lets
the optimizer and the data-parallel wrapper agree on ownership without talking.

Two planners. :func:`partition_by_size` gives each parameter whole to one rank (what
:class:`~shardopt.optim.OSS` uses today). :func:`plan_split` also cuts a parameter larger than
its fair share into contiguous dim-0 blocks of whole rows owned by several ranks
(:class:`Block`, :class:`SplitPlan`; Note [split plan]), at cuts aligned for exact kernels
(Note [aligned cuts]); :func:`plan_whole` is the same record with every parameter whole. OSS
plans with one or the other (``split_large_params``).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["CUT_ALIGN_ELEMENTS", "Block", "Partition", "SplitPlan", "cut_quantum", "partition_by_size", "plan_split",
           "plan_whole"]



def _imbalance(totals: Sequence[int]) -> float:
    """The largest of ``totals`` over their mean (1.0 when all are zero)."""
    mean = sum(totals) / len(totals)
    return max(totals) / mean if mean > 0 else 1.0

@dataclass(frozen=True)
class Partition:
    """Which rank owns which parameter.

    Parameters are identified by their position in the sequence the partition was built
    from (for :class:`~shardopt.optim.OSS`: the order of ``OSS.params``).

    Attributes:
        num_ranks: the world size the plan is for.
        sizes: bytes of each parameter (0 for a parameter that needs no owner work, such as
            a frozen one).
        owners: the owning rank of each parameter.
    """

    num_ranks: int
    sizes: tuple[int, ...]
    owners: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.owners):
            raise ValueError(f"sizes ({len(self.sizes)}) and owners ({len(self.owners)}) differ in length")
        bad = [o for o in self.owners if not 0 <= o < self.num_ranks]
        if bad:
            raise ValueError(f"owners must be in [0, {self.num_ranks}), got {bad[:5]}")

    @property
    def num_params(self) -> int:
        """How many parameters the plan covers."""
        return len(self.owners)

    @property
    def rank_bytes(self) -> tuple[int, ...]:
        """Total bytes owned by each rank."""
        totals = [0] * self.num_ranks
        for size, owner in zip(self.sizes, self.owners, strict=True):
            totals[owner] += size
        return tuple(totals)

    @property
    def imbalance(self) -> float:
        """Largest rank's bytes over the mean (1.0 is perfect; 1.0 when there is nothing)."""
        return _imbalance(self.rank_bytes)

    def indices_of(self, rank: int) -> tuple[int, ...]:
        """Indices of the parameters ``rank`` owns, in their original order."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        return tuple(i for i, owner in enumerate(self.owners) if owner == rank)


def partition_by_size(sizes: Sequence[int], num_ranks: int) -> Partition:
    """Assign each parameter to a rank, balancing bytes (greedy LPT).

    Parameters are taken largest first (ties by original index) and each goes to the rank
    with the fewest bytes so far (ties by lowest rank). This is Graham's LPT rule: the
    largest rank holds at most ``4/3 - 1/(3 * num_ranks)`` times the optimum, and never more
    than the mean plus the largest parameter.

    Args:
        sizes: bytes of each parameter, in a fixed order; non-negative ints.
        num_ranks: how many ranks to spread them over (>= 1).

    Returns:
        The frozen :class:`Partition`.

    Raises:
        ValueError: ``num_ranks`` < 1 or a negative size.
    """
    _check_sizes(sizes, num_ranks)
    owners, _ = _lpt(sizes, range(len(sizes)), num_ranks)
    return Partition(num_ranks=num_ranks, sizes=tuple(int(s) for s in sizes), owners=tuple(owners))


def _check_sizes(sizes: Sequence[int], num_ranks: int) -> None:
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    negative = [(i, s) for i, s in enumerate(sizes) if s < 0]
    if negative:
        raise ValueError(f"sizes must be >= 0; parameter {negative[0][0]} has size {negative[0][1]}")


def _lpt(sizes: Sequence[int], indices: Sequence[int], num_ranks: int) -> tuple[list[int], list[int]]:
    """Greedy LPT over ``indices``: owners for every index of ``sizes`` (0 for those left out)
    and each rank's bytes. Largest first, ties by index; lightest rank, ties by lowest rank."""
    order = sorted(indices, key=lambda i: (-sizes[i], i))
    heap = [(0, rank) for rank in range(num_ranks)]  # (bytes so far, rank): lightest, then lowest rank
    owners = [0] * len(sizes)
    for i in order:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + sizes[i], rank))
    loads = [0] * num_ranks
    for load, rank in heap:
        loads[rank] = load
    return owners, loads


# Note [split plan]
# The whole-parameter plan cannot beat its largest parameter: on a Llama-3-8B shape the
# untied embedding and head are 525M parameters each (6.5% of the model), so from 16 ranks up
# the heaviest rank holds a whole one and the imbalance grows with N (4.19x at 64 ranks, 16.8x
# at 256, 67x at 1024). `plan_split` cuts such parameters into contiguous dim-0 blocks of
# whole rows (what FSDP2 does to every parameter, here only where balance needs it):
#
# 1. R is the widest row (bytes of one dim-0 slice) of any parameter with >= 2 rows; the
#    promise is the heaviest rank <= mean + R. A parameter larger than mean + R cannot be
#    whole on one rank and keep that promise, so those are split from the start.
# 2. Every other parameter stays whole and goes by LPT (largest first onto the lightest rank,
#    ties by index, as `partition_by_size`). The split parameters, in index order, form one
#    stream of rows that fills the ranks up to a common water level (ranks in ascending
#    order, each up to the level; a rank already above it takes nothing). Cuts fall on the
#    row boundary at or below each rank's cumulative share, so a rank ends at most one row
#    over the level, and the level is at most the mean.
# 3. While the heaviest rank is still over mean + R (the whole parameters' LPT is the
#    bottleneck), the next largest whole parameter with >= 2 rows joins the stream; the
#    first plan within the promise is returned, else the best one seen (fewest splits on a
#    tie). A parameter with one row or none (a 0-dim tensor is one row) is never split.
#
# Blocks of one parameter are contiguous, in row order, and owned by ascending ranks; the
# arithmetic is integers and Fractions, so every rank computes the same plan. With a cut
# quantum q_i (Note [aligned cuts]) every cut of parameter i falls on a multiple of q_i rows:
# read "row" above as "q_i rows" (R is then the widest quantum in bytes, and a parameter is
# splittable when it has at least two quanta).


# Note [aligned cuts]
# An elementwise optimizer on a block of rows is not always bit for bit the same optimizer on
# the whole tensor. torch's CPU kernels run a vectorized loop over chunks of 2 vectors and a
# scalar loop over the tail (ATen's `vectorized_loop`), and the two may round differently
# (the vector path of `add(alpha=)` is a fused multiply-add, the scalar one is not). A block
# has its own tail, so elements near a cut could take the other path than in the whole
# tensor. Measured with torch 2.13 on CPU (AVX-512 and AVX2 dispatch, one thread): bf16 SGD
# with momentum, RMSprop with momentum and ASGD, and fp32 fused SGD and Adam, differ by one
# rounding on a few elements of unaligned row blocks, and never when every block but the last
# is a multiple of 64 elements (2 vectors of the widest type: 32 bf16 lanes of AVX-512). So OSS
# cuts parameter i only at multiples of `cut_quantum(row_numel) = 64 / gcd(64, row_numel)` rows:
# one row for any width that is a multiple of 64 (every hidden size of a real model), up to 64
# rows for odd widths. With several intra-op threads a kernel also splits a large tensor at
# thread boundaries that depend on its length, so exactness against the unsplit step holds for
# one thread per rank (bf16 and fused kernels; the fp32 for-loop and foreach forms measured
# exact either way).
CUT_ALIGN_ELEMENTS = 64
"""Every block but a parameter's last holds a multiple of this many elements (Note [aligned cuts])."""


def cut_quantum(row_numel: int) -> int:
    """Rows per cut unit of a parameter whose rows hold ``row_numel`` elements (Note [aligned cuts]).

    Args:
        row_numel: elements in one dim-0 row (``numel // shape[0]``; 1 for a 0-dim tensor).

    Returns:
        The smallest row count whose elements are a multiple of :data:`CUT_ALIGN_ELEMENTS` (1 when
        ``row_numel`` is 0).
    """
    return 1 if row_numel <= 0 else CUT_ALIGN_ELEMENTS // math.gcd(CUT_ALIGN_ELEMENTS, row_numel)


@dataclass(frozen=True)
class Block:
    """Rows ``[row_start, row_stop)`` of dim 0 of one parameter, owned by one rank.

    Attributes:
        param: the parameter's index in the sequence the plan was built from.
        row_start: first row (inclusive).
        row_stop: last row (exclusive); ``row_start == row_stop == 0`` for an empty parameter.
        owner: the owning rank.
    """

    param: int
    row_start: int
    row_stop: int
    owner: int

    @property
    def num_rows(self) -> int:
        """Rows in the block."""
        return self.row_stop - self.row_start


@dataclass(frozen=True)
class SplitPlan:
    """Which rank owns which rows of which parameter (Note [split plan]).

    A parameter kept whole is one :class:`Block` covering all its rows; a split one is
    several contiguous blocks on ascending ranks.

    Attributes:
        num_ranks: the world size the plan is for.
        sizes: bytes of each parameter.
        rows: dim-0 length of each parameter (1 for a 0-dim tensor).
        blocks: every block, ordered by parameter then first row.
        row_slack: R, the widest cut quantum in bytes (one row without quanta) of any
            parameter with at least two quanta (0 if none, and for :func:`plan_whole`): the
            heaviest rank is promised to be within ``mean + R`` when every parameter can be
            split.
    """

    num_ranks: int
    sizes: tuple[int, ...]
    rows: tuple[int, ...]
    blocks: tuple[Block, ...]
    row_slack: int

    def block_bytes(self, block: Block) -> int:
        """Bytes of ``block`` (its rows times its parameter's row width)."""
        rows = self.rows[block.param]
        return 0 if rows == 0 else self.sizes[block.param] // rows * block.num_rows

    @property
    def rank_bytes(self) -> tuple[int, ...]:
        """Total bytes owned by each rank."""
        totals = [0] * self.num_ranks
        for block in self.blocks:
            totals[block.owner] += self.block_bytes(block)
        return tuple(totals)

    @property
    def imbalance(self) -> float:
        """Largest rank's bytes over the mean (1.0 is perfect; 1.0 when there is nothing)."""
        return _imbalance(self.rank_bytes)

    @property
    def split_params(self) -> tuple[int, ...]:
        """Indices of the parameters cut into more than one block, ascending."""
        return tuple(sorted({b.param for b in self.blocks if b.num_rows < self.rows[b.param]}))

    def blocks_of(self, param: int) -> tuple[Block, ...]:
        """The blocks of parameter ``param``, in row order."""
        return tuple(b for b in self.blocks if b.param == param)

    def blocks_of_rank(self, rank: int) -> tuple[Block, ...]:
        """The blocks ``rank`` owns, ordered by parameter then row."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank}")
        return tuple(b for b in self.blocks if b.owner == rank)


def plan_split(sizes: Sequence[int], rows: Sequence[int], num_ranks: int,
               quanta: Sequence[int] | None = None) -> SplitPlan:
    """Assign parameters to ranks, cutting large ones into dim-0 blocks of whole rows.

    How it works: Note [split plan]. Parameters at most ``mean + R`` bytes stay whole (LPT,
    as :func:`partition_by_size`); larger ones, and then the next largest while the heaviest
    rank is over ``mean + R``, are spread in contiguous row blocks over the lightest ranks.
    When nothing needs cutting the plan gives every parameter the owner
    :func:`partition_by_size` gives it.

    Args:
        sizes: bytes of each parameter, in a fixed order; non-negative ints.
        rows: each parameter's dim-0 length (``shape[0]``; 1 for a 0-dim tensor); each size
            must be a whole number of rows.
        num_ranks: how many ranks to spread them over (>= 1).
        quanta: optional cut quantum of each parameter in rows (>= 1): its cuts fall only on
            multiples of it (OSS passes :func:`cut_quantum`, Note [aligned cuts]). Default: 1.

    Returns:
        The frozen :class:`SplitPlan`.

    Raises:
        ValueError: ``num_ranks`` < 1, a negative size or row count, ``rows`` or ``quanta`` of
            another length than ``sizes``, a quantum < 1, or a size that is not a whole number
            of rows.
    """
    sizes_t, rows_t, quanta_t = _check_rows(sizes, rows, num_ranks, quanta)
    splittable = sorted((i for i in range(len(sizes_t)) if rows_t[i] > quanta_t[i] and sizes_t[i] > 0),
                        key=lambda i: (-sizes_t[i], i))
    slack = max((sizes_t[i] // rows_t[i] * quanta_t[i] for i in splittable), default=0)
    mean = Fraction(sum(sizes_t), num_ranks)
    count = sum(1 for i in splittable if sizes_t[i] > mean + slack)
    best: tuple[int, list[Block]] | None = None
    while True:
        blocks, heaviest = _plan_with(sizes_t, rows_t, quanta_t, num_ranks, set(splittable[:count]))
        if best is None or heaviest < best[0]:
            best = (heaviest, blocks)
        if heaviest <= mean + slack or count == len(splittable):
            break
        count += 1
    return SplitPlan(num_ranks, sizes_t, rows_t, tuple(sorted(best[1], key=lambda b: (b.param, b.row_start))),
                     slack)


def plan_whole(sizes: Sequence[int], rows: Sequence[int], num_ranks: int) -> SplitPlan:
    """The :class:`SplitPlan` that keeps every parameter whole: one block each, on the owner
    :func:`partition_by_size` gives it (what OSS plans for a matrix-wise optimizer).

    Args:
        sizes: bytes of each parameter, in a fixed order; non-negative ints.
        rows: each parameter's dim-0 length (1 for a 0-dim tensor), as for :func:`plan_split`.
        num_ranks: how many ranks to spread them over (>= 1).

    Raises:
        ValueError: as :func:`plan_split`.
    """
    sizes_t, rows_t, _ = _check_rows(sizes, rows, num_ranks, None)
    owners = partition_by_size(sizes_t, num_ranks).owners
    return SplitPlan(num_ranks, sizes_t, rows_t, tuple(Block(i, 0, rows_t[i], owners[i]) for i in range(len(sizes_t))),
                     0)


def _check_rows(sizes: Sequence[int], rows: Sequence[int], num_ranks: int,
                quanta: Sequence[int] | None) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Validate a planner's input; return sizes, rows and quanta as int tuples."""
    _check_sizes(sizes, num_ranks)
    if len(rows) != len(sizes):
        raise ValueError(f"rows ({len(rows)}) and sizes ({len(sizes)}) differ in length; give one dim-0 length "
                         "per parameter")
    if quanta is not None and len(quanta) != len(sizes):
        raise ValueError(f"quanta ({len(quanta)}) and sizes ({len(sizes)}) differ in length; give one cut quantum "
                         "per parameter, or none")
    if quanta is not None and any(q < 1 for q in quanta):
        raise ValueError(f"quanta must be >= 1 rows, got {min(quanta)}; pass cut_quantum(row_numel) per parameter")
    for i, (size, count) in enumerate(zip(sizes, rows, strict=True)):
        if count < 0 or (count == 0 and size != 0) or (count > 0 and size % count):
            raise ValueError(f"parameter {i} has size {size} and rows {count}: sizes must be whole rows (numel * "
                             "element_size with rows = shape[0], 1 for a 0-dim tensor)")
    quanta_t = tuple(int(q) for q in quanta) if quanta is not None else (1,) * len(sizes)
    return tuple(int(s) for s in sizes), tuple(int(r) for r in rows), quanta_t


def _water_level(loads: Sequence[int], amount: int) -> Fraction:
    """The level L with ``sum(max(0, L - load)) == amount`` (pour ``amount`` onto the lowest)."""
    ordered = sorted(loads)
    prefix = 0
    for k, load in enumerate(ordered, start=1):
        prefix += load
        level = Fraction(amount + prefix, k)
        if k == len(ordered) or level <= ordered[k]:
            return level
    raise AssertionError("unreachable: the last rank always closes the loop")


def _plan_with(sizes: tuple[int, ...], rows: tuple[int, ...], quanta: tuple[int, ...], num_ranks: int,
               split: set[int]) -> tuple[list[Block], int]:
    """Blocks and the heaviest rank's bytes with ``split`` cut and everything else whole."""
    whole = [i for i in range(len(sizes)) if i not in split]
    owners, loads = _lpt(sizes, whole, num_ranks)
    blocks = [Block(i, 0, rows[i], owners[i]) for i in whole]
    stream = sorted(split)
    offsets = [0]
    for i in stream:
        offsets.append(offsets[-1] + sizes[i])
    level = _water_level(loads, offsets[-1])
    position, filled = (0, 0), Fraction(0)  # (index into stream, row): where the next rank starts
    for rank in range(num_ranks):
        filled += max(Fraction(0), level - loads[rank])
        end = _cut_at(sizes, rows, quanta, stream, offsets, filled)
        for j in range(position[0], min(end[0], len(stream) - 1) + 1):
            start = position[1] if j == position[0] else 0
            stop = end[1] if j == end[0] else rows[stream[j]]
            if stop > start:
                blocks.append(Block(stream[j], start, stop, rank))
                loads[rank] += sizes[stream[j]] // rows[stream[j]] * (stop - start)
        position = end
    return blocks, max(loads)


def _cut_at(sizes: tuple[int, ...], rows: tuple[int, ...], quanta: tuple[int, ...], stream: Sequence[int],
            offsets: Sequence[int], filled: Fraction) -> tuple[int, int]:
    """The cut (a multiple of the parameter's quantum) of the stream at or below byte
    ``filled``, as (stream index, row)."""
    if filled >= offsets[-1]:
        return (len(stream), 0)
    j = bisect.bisect_right(offsets, filled) - 1
    row_bytes = sizes[stream[j]] // rows[stream[j]]
    row = int((filled - offsets[j]) // row_bytes)
    return (j, row - row % quanta[stream[j]])
