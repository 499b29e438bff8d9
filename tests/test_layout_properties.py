"""In-process properties (hypothesis) of the two static plans every rank must agree on:
ShardedDataParallel's bucket plan and FSDP's flat-parameter layout.

Both are pure functions of shapes, dtypes, owners and sizes, so they are checked here
directly, not through the private attributes of running wrappers.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardopt.nn.data_parallel.grad_buckets import plan_buckets
from shardopt.nn.fsdp.flat_param import FlatLayout

shape_st = st.lists(st.integers(min_value=0, max_value=6), min_size=0, max_size=3).map(tuple)


@st.composite
def bucket_inputs(draw: st.DrawFn) -> tuple[list[torch.nn.Parameter], list[int], int, int]:
    num_ranks = draw(st.integers(min_value=1, max_value=5))
    n = draw(st.integers(min_value=1, max_value=12))
    params = []
    for _ in range(n):
        numel = draw(st.integers(min_value=1, max_value=40))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
        params.append(torch.nn.Parameter(torch.zeros(numel, dtype=dtype)))
    owners = draw(st.lists(st.integers(min_value=0, max_value=num_ranks - 1), min_size=n, max_size=n))
    cap = draw(st.integers(min_value=0, max_value=120))
    return params, owners, num_ranks, cap


@settings(max_examples=300, deadline=None)
@given(inputs=bucket_inputs())
def test_bucket_plan_places_every_parameter_once_within_cap_and_splits_by_owner(
    inputs: tuple[list[torch.nn.Parameter], list[int], int, int],
) -> None:
    params, owners, num_ranks, cap = inputs
    specs = plan_buckets(params, owners, num_ranks, cap, {})
    placed = [id(p) for spec in specs for p in spec.params]
    assert sorted(placed) == sorted(id(p) for p in params)  # each exactly once
    for index, spec in enumerate(specs):
        assert spec.index == index
        assert len({(p.device, p.dtype) for p in spec.params}) == 1  # one (device, dtype) a bucket
        grads = sum(p.numel() for p in spec.params)
        assert grads <= cap or len(spec.params) == 1  # only a lone oversize parameter exceeds the cap
        # owner-major, model order inside each owner, owners as given
        by_id = {id(p): i for i, p in enumerate(params)}
        order = [(spec.owners[k], by_id[id(p)]) for k, p in enumerate(spec.params)]
        assert order == sorted(order)
        assert all(owners[by_id[id(p)]] == o for p, o in zip(spec.params, spec.owners))
        # rank r's split holds exactly its gradients and one flag per parameter, in order
        assert len(spec.splits) == num_ranks and spec.numel == grads + len(spec.params)
        cursor = 0
        for rank in range(num_ranks):
            mine = [k for k, o in enumerate(spec.owners) if o == rank]
            expected = sum(spec.params[k].numel() for k in mine) + len(mine)
            assert spec.splits[rank] == expected
            for k in mine:
                assert spec.offsets[k] == cursor
                cursor += spec.params[k].numel()
            for k in mine:
                assert spec.flag_offsets[k] == cursor
                cursor += 1
        assert cursor == spec.numel


@settings(max_examples=100, deadline=None)
@given(inputs=bucket_inputs())
def test_bucket_plan_depends_only_on_shapes_dtypes_and_owners(
    inputs: tuple[list[torch.nn.Parameter], list[int], int, int],
) -> None:
    params, owners, num_ranks, cap = inputs
    twins = [torch.nn.Parameter(torch.ones_like(p)) for p in params]  # other objects, other values
    a = plan_buckets(params, owners, num_ranks, cap, {torch.float32: torch.bfloat16})
    b = plan_buckets(twins, owners, num_ranks, cap, {torch.float32: torch.bfloat16})
    strip = [(s.index, s.owners, s.offsets, s.flag_offsets, s.splits, s.wire_dtype) for s in a]
    assert strip == [(s.index, s.owners, s.offsets, s.flag_offsets, s.splits, s.wire_dtype) for s in b]
    for spec in a:
        assert spec.wire_dtype == (torch.bfloat16 if spec.params[0].dtype == torch.float32 else spec.params[0].dtype)


@settings(max_examples=300, deadline=None)
@given(shapes=st.lists(shape_st, min_size=0, max_size=8), shard_size=st.integers(min_value=1, max_value=7))
def test_flat_layout_shards_tile_every_parameter_exactly_once(shapes: list[tuple[int, ...]], shard_size: int) -> None:
    layouts = [FlatLayout.build([torch.Size(s) for s in shapes], r, shard_size) for r in range(shard_size)]
    total = sum(torch.Size(s).numel() for s in shapes)
    first = layouts[0]
    assert first.total_numel == total
    assert first.padded_numel % shard_size == 0 and 0 <= first.padded_numel - total < shard_size
    assert first.shard_numel * shard_size == first.padded_numel
    # every rank agrees on the flat offsets; parameters lie end to end
    offset = 0
    for i, shape in enumerate(shapes):
        for lay in layouts:
            assert lay.slots[i].offset == offset and lay.slots[i].shape == torch.Size(shape)
        offset += torch.Size(shape).numel()
    for i in range(len(shapes)):
        pieces = sorted(
            (lay.slots[i].piece_begin, lay.slots[i].piece_numel, r)
            for r, lay in enumerate(layouts) if lay.slots[i].piece_numel
        )
        covered = 0
        for begin, count, r in pieces:  # the pieces tile [0, numel) in rank order
            assert begin == covered
            slot = layouts[r].slots[i]
            flat_pos = slot.offset + begin
            assert flat_pos == r * first.shard_numel + slot.shard_begin  # where the shard holds it
            assert 0 <= slot.shard_begin and slot.shard_begin + count <= first.shard_numel
            covered += count
        assert covered == layouts[0].slots[i].numel
    # inside one shard, pieces do not overlap
    for lay in layouts:
        spans = sorted((s.shard_begin, s.shard_begin + s.piece_numel) for s in lay.slots if s.piece_numel)
        assert all(a_end <= b_begin for (_, a_end), (b_begin, _) in zip(spans, spans[1:]))
