"""In-process properties (hypothesis) of ShardedDataParallel's bucket plan over split
parameters (Note [split parameters in buckets] in shardopt/nn/data_parallel/grad_buckets.py):
every block of every parameter is an entry in its owner's part with a flag of its own, a
parameter's blocks share one bucket, and a plan without splits is exactly the whole plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardopt.nn.data_parallel.grad_buckets import plan_buckets
from shardopt.partition import Block, cut_quantum, plan_split

Inputs = tuple[list[torch.nn.Parameter], list[int], dict[int, tuple[Block, ...]], int, int]


@st.composite
def split_inputs(draw: st.DrawFn) -> Inputs:
    """Parameters of 1 to 3 dims (some large), owners and blocks from the real split planner."""
    num_ranks = draw(st.integers(min_value=1, max_value=5))
    n = draw(st.integers(min_value=1, max_value=10))
    params = []
    for _ in range(n):
        shape = tuple(draw(st.lists(st.integers(min_value=1, max_value=9), min_size=0, max_size=3)))
        if draw(st.booleans()):
            shape = (draw(st.integers(min_value=2, max_value=200)), *shape[1:])  # a large one, often split
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
        params.append(torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))
    rows = [p.shape[0] if p.dim() else 1 for p in params]
    plan = plan_split([p.numel() * 4 for p in params], rows, num_ranks,
                      [cut_quantum(p.numel() // r) for p, r in zip(params, rows, strict=True)])
    owners = [plan.blocks_of(i)[0].owner for i in range(n)]
    split = {i: plan.blocks_of(i) for i in plan.split_params}
    cap = draw(st.integers(min_value=0, max_value=400))
    return params, owners, split, num_ranks, cap


@settings(max_examples=300, deadline=None)
@given(inputs=split_inputs())
def test_every_block_is_an_entry_in_its_owners_part_and_a_parameters_blocks_share_a_bucket(inputs: Inputs) -> None:
    params, owners, split, num_ranks, cap = inputs
    specs = plan_buckets(params, owners, num_ranks, cap, {}, None, split)
    by_id = {id(p): i for i, p in enumerate(params)}
    seen: dict[int, list[tuple[int, int, int, int]]] = {}  # param -> (bucket, row_start, row_stop, owner)
    for spec in specs:
        order = [(spec.owners[k], by_id[id(p)], spec.rows[k][0]) for k, p in enumerate(spec.params)]
        assert order == sorted(order)  # owner-major, then model order, then rows
        cursor = 0
        for rank in range(num_ranks):
            mine = [k for k, o in enumerate(spec.owners) if o == rank]
            start = cursor
            for k in mine:
                assert spec.offsets[k] == cursor
                lo, hi = spec.span(k)
                p = params[by_id[id(spec.params[k])]]
                row_numel = p.numel() // (p.shape[0] if p.dim() else 1)
                assert (lo, hi) == (spec.rows[k][0] * row_numel, spec.rows[k][1] * row_numel)
                cursor += hi - lo
            for k in mine:  # one flag per block
                assert spec.flag_offsets[k] == cursor
                cursor += 1
            assert spec.splits[rank] == cursor - start
        assert cursor == spec.numel
        for k, p in enumerate(spec.params):
            seen.setdefault(by_id[id(p)], []).append((spec.index, *spec.rows[k], spec.owners[k]))
    for i, p in enumerate(params):
        entries = sorted(seen[i], key=lambda e: e[1])
        assert len({e[0] for e in entries}) == 1  # one bucket holds all of a parameter's blocks
        expected = split.get(i, (Block(i, 0, p.shape[0] if p.dim() else 1, owners[i]),))
        assert [(e[1], e[2], e[3]) for e in entries] == [(b.row_start, b.row_stop, b.owner) for b in expected]


@settings(max_examples=200, deadline=None)
@given(inputs=split_inputs())
def test_split_plan_sends_the_whole_plans_gradient_elements_plus_one_flag_per_extra_block(inputs: Inputs) -> None:
    params, owners, split, num_ranks, cap = inputs
    with_split = plan_buckets(params, owners, num_ranks, cap, {}, None, split)
    whole = plan_buckets(params, owners, num_ranks, cap, {})
    extra_blocks = sum(len(blocks) - 1 for blocks in split.values())
    assert sum(s.numel for s in with_split) == sum(s.numel for s in whole) + extra_blocks
    # the same parameters in the same buckets, in launch order
    assert [{id(p) for p in s.params} for s in with_split] == [{id(p) for p in s.params} for s in whole]


@settings(max_examples=200, deadline=None)
@given(inputs=split_inputs())
def test_plan_without_splits_is_exactly_the_whole_parameter_plan(inputs: Inputs) -> None:
    params, owners, _, num_ranks, cap = inputs
    trivial = {i: (Block(i, 0, p.shape[0] if p.dim() else 1, owners[i]),) for i, p in enumerate(params)}
    assert plan_buckets(params, owners, num_ranks, cap, {}, None, trivial) == plan_buckets(
        params, owners, num_ranks, cap, {})


def test_blocks_that_do_not_tile_the_rows_are_refused_naming_the_fix() -> None:
    params = [torch.nn.Parameter(torch.zeros(8, 4))]
    for bad in ((Block(0, 0, 4, 0), Block(0, 5, 8, 1)),  # a gap
                (Block(0, 0, 4, 0), Block(0, 4, 8, 0)),  # one rank, two blocks
                (Block(0, 0, 4, 0),)):  # rows 4..8 unowned
        with pytest.raises(ValueError, match=r"must tile rows 0..shape\[0\] in order with one block per owner"):
            plan_buckets(params, [0], 2, 100, {}, None, {0: bad})
