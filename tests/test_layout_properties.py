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
from shardopt.nn.fsdp.flat_param import FlatLayout, FlatParamHandle

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
def test_flat_layout_gives_every_rank_whole_rows_tiling_every_parameter_once(
    shapes: list[tuple[int, ...]], shard_size: int
) -> None:
    layouts = [FlatLayout.build([torch.Size(s) for s in shapes], r, shard_size) for r in range(shard_size)]
    first = layouts[0]
    assert first.total_numel == sum(torch.Size(s).numel() for s in shapes)
    assert first.shard_numel * shard_size == first.padded_numel
    assert first.shard_numel == sum(s.segment_numel for s in first.slots)
    for i, shape in enumerate(shapes):
        shape = torch.Size(shape)
        rows, row_numel = (shape[0], shape[1:].numel()) if shape else (1, 1)
        slots = [lay.slots[i] for lay in layouts]
        # every rank agrees on the offsets, the segment and the row slots
        assert len({(s.offset, s.shard_begin, s.rows_per_rank, s.row_numel) for s in slots}) == 1
        assert slots[0].rows_per_rank == -(-rows // shard_size) and slots[0].row_numel == row_numel
        covered = 0
        for r, slot in enumerate(slots):  # rank r holds rows [r * k, ...): whole rows, in rank order
            assert slot.local_shape[1:] == shape[1:] and len(slot.local_shape) == max(1, len(shape))
            assert slot.piece_numel == slot.local_shape.numel() <= slot.segment_numel
            if slot.piece_numel:
                assert slot.piece_begin == covered == r * slot.rows_per_rank * row_numel
            covered += slot.piece_numel
        assert covered == shape.numel()
    # segments lie end to end in every shard, parameters end to end (padded rows) in the full buffer
    offset = shard_offset = 0
    for slot in first.slots:
        assert slot.offset == offset and slot.shard_begin == shard_offset
        offset += shard_size * slot.segment_numel
        shard_offset += slot.segment_numel


@settings(max_examples=150, deadline=None)
@given(shapes=st.lists(shape_st, min_size=1, max_size=6), shard_size=st.integers(min_value=1, max_value=5))
def test_packed_gradients_and_unpacked_gathers_round_trip_through_every_ranks_rows(
    shapes: list[tuple[int, ...]], shard_size: int
) -> None:
    gen = torch.Generator().manual_seed(len(shapes) * 10 + shard_size)
    values = [torch.randn(s, generator=gen) for s in shapes]
    handles = [
        FlatParamHandle([torch.nn.Parameter(v.clone()) for v in values], r, shard_size, None)
        for r in range(shard_size)
    ]
    for h in handles:  # between steps every parameter shows this rank's rows, with its dimensions
        for p, v, slot in zip(h.params, values, h.layout.slots):
            assert p.shape == slot.local_shape and p.dim() == max(1, v.dim())
            assert torch.equal(p.reshape(-1), v.reshape(-1)[slot.piece_begin : slot.piece_begin + slot.piece_numel])
    gathered = torch.cat([h.shard for h in handles])  # what an all-gather of the shards holds
    for view, v in zip(handles[0].views_into(handles[0].unpack(gathered)), values):
        assert torch.equal(view, v)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    packed = torch.full((handles[0].layout.padded_numel,), float("nan"))
    handles[0].pack(grads, packed, accumulate=False)
    handles[0].pack(grads, packed, accumulate=True)  # doubles: what no_sync accumulation does
    shards = packed.view(shard_size, -1)  # what a reduce-scatter hands each rank
    for r, h in enumerate(handles):
        assert not shards[r].isnan().any()  # padding rows are written (zeros) too
        for g, slot in zip(grads, h.layout.slots):
            expected = 2 * g.reshape(-1)[slot.piece_begin : slot.piece_begin + slot.piece_numel]
            assert torch.equal(h.local_of(shards[r], slot).reshape(-1), expected)
