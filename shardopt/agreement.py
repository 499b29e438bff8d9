"""Construction-time agreement across ranks on what shapes the collectives.

Note [agree before the first collective]
Every wrapper issues collectives whose count, sizes and order follow from its parameters and
its settings (bucket size, reduce dtype, ``broadcast_fp16``, sharding strategy, mixed
precision, prefetching). If one rank differs, gloo matches calls of different sizes: a rank
aborts inside gloo (SIGABRT, no Python error) or, worse, two same-sized but different
layouts meet and the model trains wrong without a word (an FSDP unit whose parameters are
registered in another order on one rank). So each wrapper describes those inputs as a list
of named entries and :func:`check_agreement` compares them across ranks once, at
construction: one object all-gather of a digest, and only on a mismatch a second one of the
entries, to name the first one that differs and the rank that has it.

Under torch's fake process group (one process playing one rank of N) every peer is this
process's own program, so it agrees by construction: :func:`check_agreement`,
:func:`check_same_parameters` and :func:`arrive` return at once, without a collective or a
store key (Note [fake process group] in ``shardopt.failures``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardopt import comm, failures

__all__ = ["arrive", "check_agreement", "check_same_parameters", "raise_if_any_failed"]


def check_agreement(what: str, entries: Sequence[tuple[str, Any]], group: comm.ProcessGroup | None,
                    fix: str) -> None:
    """Raise on every rank unless every rank of ``group`` passed equal ``entries``.

    Args:
        what: the object being built, for the message (e.g. ``"ShardedDataParallel"``).
        entries: ``(name, value)`` pairs, in order; values must have a stable ``repr``.
        group: the ranks that must agree.
        fix: what the user should do, appended to the message.

    Raises:
        ValueError: the first entry that differs, its value on group rank 0 and on the
            first rank that differs (or the entry counts).
    """
    if comm.group_size(group) == 1 or failures.is_fake_group():
        return
    described = [(name, repr(value)) for name, value in entries]
    found = _disagreement(described, group)
    if found is None:
        return
    other, mine, theirs = found
    for (name, a), (name_b, b) in zip(mine, theirs, strict=False):
        if (name, a) != (name_b, b):
            detail = (f"{name} is {a} on rank 0 but {b} on rank {other}" if name == name_b else
                      f"entry {name!r} on rank 0 is {name_b!r} on rank {other}")
            break
    else:
        detail = f"rank 0 has {len(mine)} entries, rank {other} has {len(theirs)}"
    raise ValueError(f"{what} was built differently on different ranks: {detail}; {fix}")


def check_same_parameters(what: str, param_groups: Sequence[dict[str, Any]], group: comm.ProcessGroup | None) -> None:
    """Raise on every rank unless every rank of ``group`` has the same parameter list.

    Compares a fingerprint (group index, shape, dtype, ``requires_grad``, contiguity of
    every parameter, in order) with one object all-gather of a digest, and only on a
    mismatch a second one, to name the first parameter that differs.

    Args:
        what: the object being built, for the message (e.g. ``"OSS"``).
        param_groups: ``torch.optim``-style groups, each with ``params``.
        group: the ranks that must agree.

    Raises:
        ValueError: the first parameter that differs (or the counts), on every rank.
    """
    if failures.is_fake_group():  # every peer agrees by construction (Note [fake process group] in failures)
        return
    desc = [
        (gi, tuple(p.shape), str(p.dtype), bool(p.requires_grad), p.is_contiguous())
        for gi, g in enumerate(param_groups)
        for p in g["params"]
    ]
    found = _disagreement(desc, group)
    if found is None:
        return
    other, a, b = found
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            detail = (f"parameter {i} is (group, shape, dtype, requires_grad, contiguous)={x} on rank 0 "
                      f"but {y} on rank {other}")
            break
    else:
        detail = f"rank 0 has {len(a)} parameters, rank {other} has {len(b)}"
    raise ValueError(
        f"{what} was given different parameter lists on different ranks: {detail}; every rank must "
        "pass the same parameters in the same order (build the model identically on all ranks)"
    )


def raise_if_any_failed(what: str, error: BaseException | None, group: comm.ProcessGroup | None) -> None:
    """Raise on every rank of ``group`` if building ``what`` failed on any of them.

    A step that only some ranks take (building the wrapped optimizer over the parameters a
    rank owns: torch's Muon refuses a 1-D parameter only where it is owned) would otherwise
    leave the others to fail later, in their next collective, with a "rank left" error that
    hides the cause. One object all-gather of each rank's error text (``None`` when it built).

    Args:
        what: what was being built, for the message.
        error: this rank's exception, or ``None``.
        group: the ranks that must all have succeeded.

    Raises:
        TypeError, ValueError or RuntimeError: the first failed rank's kind of error (other
            kinds become ValueError), naming that rank and its error, on every rank (chained
            from this rank's own exception where it failed).
    """
    text: tuple[str, str] | None = None if error is None else (type(error).__name__, f"{type(error).__name__}: {error}")
    texts = [text] if comm.group_size(group) == 1 else comm.all_gather_object(text, group)
    failed = [r for r, t in enumerate(texts) if t is not None]
    if not failed:
        return
    first = texts[failed[0]]
    assert first is not None
    kind, message = first
    raise _KINDS.get(kind, ValueError)(f"{what} failed on rank(s) {failed}; on rank {failed[0]}: {message}") from error


_KINDS: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError, "RuntimeError": RuntimeError}


def _disagreement(described: list[Any], group: comm.ProcessGroup | None) -> tuple[int, list[Any], list[Any]] | None:
    """``None`` when every rank of ``group`` has the same ``described`` (one all-gather of a
    digest), else the first rank that differs from rank 0, rank 0's list and its list (a
    second all-gather, of the lists themselves)."""
    digest = hashlib.sha256(repr(described).encode()).hexdigest()
    digests = comm.all_gather_object(digest, group)
    if len(set(digests)) == 1:
        return None
    everyone = comm.all_gather_object(described, group)
    other = next(r for r, d in enumerate(digests) if d != digests[0])
    return other, everyone[0], everyone[other]


_arrivals: dict[str, int] = {}


def arrive(label: str, group: comm.ProcessGroup | None, timeout_s: float) -> list[int]:
    """Check in at ``label`` and wait, at most ``timeout_s``, until every rank of ``group`` has.

    A rendezvous on the default group's store (as the failure board, Note [failure board]
    in ``shardopt.failures``), not a collective of the group: a rank that is in another
    collective meanwhile is not disturbed, and the wait has a timeout that leaves the group
    usable (Note [clip on some ranks only] in ``shardopt.optim.grad_norm``). The n-th call
    with ``label`` on one rank meets the n-th on the others. Each rank sets one key and
    waits for the others'; group rank 0 removes the keys of call n-2 at call n (every rank
    has left that one, since all reached call n-1). Two store round trips per call and rank.

    Args:
        label: what is being entered (``shardopt::<component>::<phase>``).
        group: the ranks that must all arrive.
        timeout_s: how long to wait for them.

    Returns:
        The group ranks that had not arrived when the wait timed out; empty when all did.
    """
    size = comm.group_size(group)
    if size == 1 or failures.is_fake_group():  # a fake group's peers are always present (Note [fake process group])
        return []
    store = failures.default_store()  # scoped to this attempt (Note [one store namespace per attempt] in elastic)
    ranks = "world" if group is None else ",".join(map(str, dist.get_process_group_ranks(group)))
    base = f"shardopt/arrive/{ranks}/{label}"
    number = _arrivals.get(base, 0)
    _arrivals[base] = number + 1
    keys = [f"{base}/{number}/{r}" for r in range(size)]
    me = comm.group_rank(group)
    store.set(keys[me], "")
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:  # the store's "Wait timeout"
        return [r for r, key in enumerate(keys) if not store.check([key])]
    if me == 0 and number >= 2:
        for r in range(size):
            store.delete_key(f"{base}/{number - 2}/{r}")
    return []
