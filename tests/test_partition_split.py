"""Properties of the row-splitting planner ``plan_split`` (hypothesis) and its error messages."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardopt.partition import CUT_ALIGN_ELEMENTS, Block, SplitPlan, cut_quantum, partition_by_size, plan_split, plan_whole

# (rows, bytes per row): rows 0 (an empty tensor), 1 (a 0-dim or one-row tensor) and many
params_st = st.lists(st.tuples(st.integers(min_value=0, max_value=300), st.integers(min_value=1, max_value=64)),
                     min_size=0, max_size=40)
ranks_st = st.integers(min_value=1, max_value=17)


def _sizes_rows(params: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [rows * width for rows, width in params], [rows for rows, _ in params]


@settings(max_examples=300, deadline=None)
@given(params=params_st, num_ranks=ranks_st)
def test_every_row_is_owned_exactly_once_in_contiguous_blocks_on_ascending_ranks(
        params: list[tuple[int, int]], num_ranks: int) -> None:
    sizes, rows = _sizes_rows(params)
    plan = plan_split(sizes, rows, num_ranks)
    assert list(plan.blocks) == sorted(plan.blocks, key=lambda b: (b.param, b.row_start))
    for i in range(len(sizes)):
        blocks = plan.blocks_of(i)
        assert blocks and blocks[0].row_start == 0 and blocks[-1].row_stop == rows[i]
        for a, b in itertools.pairwise(blocks):
            assert a.row_stop == b.row_start and a.owner < b.owner  # contiguous, ascending ranks
        assert all(b.num_rows > 0 for b in blocks) or blocks == (Block(i, 0, 0, blocks[0].owner),)
    assert sum(plan.rank_bytes) == sum(sizes)
    for r in range(num_ranks):
        assert plan.rank_bytes[r] == sum(plan.block_bytes(b) for b in plan.blocks_of_rank(r))


@settings(max_examples=300, deadline=None)
@given(params=params_st, num_ranks=ranks_st)
def test_heaviest_rank_within_one_row_of_the_mean_or_of_an_unsplittable_parameter(
        params: list[tuple[int, int]], num_ranks: int) -> None:
    sizes, rows = _sizes_rows(params)
    plan = plan_split(sizes, rows, num_ranks)
    mean = Fraction(sum(sizes), num_ranks)
    widest = max((s // r for s, r in zip(sizes, rows, strict=True) if r >= 2), default=0)
    assert plan.row_slack == widest
    largest_unsplittable = max((s for s, r in zip(sizes, rows, strict=True) if r <= 1), default=0)
    assert max(plan.rank_bytes, default=0) <= mean + max(widest, largest_unsplittable)
    if largest_unsplittable == 0:  # everything can be cut: one row of the widest parameter from the ideal
        assert max(plan.rank_bytes) <= mean + widest


@settings(max_examples=300, deadline=None)
@given(params=params_st, num_ranks=ranks_st)
def test_nothing_is_split_that_need_not_be(params: list[tuple[int, int]], num_ranks: int) -> None:
    sizes, rows = _sizes_rows(params)
    plan = plan_split(sizes, rows, num_ranks)
    whole = partition_by_size(sizes, num_ranks)
    mean = Fraction(sum(sizes), num_ranks)
    for i in plan.split_params:
        assert rows[i] >= 2  # a parameter with one row or none stays whole
    for i, (size, count) in enumerate(zip(sizes, rows, strict=True)):
        if count >= 2 and size > mean + plan.row_slack:  # cannot be whole and keep the promise
            assert i in plan.split_params
    if max(whole.rank_bytes) <= mean + plan.row_slack:  # today's plan keeps the promise: it is the plan
        assert plan.split_params == ()
        assert tuple(plan.blocks_of(i)[0].owner for i in range(len(sizes))) == whole.owners


@settings(max_examples=100, deadline=None)
@given(params=params_st, num_ranks=ranks_st)
def test_same_input_same_plan(params: list[tuple[int, int]], num_ranks: int) -> None:
    sizes, rows = _sizes_rows(params)
    assert plan_split(sizes, rows, num_ranks) == plan_split(tuple(sizes), tuple(rows), num_ranks)


def test_a_large_parameter_is_cut_into_row_blocks_over_the_lightest_ranks() -> None:
    # 12 rows of 10 bytes and two whole 20-byte parameters on 4 ranks: mean 40; the big one is split
    plan = plan_split([120, 20, 20], [12, 2, 2], 4)
    assert plan.split_params == (0,)
    assert plan.blocks_of(1) == (Block(1, 0, 2, 0),) and plan.blocks_of(2) == (Block(2, 0, 2, 1),)
    assert plan.blocks_of(0) == (Block(0, 0, 2, 0), Block(0, 2, 4, 1), Block(0, 4, 8, 2), Block(0, 8, 12, 3))
    assert plan.rank_bytes == (40, 40, 40, 40) and plan.imbalance == 1.0


def test_one_row_and_zero_dim_parameters_stay_whole() -> None:
    plan = plan_split([100, 4, 0], [1, 1, 0], 4)
    assert plan.split_params == ()
    assert plan.blocks == (Block(0, 0, 1, 0), Block(1, 0, 1, 1), Block(2, 0, 0, 2))
    assert plan.imbalance == pytest.approx(100 / 26)


def test_split_plan_is_frozen() -> None:
    plan = plan_split([8], [2], 2)
    with pytest.raises(AttributeError):
        plan.blocks = ()  # type: ignore[misc]
    assert isinstance(plan, SplitPlan)


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match="num_ranks must be a positive int, got 0"):
        plan_split([1], [1], 0)
    with pytest.raises(ValueError, match=r"rows \(2\) and sizes \(1\) differ in length"):
        plan_split([4], [2, 2], 2)
    with pytest.raises(ValueError, match="parameter 0 has size 10 and rows 3: sizes must be whole rows"):
        plan_split([10], [3], 2)
    with pytest.raises(ValueError, match="parameter 1 has size 4 and rows 0"):
        plan_split([2, 4], [1, 0], 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        plan_split([4], [2], 2).blocks_of_rank(2)


quanta_params_st = st.lists(st.tuples(st.integers(min_value=0, max_value=300), st.integers(min_value=1, max_value=64),
                                      st.integers(min_value=1, max_value=8)), min_size=0, max_size=30)


@settings(max_examples=300, deadline=None)
@given(params=quanta_params_st, num_ranks=ranks_st)
def test_cuts_fall_on_quanta_and_the_heaviest_rank_is_within_one_quantum_of_the_mean(
        params: list[tuple[int, int, int]], num_ranks: int) -> None:
    sizes, rows = [r * w for r, w, _ in params], [r for r, _, _ in params]
    quanta = [q for _, _, q in params]
    plan = plan_split(sizes, rows, num_ranks, quanta)
    for b in plan.blocks:
        assert b.row_start % quanta[b.param] == 0  # every cut on a multiple of the quantum
        assert b.row_stop % quanta[b.param] == 0 or b.row_stop == rows[b.param]
    assert sum(plan.rank_bytes) == sum(sizes)
    splittable = [i for i in range(len(sizes)) if rows[i] > quanta[i] and sizes[i] > 0]
    widest = max((sizes[i] // rows[i] * quanta[i] for i in splittable), default=0)
    assert plan.row_slack == widest
    unsplittable = max((sizes[i] for i in range(len(sizes)) if i not in splittable), default=0)
    mean = Fraction(sum(sizes), num_ranks)
    assert max(plan.rank_bytes, default=0) <= mean + max(widest, unsplittable)
    assert plan_split(sizes, rows, num_ranks, quanta) == plan  # deterministic


def test_aligned_cuts_keep_every_block_but_the_last_a_multiple_of_64_elements() -> None:
    # widths 4096 (quantum 1 row), 50 (quantum 32 rows: 32 * 50 = 1600 = 25 * 64), 7 (64 rows)
    shapes = [(1000, 4096), (3000, 50), (5000, 7)]
    sizes = [r * w * 4 for r, w in shapes]
    for num_ranks in (2, 3, 7):
        plan = plan_split(sizes, [r for r, _ in shapes], num_ranks, [cut_quantum(w) for _, w in shapes])
        for b in plan.blocks:
            if b.row_stop != shapes[b.param][0]:
                assert (b.num_rows * shapes[b.param][1]) % CUT_ALIGN_ELEMENTS == 0
    assert [cut_quantum(w) for w in (4096, 50, 7, 0, 64, 96)] == [1, 32, 64, 1, 1, 2]


def test_plan_whole_keeps_every_parameter_on_its_lpt_owner() -> None:
    sizes, rows = [400, 40, 4, 0], [10, 10, 1, 0]
    plan = plan_whole(sizes, rows, 3)
    assert plan.split_params == () and plan.row_slack == 0
    assert [b.owner for b in plan.blocks] == list(partition_by_size(sizes, 3).owners)
    assert [(b.row_start, b.row_stop) for b in plan.blocks] == [(0, 10), (0, 10), (0, 1), (0, 0)]


def test_bad_quanta_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"quanta \(1\) and sizes \(2\) differ in length"):
        plan_split([4, 4], [2, 2], 2, [1])
    with pytest.raises(ValueError, match="quanta must be >= 1 rows, got 0"):
        plan_split([4], [2], 2, [0])
