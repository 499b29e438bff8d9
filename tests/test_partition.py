"""Properties of the pure partitioner (hypothesis) and its error messages."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardopt.partition import Partition, partition_by_size

sizes_st = st.lists(st.integers(min_value=0, max_value=10**9), min_size=0, max_size=60)
ranks_st = st.integers(min_value=1, max_value=9)


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, num_ranks=ranks_st)
def test_every_param_assigned_exactly_once_and_bytes_add_up(sizes: list[int], num_ranks: int) -> None:
    plan = partition_by_size(sizes, num_ranks)
    assert plan.num_params == len(sizes)
    assert sorted(i for r in range(num_ranks) for i in plan.indices_of(r)) == list(range(len(sizes)))
    assert sum(plan.rank_bytes) == sum(sizes)
    for r in range(num_ranks):
        assert plan.rank_bytes[r] == sum(sizes[i] for i in plan.indices_of(r))


@settings(max_examples=300, deadline=None)
@given(sizes=sizes_st, num_ranks=ranks_st)
def test_largest_rank_exceeds_mean_by_at_most_largest_param(sizes: list[int], num_ranks: int) -> None:
    plan = partition_by_size(sizes, num_ranks)
    if sizes:
        assert max(plan.rank_bytes) <= sum(sizes) / num_ranks + max(sizes)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=7),
    num_ranks=st.integers(min_value=1, max_value=3),
)
def test_largest_rank_within_lpt_bound_of_optimum(sizes: list[int], num_ranks: int) -> None:
    plan = partition_by_size(sizes, num_ranks)
    best = min(
        max(sum(s for s, r in zip(sizes, assign) if r == rank) for rank in range(num_ranks))
        for assign in itertools.product(range(num_ranks), repeat=len(sizes))
    )
    assert max(plan.rank_bytes) <= (4 / 3 - 1 / (3 * num_ranks)) * best + 1e-9


@settings(max_examples=100, deadline=None)
@given(sizes=sizes_st, num_ranks=ranks_st)
def test_same_input_same_plan(sizes: list[int], num_ranks: int) -> None:
    assert partition_by_size(list(sizes), num_ranks) == partition_by_size(tuple(sizes), num_ranks)


def test_ties_break_by_index_then_lowest_rank() -> None:
    plan = partition_by_size([4, 4, 4, 4], 2)
    assert plan.owners == (0, 1, 0, 1)
    assert plan.imbalance == 1.0


def test_partition_is_frozen() -> None:
    plan = partition_by_size([1, 2, 3], 2)
    with pytest.raises(AttributeError):
        plan.owners = (0, 0, 0)  # type: ignore[misc]


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match="num_ranks must be a positive int, got 0"):
        partition_by_size([1], 0)
    with pytest.raises(ValueError, match="parameter 1 has size -3"):
        partition_by_size([1, -3], 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 5"):
        partition_by_size([1], 2).indices_of(5)
    with pytest.raises(ValueError, match="owners must be in"):
        Partition(num_ranks=2, sizes=(1,), owners=(3,))


def _gpt_param_bytes(vocab: int, dim: int, layers: int, context: int) -> list[int]:
    """Bytes of each fp32 parameter of a GPT-2-style model, in module order (built on meta)."""
    import torch
    from torch import nn

    def block() -> nn.Module:
        return nn.ModuleList([
            nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim),
            nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim),
        ])

    with torch.device("meta"):
        model = nn.ModuleList([
            nn.Embedding(vocab, dim), nn.Embedding(context, dim), *[block() for _ in range(layers)],
            nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False),
        ])
    return [p.numel() * p.element_size() for p in model.parameters()]


def test_gpt_style_model_partition_imbalance_is_reported_and_within_lpt_bound() -> None:
    models = {"gpt2-small (124M+head)": (50304, 768, 12, 1024), "gpt-mini (d256 x 8)": (8192, 256, 8, 512)}
    for name, shape in models.items():
        sizes = _gpt_param_bytes(*shape)
        print(f"\npartition of {name}: {len(sizes)} params, {sum(sizes) / 2**20:.1f} MiB, "
              f"largest {max(sizes) / 2**20:.1f} MiB")
        for num_ranks in range(2, 9):
            plan = partition_by_size(sizes, num_ranks)
            mean = sum(sizes) / num_ranks
            # No plan can beat max(mean, largest parameter); LPT is within 4/3 of the optimum.
            lower = max(mean, max(sizes))
            print(f"  {num_ranks} ranks: imbalance (max/mean) {plan.imbalance:.4f}, "
                  f"max/lower bound {max(plan.rank_bytes) / lower:.4f}")
            assert max(plan.rank_bytes) <= (4 / 3 - 1 / (3 * num_ranks)) * lower
            if max(sizes) <= mean / 2:
                assert plan.imbalance < 1.05  # many small blocks: near-perfect balance
