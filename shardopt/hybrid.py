"""The layout of hybrid sharding: shard inside a group of S ranks, replicate across R groups.

A user names the layout in one of three ways; :func:`resolve_layout` turns any of them into
one :class:`HybridLayout` (this rank's shard group and replicate group, S, R, and where this
rank sits in each), after checking it on every rank:

* ``device_mesh``: a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` whose dimensions
  are named ``("replicate", "shard")`` (as FSDP2 and shardopt's FullyShardedDataParallel take
  it): a row of the mesh is a shard group, a column a replicate group;
* ``process_groups``: an explicit ``(shard_group, replicate_group)`` pair, this rank's own;
* ``shard_size``: S, from which the groups are built (Note [consecutive shard groups]).

Nothing here moves optimizer state or gradients; ZeRO-1 over the shard group is
``OSS(params, optim=..., group=layout.shard_group)`` under DDP over the world (see
``docs/hybrid.md``).

Note [consecutive shard groups]
With ``shard_size=S`` on a world of N = S * R ranks, shard group g holds the consecutive
ranks ``g*S .. g*S + S - 1`` and replicate group p holds the ranks at position p of every
shard group, ``p, p + S, p + 2S, ...``. torchrun numbers ranks node by node (a node's
``--nproc-per-node`` workers get consecutive global ranks), so with S = ranks per node a
shard group is one node and only the replicate groups cross the inter-node link; the
multi-node test (``tests/test_hybrid_multinode.py``) checks this on two real torchrun
agents. torch requires every rank to create every subgroup, in the same order, even the
ones it is not a member of, so every rank creates the R shard groups and then the S
replicate groups.

Note [hybrid layout checks]
A rank that rejects its arguments while the others go on into a collective would leave the
others waiting until the process group's timeout. So :func:`resolve_layout` first compares a
rank-independent description of the request across ranks (which of the three forms, the
shard size, the mesh's names and ranks) with :func:`shardopt.agreement.check_agreement`:
ranks that asked for different layouts all raise there. From then on every rank checks the
same request, so a bad one raises the same error on every rank before any group is built.
An explicit pair of groups, and the mesh's two groups (torch ranks a group's members in
ascending order, whatever order the mesh lists them in), is checked by gathering every
rank's two member lists, or what is wrong with its pair (not a pair, not process groups, a
group the rank is not in), with one object all-gather, and testing, identically on every
rank, that they tile the world.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardopt import agreement, comm

__all__ = ["MESH_DIM_NAMES", "HybridLayout", "LayoutSource", "Tiling", "check_tiling", "plan_tiling",
           "resolve_group", "resolve_layout"]

MESH_DIM_NAMES = ("replicate", "shard")
"""The dimension names a hybrid ``device_mesh`` must have, outer (across groups) first."""

_FIX_AGREE = ("pass the same device_mesh, process_groups or shard_size on every rank (build the layout "
              "from the same configuration everywhere)")


class LayoutSource(enum.Enum):
    """Which of the three forms the user named the layout with."""

    DEVICE_MESH = "device_mesh"
    PROCESS_GROUPS = "process_groups"
    SHARD_SIZE = "shard_size"


@dataclass(frozen=True)
class Tiling:
    """The whole world split into shard groups and replicate groups, as global ranks.

    Attributes:
        shard_groups: the R shard groups, each its S ranks in group-rank order, ordered by
            their first rank.
        replicate_groups: the S replicate groups, each its R ranks in group-rank order;
            ``replicate_groups[p]`` holds the ranks at position ``p`` of every shard group.
    """

    shard_groups: tuple[tuple[int, ...], ...]
    replicate_groups: tuple[tuple[int, ...], ...]

    @property
    def shard_size(self) -> int:
        """S: ranks per shard group."""
        return len(self.shard_groups[0])

    @property
    def num_replicas(self) -> int:
        """R: number of shard groups, i.e. copies of each shard."""
        return len(self.shard_groups)


@dataclass(frozen=True)
class HybridLayout:
    """Where this rank sits in a hybrid layout; every rank holds an equal :attr:`tiling`.

    Attributes:
        source: the form the layout was given in.
        shard_group: this rank's shard group (ownership is planned over it; parameters are
            gathered inside it).
        replicate_group: this rank's replicate group: the ranks that own the same shard in
            the other shard groups.
        shard_size: S, ranks per shard group.
        num_replicas: R, number of shard groups.
        shard_rank: this rank's position in its shard group (which 1/S it owns).
        replica_rank: this rank's position in its replicate group (which shard group it is in).
        tiling: every shard group and replicate group, as global ranks.
    """

    source: LayoutSource
    shard_group: comm.ProcessGroup
    replicate_group: comm.ProcessGroup
    shard_size: int
    num_replicas: int
    shard_rank: int
    replica_rank: int
    tiling: Tiling

    @property
    def world_size(self) -> int:
        """N = S * R."""
        return self.shard_size * self.num_replicas

    @property
    def shard_ranks(self) -> tuple[int, ...]:
        """The global ranks of this rank's shard group, in group-rank order."""
        return self.tiling.shard_groups[self.replica_rank]

    @property
    def replicate_ranks(self) -> tuple[int, ...]:
        """The global ranks of this rank's replicate group, in group-rank order."""
        return self.tiling.replicate_groups[self.shard_rank]

    def fingerprint(self) -> list[tuple[str, Any]]:
        """Rank-independent entries for :func:`shardopt.agreement.check_agreement`."""
        return [("shard_size", self.shard_size), ("num_replicas", self.num_replicas),
                ("shard_groups", self.tiling.shard_groups), ("replicate_groups", self.tiling.replicate_groups)]


def plan_tiling(world_size: int, shard_size: int) -> Tiling:
    """The tiling built from a shard size (Note [consecutive shard groups]).

    Args:
        world_size: N, number of ranks.
        shard_size: S, ranks per shard group; must divide N.

    Returns:
        R = N / S shard groups of consecutive ranks, and S replicate groups.

    Raises:
        TypeError: ``shard_size`` is not an int.
        ValueError: ``shard_size`` is not in ``[1, world_size]`` or does not divide it.
    """
    if isinstance(shard_size, bool) or not isinstance(shard_size, int):
        raise TypeError(f"shard_size must be an int (ranks per shard group), got {shard_size!r}; "
                        "pass e.g. shard_size=int(os.environ['LOCAL_WORLD_SIZE']) to shard inside a node")
    if not 1 <= shard_size <= world_size or world_size % shard_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(f"shard_size must divide the world size {world_size}, got shard_size={shard_size}; "
                         f"use one of {divisors} (each shard group has shard_size consecutive ranks)")
    replicas = world_size // shard_size
    return Tiling(
        shard_groups=tuple(tuple(range(g * shard_size, (g + 1) * shard_size)) for g in range(replicas)),
        replicate_groups=tuple(tuple(range(p, world_size, shard_size)) for p in range(shard_size)),
    )


def check_tiling(world_size: int, claims: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Tiling:
    """The tiling that every rank's ``(shard group, replicate group)`` member lists describe.

    Pure: every rank calls it with the same gathered ``claims`` and gets the same result or
    the same error (Note [hybrid layout checks]).

    Args:
        world_size: N, number of ranks.
        claims: for each global rank, the global ranks of the shard group and of the
            replicate group it passed, each in group-rank order.

    Returns:
        The tiling.

    Raises:
        ValueError: the groups do not tile the world: a rank outside a group it passed,
            ranks that passed different member lists for one group, shard groups of unequal
            size, or a replicate group that does not hold exactly the ranks at one position
            of every shard group.
    """
    fix = ("pass each rank its own pair (shard_group, replicate_group), built on every rank with "
           "torch.distributed.new_group, or pass shard_size=S and let shardopt build them")
    if len(claims) != world_size:
        raise AssertionError(f"[rank {comm.group_rank(None)}] {len(claims)} claims for {world_size} ranks")
    for which, column in (("shard", 0), ("replicate", 1)):
        for rank, claim in enumerate(claims):
            members = tuple(claim[column])
            if rank not in members:
                raise ValueError(f"process_groups do not tile the world: rank {rank}'s {which} group {list(members)} "
                                 f"does not contain rank {rank}; {fix}")
            for other in members:
                if tuple(claims[other][column]) != members:
                    raise ValueError(
                        f"process_groups do not tile the world: rank {rank}'s {which} group is {list(members)} but "
                        f"rank {other}'s is {list(claims[other][column])} (groups must not overlap); {fix}")
    shard_groups = tuple(sorted({tuple(c[0]) for c in claims}))
    sizes = sorted({len(g) for g in shard_groups})
    if len(sizes) != 1:
        raise ValueError(f"process_groups do not tile the world: shard groups {[list(g) for g in shard_groups]} "
                         f"have different sizes {sizes}; every shard group must have the same size S; {fix}")
    shard_size = sizes[0]
    expected = tuple(tuple(g[p] for g in shard_groups) for p in range(shard_size))
    for rank, (shard, replicate) in enumerate(claims):
        position = tuple(shard).index(rank)
        if tuple(replicate) != expected[position]:
            raise ValueError(
                f"process_groups do not tile the world: rank {rank} is at position {position} of its shard group "
                f"{list(shard)}, so its replicate group must be the ranks at that position of every shard group, "
                f"{list(expected[position])}, got {list(replicate)}; {fix}")
    return Tiling(shard_groups=shard_groups, replicate_groups=expected)


def _describe(device_mesh: Any, process_groups: Any, shard_size: Any) -> list[tuple[str, Any]]:
    """A rank-independent description of the request, for the agreement check; never raises."""
    given = tuple(name for name, value in (("device_mesh", device_mesh), ("process_groups", process_groups),
                                           ("shard_size", shard_size)) if value is not None)
    entries: list[tuple[str, Any]] = [("given", given)]
    if isinstance(device_mesh, DeviceMesh):
        entries.append(("device_mesh", (device_mesh.mesh_dim_names, device_mesh.mesh.tolist())))
    elif device_mesh is not None:
        entries.append(("device_mesh", type(device_mesh).__name__))
    if shard_size is not None:
        entries.append(("shard_size", shard_size))
    return entries


def _check_request(device_mesh: Any, process_groups: Any, shard_size: Any, world_size: int) -> None:
    """The checks of one rank's request that need no other rank (the same on every rank once
    the requests agree)."""
    given = [name for name, value in (("device_mesh", device_mesh), ("process_groups", process_groups),
                                      ("shard_size", shard_size)) if value is not None]
    if len(given) != 1:
        raise ValueError(
            f"name the hybrid layout exactly one way, got {given or 'none'}: device_mesh=<2-D DeviceMesh with "
            f"dimensions {MESH_DIM_NAMES}>, process_groups=(shard_group, replicate_group), or shard_size=S")
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                            f"{type(device_mesh).__name__}; build it with init_device_mesh(device_type, (R, S), "
                            f"mesh_dim_names={MESH_DIM_NAMES})")
        if device_mesh.ndim != 2 or device_mesh.mesh_dim_names != MESH_DIM_NAMES:
            raise ValueError(
                f"device_mesh must be 2-D with dimensions named {MESH_DIM_NAMES} (replicate outer, shard inner), "
                f"got {device_mesh.ndim}-D with names {device_mesh.mesh_dim_names}; build it with "
                f"init_device_mesh(device_type, (R, S), mesh_dim_names={MESH_DIM_NAMES})")
        ranks = sorted(device_mesh.mesh.flatten().tolist())
        if ranks != list(range(world_size)):
            raise ValueError(f"device_mesh must cover every rank of the world (0..{world_size - 1}), got ranks "
                             f"{ranks}; build the mesh over the whole world")
    if shard_size is not None:
        plan_tiling(world_size, shard_size)


_Claim = tuple[tuple[int, ...], tuple[int, ...]]


def _claim(process_groups: Any, rank: int) -> _Claim | tuple[str, str]:
    """This rank's pair as member lists, or (error type, message) for a pair it cannot use:
    gathered before anyone raises, so every rank raises the same (Note [hybrid layout checks])."""
    if not isinstance(process_groups, (tuple, list)) or len(process_groups) != 2:
        return ("TypeError", f"process_groups must be a pair (shard_group, replicate_group) of process groups, got "
                             f"{process_groups!r} on rank {rank}; build both on every rank with "
                             "torch.distributed.new_group and pass each rank its own")
    for which, group in zip(("shard", "replicate"), process_groups, strict=True):
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            return ("ValueError", f"rank {rank} is not a member of the {which} group it passed (torch gives a rank "
                                  f"that is not in a group GroupMember.NON_GROUP_MEMBER); pass each rank the "
                                  f"{which} group it belongs to")
        if not isinstance(group, comm.ProcessGroup):
            return ("TypeError", f"process_groups must be a pair (shard_group, replicate_group) of process groups, "
                                 f"got a {type(group).__name__} as the {which} group on rank {rank}; build both on "
                                 "every rank with torch.distributed.new_group")
    shard, replicate = process_groups
    return tuple(dist.get_process_group_ranks(shard)), tuple(dist.get_process_group_ranks(replicate))


def _tiling_of_pairs(process_groups: Any, world_size: int, rank: int) -> Tiling:
    """Gather every rank's claim; raise the first rank's problem, or check the tiling, on every rank."""
    claims = comm.all_gather_object(_claim(process_groups, rank), None)
    for claim in claims:
        if isinstance(claim[0], str):
            kind, message = claim
            raise (TypeError if kind == "TypeError" else ValueError)(message)
    return check_tiling(world_size, claims)


def _build_groups(tiling: Tiling, rank: int) -> tuple[comm.ProcessGroup, comm.ProcessGroup]:
    """Create every subgroup on every rank, in the same order (Note [consecutive shard groups]);
    return this rank's shard group and replicate group.

    ``new_group`` builds a group (a rendezvous on the default store), it moves no tensor data;
    it is called here rather than in :mod:`shardopt.comm` because only layouts build groups."""
    shard = [dist.new_group(list(g)) for g in tiling.shard_groups]
    replicate = [dist.new_group(list(g)) for g in tiling.replicate_groups]
    mine = next(i for i, g in enumerate(tiling.shard_groups) if rank in g)
    return shard[mine], replicate[tiling.shard_groups[mine].index(rank)]


def resolve_layout(
    *,
    device_mesh: DeviceMesh | None = None,
    process_groups: tuple[comm.ProcessGroup, comm.ProcessGroup] | None = None,
    shard_size: int | None = None,
) -> HybridLayout:
    """Resolve a hybrid layout named one of three ways into a checked :class:`HybridLayout`.

    Call on every rank, with the same form. How it works: the ranks first agree on what was
    asked (one small all-gather of a digest); then each checks the request (the same error on
    every rank); then the groups are either taken (the mesh's, or the pair) and checked to
    tile the world with one object all-gather of their member lists, or built from
    ``shard_size`` (Note [consecutive shard groups], Note [hybrid layout checks]).

    Args:
        device_mesh: a 2-D mesh with dimensions named ``("replicate", "shard")``.
        process_groups: this rank's ``(shard_group, replicate_group)``.
        shard_size: S, ranks per shard group (consecutive ranks; S must divide the world size).

    Returns:
        The layout; ``tiling`` is equal on every rank.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError: an argument of the wrong type.
        ValueError: not exactly one form given; ranks that asked for different layouts; a
            shard size that does not divide the world; a mesh that is not 2-D, has other
            dimension names or does not cover the world; groups that do not tile the world.
    """
    comm.require_initialized("resolve_layout")
    world_size, rank = comm.group_size(None), comm.group_rank(None)
    agreement.check_agreement("the hybrid layout", _describe(device_mesh, process_groups, shard_size), None,
                              _FIX_AGREE)
    _check_request(device_mesh, process_groups, shard_size, world_size)
    if device_mesh is not None:
        # The groups torch built for the mesh, not the mesh's coordinates: a group ranks its
        # members in ascending order, whatever order the mesh lists them in.
        shard, replicate = device_mesh.get_group("shard"), device_mesh.get_group("replicate")
        tiling = _tiling_of_pairs((shard, replicate), world_size, rank)
        source = LayoutSource.DEVICE_MESH
    elif process_groups is not None:
        tiling = _tiling_of_pairs(process_groups, world_size, rank)
        source = LayoutSource.PROCESS_GROUPS
        shard, replicate = process_groups
    elif shard_size is not None:
        tiling = plan_tiling(world_size, shard_size)
        source = LayoutSource.SHARD_SIZE
        shard, replicate = _build_groups(tiling, rank)
    else:
        raise AssertionError(f"[rank {rank}] no layout form left after _check_request")
    replica_rank = next(i for i, g in enumerate(tiling.shard_groups) if rank in g)
    layout = HybridLayout(
        source=source, shard_group=shard, replicate_group=replicate, shard_size=tiling.shard_size,
        num_replicas=tiling.num_replicas, shard_rank=tiling.shard_groups[replica_rank].index(rank),
        replica_rank=replica_rank, tiling=tiling,
    )
    if comm.group_rank(shard) != layout.shard_rank or comm.group_rank(replicate) != layout.replica_rank:
        raise AssertionError(f"[rank {rank}] the groups' own ranks ({comm.group_rank(shard)}, "
                             f"{comm.group_rank(replicate)}) differ from the tiling's {layout}")
    return layout



def resolve_group(group: Any, device_mesh: DeviceMesh | None, shard_size: int | None
                  ) -> tuple[comm.ProcessGroup | None, HybridLayout | None]:
    """The group a sharded wrapper plans over, and its hybrid layout (``None``: flat).

    How ``OSS`` and ``ShardedDataParallel`` read their arguments: a single process group (or
    ``None``, the world) with neither ``device_mesh`` nor ``shard_size`` is fairscale's flat
    ``group``; a pair ``(shard_group, replicate_group)`` in its place (as
    ``FullyShardedDataParallel(process_group=...)`` takes it for ``HYBRID_SHARD``), a
    ``device_mesh`` or a ``shard_size`` is a hybrid layout, resolved with
    :func:`resolve_layout`, and the wrapper plans over its shard group. The flat case first
    compares the (empty) layout request over ``group``, the same check :func:`resolve_layout`
    makes over the world: a rank given a layout next to ranks given none then fails there on
    every rank with the same message, instead of meeting another collective.

    Args:
        group: a process group, ``None`` (the world), or a ``(shard_group, replicate_group)`` pair.
        device_mesh: a 2-D mesh with dimensions ``("replicate", "shard")``, or ``None``.
        shard_size: S, or ``None``.

    Returns:
        ``(group, None)`` when flat; ``(layout.shard_group, layout)`` for a hybrid layout.

    Raises:
        ValueError, TypeError: as :func:`resolve_layout` (a single group next to
            ``device_mesh`` or ``shard_size`` counts as two forms: name the layout one way).
    """
    if not isinstance(group, (tuple, list)) and device_mesh is None and shard_size is None:
        agreement.check_agreement("the hybrid layout", _describe(None, None, None), group, _FIX_AGREE)
        return group, None
    layout = resolve_layout(device_mesh=device_mesh, process_groups=group, shard_size=shard_size)
    return layout.shard_group, layout
