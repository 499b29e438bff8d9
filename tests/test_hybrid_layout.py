"""shardopt.hybrid: the three ways of naming a hybrid layout give one checked record, and every
bad layout is refused with the same clear error on every rank (none hangs).

The pure tiling functions are tested in this process; the rest on 4 real gloo ranks, one
process group for the whole sweep (each case's error is caught on every rank and returned)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardopt.hybrid import HybridLayout, LayoutSource, Tiling, check_tiling, plan_tiling, resolve_layout
from shardopt.testing import run_ranks

pytestmark = pytest.mark.distributed  # starts processes (ranks, launchers or subprocesses)


def test_plan_tiling_puts_consecutive_ranks_in_a_shard_group_and_equal_positions_in_a_replicate_group() -> None:
    assert plan_tiling(6, 3) == Tiling(shard_groups=((0, 1, 2), (3, 4, 5)), replicate_groups=((0, 3), (1, 4), (2, 5)))
    assert plan_tiling(4, 4) == Tiling(shard_groups=((0, 1, 2, 3),), replicate_groups=((0,), (1,), (2,), (3,)))
    assert plan_tiling(3, 1) == Tiling(shard_groups=((0,), (1,), (2,)), replicate_groups=((0, 1, 2),))


@given(st.integers(1, 12), st.integers(1, 12))
def test_plan_tiling_tiles_the_world_or_refuses_a_shard_size_that_does_not_divide_it(world: int, size: int) -> None:
    if world % size or size > world:
        with pytest.raises(ValueError, match=f"shard_size must divide the world size {world}, got shard_size={size}"):
            plan_tiling(world, size)
        return
    tiling = plan_tiling(world, size)
    assert sorted(r for g in tiling.shard_groups for r in g) == list(range(world))
    assert sorted(r for g in tiling.replicate_groups for r in g) == list(range(world))
    assert (tiling.shard_size, tiling.num_replicas) == (size, world // size)
    claims = [(next(g for g in tiling.shard_groups if r in g), next(g for g in tiling.replicate_groups if r in g))
              for r in range(world)]
    assert check_tiling(world, claims) == tiling  # the explicit-groups check accepts what shard_size builds


def test_plan_tiling_refuses_a_shard_size_that_is_not_an_int() -> None:
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="shard_size must be an int"):
            plan_tiling(4, bad)  # type: ignore[arg-type]


def test_check_tiling_names_the_rank_and_the_rule_each_bad_pair_breaks() -> None:
    good = [((0, 1), (0, 2)), ((0, 1), (1, 3)), ((2, 3), (0, 2)), ((2, 3), (1, 3))]
    assert check_tiling(4, good).shard_groups == ((0, 1), (2, 3))
    outside = [((0, 1), (0, 2)), ((0, 1), (1, 3)), ((0, 1), (0, 2)), ((2, 3), (1, 3))]
    with pytest.raises(ValueError, match=r"rank 2's shard group \[0, 1\] does not contain rank 2"):
        check_tiling(4, outside)
    overlap = [((0, 1), (0, 2)), ((0, 1), (1, 3)), ((0, 1, 2, 3), (0, 2)), ((0, 1, 2, 3), (1, 3))]
    with pytest.raises(ValueError, match=r"rank 2's shard group is \[0, 1, 2, 3\] but rank 0's is \[0, 1\]"):
        check_tiling(4, overlap)
    uneven = [((0, 1, 2), (0, 3)), ((0, 1, 2), (1,)), ((0, 1, 2), (2,)), ((3,), (0, 3))]
    with pytest.raises(ValueError, match=r"have different sizes \[1, 3\]"):
        check_tiling(4, uneven)
    crossed = [((0, 1), (0, 3)), ((0, 1), (1, 2)), ((2, 3), (1, 2)), ((2, 3), (0, 3))]
    with pytest.raises(ValueError, match=r"rank 0 is at position 0 of its shard group \[0, 1\], so its replicate "
                                         r"group must be .* \[0, 2\], got \[0, 3\]"):
        check_tiling(4, crossed)


def _outcome(make: Callable[[], HybridLayout]) -> Any:
    """The layout's summary, or the error's type and message (every rank returns one)."""
    try:
        layout = make()
    except (ValueError, TypeError) as exc:
        return (type(exc).__name__, str(exc))
    # The groups are real: a sum over each equals the sum of the ranks the record lists.
    rank = torch.tensor([float(dist.get_rank())])
    sums = []
    for group in (layout.shard_group, layout.replicate_group):
        t = rank.clone()
        dist.all_reduce(t, group=group)
        sums.append(t.item())
    return {"source": layout.source, "S": layout.shard_size, "R": layout.num_replicas,
            "shard_rank": layout.shard_rank, "replica_rank": layout.replica_rank,
            "shard_ranks": layout.shard_ranks, "replicate_ranks": layout.replicate_ranks,
            "tiling": layout.tiling, "sums": sums,
            "fingerprint": layout.fingerprint()}


def _layouts_rank(rank: int, world_size: int) -> dict[str, Any]:
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    world = dist.new_group([0, 1, 2, 3])
    pair = (shard_groups[rank // 2], replicate_groups[rank % 2])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("shard", "replicate"))
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    unnamed = init_device_mesh("cpu", (2, 2))
    listed_backwards = DeviceMesh("cpu", torch.tensor([[3, 2], [1, 0]]), mesh_dim_names=("replicate", "shard"))
    half = DeviceMesh("cpu", torch.arange(2).reshape(1, 2), mesh_dim_names=("replicate", "shard"))
    cases: dict[str, Callable[[], HybridLayout]] = {
        "shard_size": lambda: resolve_layout(shard_size=2),
        "device_mesh": lambda: resolve_layout(device_mesh=mesh),
        "process_groups": lambda: resolve_layout(process_groups=pair),
        "mesh_listed_backwards": lambda: resolve_layout(device_mesh=listed_backwards),
        "one_group": lambda: resolve_layout(shard_size=4),
        "not_divisible": lambda: resolve_layout(shard_size=3),
        "zero": lambda: resolve_layout(shard_size=0),
        "two_forms": lambda: resolve_layout(shard_size=2, device_mesh=mesh),
        "no_form": lambda: resolve_layout(),
        "mesh_names": lambda: resolve_layout(device_mesh=swapped),
        "mesh_1d": lambda: resolve_layout(device_mesh=flat),
        "mesh_unnamed": lambda: resolve_layout(device_mesh=unnamed),
        "mesh_half": lambda: resolve_layout(device_mesh=half),
        "mesh_type": lambda: resolve_layout(device_mesh=[[0, 1], [2, 3]]),  # type: ignore[arg-type]
        "pair_type": lambda: resolve_layout(process_groups=(shard_groups[rank // 2],)),  # type: ignore[arg-type]
        "pair_bad_on_one_rank": lambda: resolve_layout(process_groups=(pair[0], "replicate" if rank == 3 else pair[1])),  # type: ignore[arg-type]
        "not_member": lambda: resolve_layout(process_groups=(shard_groups[0], replicate_groups[rank % 2])),
        "crossed": lambda: resolve_layout(process_groups=(shard_groups[rank // 2], crossed[rank in (1, 2)])),
        "overlap": lambda: resolve_layout(process_groups=(shard_groups[0] if rank < 2 else world,
                                                          replicate_groups[rank % 2])),
        "disagree_size": lambda: resolve_layout(shard_size=2 if rank == 0 else 4),
        "disagree_form": lambda: resolve_layout(shard_size=2) if rank == 3 else resolve_layout(device_mesh=mesh),
        "disagree_bad_on_one_rank": lambda: resolve_layout(shard_size=3 if rank == 1 else 2),
    }
    return {name: _outcome(make) for name, make in cases.items()}


# Expected error type and a fragment of its message, per case; every rank must raise it.
ERRORS = {
    "not_divisible": ("ValueError", "shard_size must divide the world size 4, got shard_size=3; use one of [1, 2, 4]"),
    "zero": ("ValueError", "shard_size must divide the world size 4, got shard_size=0"),
    "two_forms": ("ValueError", "name the hybrid layout exactly one way, got ['device_mesh', 'shard_size']"),
    "no_form": ("ValueError", "name the hybrid layout exactly one way, got none"),
    "mesh_names": ("ValueError", "device_mesh must be 2-D with dimensions named ('replicate', 'shard') (replicate "
                                 "outer, shard inner), got 2-D with names ('shard', 'replicate')"),
    "mesh_1d": ("ValueError", "got 1-D with names ('shard',)"),
    "mesh_unnamed": ("ValueError", "got 2-D with names None"),
    "mesh_half": ("ValueError", "device_mesh must cover every rank of the world (0..3), got ranks [0, 1]"),
    "mesh_type": ("TypeError", "device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got list"),
    "pair_type": ("TypeError", "process_groups must be a pair (shard_group, replicate_group) of process groups, got ("),
    "pair_bad_on_one_rank": ("TypeError", "got a str as the replicate group on rank 3"),
    "not_member": ("ValueError", "rank 2 is not a member of the shard group it passed"),
    "crossed": ("ValueError", "process_groups do not tile the world: rank 0 is at position 0 of its shard group"),
    "overlap": ("ValueError", "process_groups do not tile the world: rank 2's shard group is [0, 1, 2, 3] but rank 0's is "
                              "[0, 1]"),
    "disagree_size": ("ValueError", "the hybrid layout was built differently on different ranks: shard_size is 2 on "
                                    "rank 0 but 4 on rank 1"),
    "disagree_form": ("ValueError", "the hybrid layout was built differently on different ranks: given is "
                                    "('device_mesh',) on rank 0 but ('shard_size',) on rank 3"),
    "disagree_bad_on_one_rank": ("ValueError", "shard_size is 2 on rank 0 but 3 on rank 1"),
}


def test_three_forms_give_one_layout_and_every_bad_layout_raises_on_every_rank() -> None:
    results = run_ranks(_layouts_rank, 4, timeout_s=90)
    for rank, r in enumerate(results):
        node, position = divmod(rank, 2)
        for form in ("shard_size", "device_mesh", "process_groups"):
            got = r[form]
            assert got["source"] is LayoutSource(form), got
            assert (got["S"], got["R"], got["shard_rank"], got["replica_rank"]) == (2, 2, position, node), got
            assert got["shard_ranks"] == (2 * node, 2 * node + 1) and got["replicate_ranks"] == (position, position + 2)
            assert got["sums"] == [float(4 * node + 1), float(2 * position + 2)], got
            assert got["tiling"] == results[0]["shard_size"]["tiling"] == plan_tiling(4, 2)
            assert got["fingerprint"] == results[0]["shard_size"]["fingerprint"]
        # A mesh listing its ranks in another order names the same groups; positions are the groups' own.
        backwards = r["mesh_listed_backwards"]
        assert (backwards["shard_ranks"], backwards["replicate_ranks"]) == (r["shard_size"]["shard_ranks"],
                                                                            r["shard_size"]["replicate_ranks"])
        assert (backwards["shard_rank"], backwards["replica_rank"]) == (position, node), backwards
        one = r["one_group"]
        assert (one["S"], one["R"], one["shard_ranks"], one["replicate_ranks"]) == (4, 1, (0, 1, 2, 3), (rank,))
        for case, (kind, fragment) in ERRORS.items():
            assert isinstance(r[case], tuple), f"rank {rank}: {case} did not raise: {r[case]}"
            assert r[case][0] == kind and fragment in r[case][1], f"rank {rank} {case}: {r[case]}"
