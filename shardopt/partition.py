"""Pure, deterministic assignment of parameters to ranks.

Everything here is plain Python over integers: no torch, no process group, no ``id()``. The
same sizes and world size give the same :class:`Partition` on every rank, which is what lets
the optimizer and the data-parallel wrapper agree on ownership without talking.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Partition", "partition_by_size"]


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
        totals = self.rank_bytes
        mean = sum(totals) / self.num_ranks
        return max(totals) / mean if mean > 0 else 1.0

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
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    negative = [(i, s) for i, s in enumerate(sizes) if s < 0]
    if negative:
        raise ValueError(f"sizes must be >= 0; parameter {negative[0][0]} has size {negative[0][1]}")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    heap = [(0, rank) for rank in range(num_ranks)]  # (bytes so far, rank): lightest, then lowest rank
    owners = [0] * len(sizes)
    for i in order:
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + sizes[i], rank))
    return Partition(num_ranks=num_ranks, sizes=tuple(int(s) for s in sizes), owners=tuple(owners))
