"""Process groups that survive torchrun's restarts: one store namespace per attempt.

Note [one store namespace per attempt]
torchrun's elastic agent keeps one TCPStore alive for the whole job and hands it to every
attempt of the workers (``TORCHELASTIC_USE_AGENT_STORE=True``, ``MASTER_ADDR:MASTER_PORT``):
the static rendezvous (torchrun's default) reuses its store across restarts, and so does the
c10d one (``--standalone``, ``--rdzv-backend c10d``), whose TCPStore server is shared with
the workers. ``torch.distributed.init_process_group()`` then keys the new group under the
same names as the last attempt's (``default_pg/0/...``), and the keys the last attempt wrote
are still there. gloo's connectFullMesh publishes each rank's listening address under such a
key and reads the others' without waiting when a key exists, so a rank that reaches
``init_process_group`` before its peer has overwritten its key reads the dead process's
address: "Gloo connectFullMesh failed ... Connection refused" after three retries (about
3 s), or a group that never forms (seen: both ranks idle in a futex wait until the job was
killed, 15 minutes later; and a test timing out at 240 s). NCCL's unique id travels
through the same store and goes stale the same way (pytorch/pytorch#135712). Whether a
restart forms its group is therefore a race between the ranks' start-up times: two ranks
that start within milliseconds of each other (a short script) usually win; ``shardopt
demo`` reads and checks its checkpoint and imports rich before joining, and a loaded machine
spreads the ranks by seconds, so its restarts failed in 3 of 4 tries. shardopt's own keys
in the default store (the failure board, the flight recorder, arrivals) went stale the same
way: a restarted rank read the last attempt's failure report as a fresh one.

``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each agent counts its own restarts,
and an agent that restarts its workers because another node joined or left does not count
that, so two nodes can disagree (pytorch/pytorch#108158, #135712). So the ranks agree on a
fresh namespace through the store itself (:func:`attempt_store`), in a way a stale key
cannot fool:

1. every rank other than 0 writes a fresh random nonce under ``hello/<rank>`` and waits for
   the key ``welcome/<its nonce>``, a name no earlier attempt can have written;
2. rank 0 draws a fresh random token, reads every ``hello/<rank>`` (stale or fresh) and
   answers each value it has not answered yet with ``welcome/<nonce> = token``, and repeats
   until every rank has counted itself in under ``<token>/joined`` (a counter no earlier
   attempt knows the name of);
3. every rank then builds its process group on ``PrefixStore("shardopt/attempt/<token>/",
   store)``: gloo's addresses, NCCL's id, and shardopt's own keys are all this attempt's.

Cost: a few store round trips per rank and one poll loop on rank 0 (10 to 100 ms between
polls); once every rank has arrived the check-in takes milliseconds (1 to 12 ms with 3
ranks on the 2-core test machine, tests/test_elastic.py).
:func:`shardopt.failures.default_store` also scopes shardopt's keys to
``TORCHELASTIC_RESTART_COUNT`` for groups formed with plain
``torch.distributed.init_process_group`` (correct on one node, where every rank has the same
count); such groups still race when they form, which only this module avoids.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from shardopt import failures

__all__ = ["ATTEMPT_PREFIX", "attempt_store", "init_process_group", "uses_agent_store"]

ATTEMPT_PREFIX = "shardopt/attempt/"
"""Where the check-in keys live in the agent's store, and the head of each attempt's namespace."""

_POLL_FIRST_S = 0.01
_POLL_MAX_S = 0.1
_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default for gloo


def uses_agent_store() -> bool:
    """Whether this process is a worker of torch's elastic agent that shares the agent's store.

    Returns:
        ``True`` when ``TORCHELASTIC_USE_AGENT_STORE`` is ``"True"`` (torchrun, and
        ``elastic_launch``): the store at ``MASTER_ADDR:MASTER_PORT`` outlives this attempt.
    """
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def attempt_store(store: Any, rank: int, world_size: int, timeout: timedelta = _DEFAULT_TIMEOUT) -> tuple[Any, str]:
    """Agree with the other ranks on a namespace of ``store`` that no earlier attempt used.

    How it works: Note [one store namespace per attempt]. Every rank of the attempt calls it
    with the same ``store`` (the agent's) and ``world_size``; it returns once every rank has
    checked in.

    Args:
        store: the store every rank shares, possibly holding keys of earlier attempts.
        rank: this rank, ``0 <= rank < world_size``.
        world_size: ranks in this attempt.
        timeout: how long to wait for the others.

    Returns:
        ``(PrefixStore over store, token)``; the token is the same on every rank.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)``.
        TimeoutError: a rank did not check in (rank 0 names them), or rank 0 did not answer,
            within ``timeout``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}; pass this process's RANK")
    deadline = time.monotonic() + timeout.total_seconds()
    if world_size == 1:
        token = uuid.uuid4().hex
    elif rank == 0:
        token = _answer_check_ins(store, world_size, deadline, timeout)
    else:
        token = _check_in(store, rank, deadline, timeout)
    return dist.PrefixStore(f"{ATTEMPT_PREFIX}{token}/", store), token


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


def _check_in(store: Any, rank: int, deadline: float, timeout: timedelta) -> str:
    """A rank other than 0: say hello with a fresh nonce, wait for rank 0's answer to it."""
    nonce = uuid.uuid4().hex
    welcome = f"{ATTEMPT_PREFIX}welcome/{nonce}"
    store.set(f"{ATTEMPT_PREFIX}hello/{rank}", nonce)
    try:
        store.wait([welcome], _left(deadline))
    except RuntimeError as exc:  # the store's "Wait timeout" (DistStoreError is a RuntimeError)
        raise TimeoutError(
            f"[rank {rank}] shardopt.elastic: rank 0 did not answer this rank's check-in within "
            f"{timeout.total_seconds():.0f} s (Note [one store namespace per attempt]); rank 0 may have failed to "
            "start or died: see its log") from exc
    token = bytes(store.get(welcome)).decode()
    store.delete_key(welcome)
    store.add(f"{ATTEMPT_PREFIX}{token}/joined", 1)
    return token


def _answer_check_ins(store: Any, world_size: int, deadline: float, timeout: timedelta) -> str:
    """Rank 0: answer every hello (stale ones too) with a fresh token until all ranks joined."""
    token = uuid.uuid4().hex
    hellos = [f"{ATTEMPT_PREFIX}hello/{r}" for r in range(1, world_size)]
    joined = f"{ATTEMPT_PREFIX}{token}/joined"
    answered: set[str] = set()
    poll = _POLL_FIRST_S
    while True:
        # Usually every rank has a hello (this attempt's or an older one): one round trip.
        # Else answer those that did. (check, not a short wait: a TCPStore wait that times
        # out logs two warnings.)
        present = hellos if store.check(hellos) else [key for key in hellos if store.check([key])]
        nonces = [bytes(v).decode() for v in store.multi_get(present)] if present else []
        fresh = [n for n in dict.fromkeys(nonces) if n not in answered]
        if fresh:
            store.multi_set([f"{ATTEMPT_PREFIX}welcome/{n}" for n in fresh], [token] * len(fresh))
            answered.update(fresh)
        count = int(store.add(joined, 0))
        if count == world_size - 1:
            return token
        if time.monotonic() > deadline:
            missing = [r for r in range(1, world_size) if hellos[r - 1] not in present]
            detail = (f"ranks {missing} never said hello" if missing
                      else f"{world_size - 1 - count} of ranks 1..{world_size - 1} did not answer")
            raise TimeoutError(
                f"[rank 0] shardopt.elastic: {detail} within {timeout.total_seconds():.0f} s of this attempt's "
                "check-in (Note [one store namespace per attempt]); they may have failed to start: see their logs")
        time.sleep(poll)
        poll = min(_POLL_MAX_S, poll * 2)


def init_process_group(backend: str | None = None, timeout: timedelta | None = None, **kwargs: Any) -> str | None:
    """``torch.distributed.init_process_group`` that forms its group on a fresh store namespace under torchrun.

    Under torch's elastic agent with its shared store (torchrun, ``elastic_launch``) the
    ranks first agree on a namespace no earlier attempt used (:func:`attempt_store`), then
    join the group on it, so a restarted attempt never reads a dead attempt's addresses (Note
    [one store namespace per attempt]). Otherwise it is ``init_process_group(backend,
    timeout=timeout, **kwargs)`` with the usual ``env://`` rendezvous.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ... (``None``: torch's default for the devices).
        timeout: the group's collective timeout, also the check-in's (torch's default when
            ``None``).
        **kwargs: passed to ``torch.distributed.init_process_group`` (e.g. ``device_id``);
            not ``store``, ``rank``, ``world_size`` or ``init_method``, which come from
            torchrun's environment.

    Returns:
        The attempt's token under torchrun's shared store, else ``None``.

    Raises:
        ValueError: a keyword that torchrun's environment decides was given.
        TimeoutError: see :func:`attempt_store`.
    """
    taken = sorted({"store", "rank", "world_size", "init_method"} & kwargs.keys())
    if taken:
        raise ValueError(f"shardopt.elastic.init_process_group: {taken} come from torchrun's environment (RANK, "
                         "WORLD_SIZE, MASTER_ADDR, MASTER_PORT); drop them, or call "
                         "torch.distributed.init_process_group yourself")
    extra: dict[str, Any] = dict(kwargs, timeout=timeout) if timeout is not None else dict(kwargs)
    if not uses_agent_store():
        dist.init_process_group(backend, **extra)
        return None
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wait = timeout if timeout is not None else _DEFAULT_TIMEOUT
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=wait)
    store, token = attempt_store(agent, rank, world_size, wait)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **extra)
    failures.use_attempt_store(store)
    return token
