"""Atomic file writes: the one way shardopt replaces a file (checkpoints, JSON results), and
the staging folder through which a sharded checkpoint replaces a folder, what killed saves
leave behind (:func:`tidy`), and the check that a checkpoint can be written at all
(:func:`check_writable`, re-exported by :mod:`shardopt.checkpoint`).

Note [atomic writes]
The content goes to a temporary file next to the target, named
``.<name>.tmp-<host>-<id>-<pid>`` (:func:`temp_path`), is flushed to disk, and is renamed
over the target with ``os.replace``; then the folder entry is flushed too. A crash therefore
leaves either the old file or the new one, never half of one. A write that fails removes
its temporary file; a process killed mid-write (SIGKILL, the OOM killer) cannot, and
Note [leftovers of killed saves] says who removes it.

Note [leftovers of killed saves]
A save killed midway leaves its temporary file (a consolidated checkpoint, 22 MiB for a
small model) or its staging folder (a sharded one). Rank 0 looks for them in the
checkpoint's folder at the start of every save and load (:func:`tidy`; only rank 0 writes
them, so only it looks) and removes one only when its writer is provably gone; it never
removes one a live save is still writing. The proof needs the writer's process, so each
name carries it: ``<host>-<id>-<pid>``, where ``host`` is the writer's host name and ``id``
a CRC-32 of the host's boot id and the writer's pid namespace. The rule:

* same host name and id (the same kernel boot and pid namespace as the looking process):
  the pid can be checked. Removed when no process has that pid, when the process is a
  zombie (killed, not yet reaped by its parent: it writes nothing more, yet ``kill(pid,
  0)`` succeeds, which is why a killed save's file used to stay), or when the process
  started after the leftover was last modified (the pid was reused). Left alone otherwise:
  that is a save in progress, e.g. another job saving into the same folder.
* another host, another container (pid namespace) or another boot of this host, or a name
  without a writer (written by older shardopt versions): the pid means nothing here, so the
  leftover is named in a warning, once per process, with what to do, and left in place.
  A multi-host job on a shared file system thus warns about a leftover of a save whose
  rank 0 ran on another host, rather than delete what may be another job's live save.

Age is no proof: a live save may stand still for minutes (a stopped process, a slow network
file system), so no rule here reads a leftover's age except to detect a reused pid (the
writer must have started before its last write; ``_CLOCK_SLACK_S`` covers the second-
granular boot time that start times are computed from). A pid reused within that slack of
the kill hides the leftover until that process ends. A sharded save's staging folder is
named after rank 0, whose death ends the save (only rank 0 swaps it in): ranks of that save
still writing into it can no longer produce a checkpoint. The staging folder's swap leaves
``.<name>.shardopt-old`` for a moment (Note [sharded save staging]); one found next to a
complete ``<name>`` was left by a save killed after its swap and is removed too.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import re
import shutil
import socket
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

__all__ = ["SHARDED_MARKER", "Leftover", "Tidied", "Writer", "atomic_write", "check_writable", "fsync_dir",
           "is_temp_name", "old_path", "parse_leftover", "remove_path", "replacing", "staging_path", "swap_in",
           "temp_path", "tidy", "writer_tag"]

logger = logging.getLogger(__name__)

SHARDED_MARKER = "shardopt_meta.pt"
"""The metadata file every shardopt sharded checkpoint folder holds (written last)."""

_TEMP = ".tmp-"
_STAGING = ".shardopt-staging"
_OLD = ".shardopt-old"
_CLOCK_SLACK_S = 2.0
_TAG = re.compile(r"(?P<host>.+)-(?P<id>[0-9a-f]{8})-(?P<pid>[0-9]+)")


@functools.cache
def writer_tag() -> str:
    """``<host>-<id>``: this host's name and a CRC-32 of its boot id and this process's pid
    namespace (Note [leftovers of killed saves]); the pids of two processes are comparable
    only where their tags are equal."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:40] or "host"
    parts = []
    for read in (lambda: open("/proc/sys/kernel/random/boot_id").read().strip(),
                 lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except OSError:  # not Linux: the host name alone tells hosts apart
            parts.append("")
    return f"{host}-{zlib.crc32('|'.join(parts).encode()):08x}"


def _hidden(path: str, suffix: str) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}{suffix}")


def temp_path(path: str) -> str:
    """The temporary file this process writes ``path`` through (Note [atomic writes])."""
    return _hidden(path, f"{_TEMP}{writer_tag()}-{os.getpid()}")


def fsync_dir(path: str) -> None:
    """Flush a folder's entries to disk (best effort where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not every platform lets a directory be opened; the rename is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Leftover:
    """What a save killed midway may have left next to its target (Note [leftovers of killed saves]).

    Attributes:
        path: the temporary file or staging folder.
        target: the checkpoint it was writing.
        staging: a sharded save's staging folder (else a temporary file).
        tag: its writer's :func:`writer_tag`; ``None`` in names older shardopt versions wrote.
        pid: its writer's pid (``None`` where the name has none).
    """

    path: str
    target: str
    staging: bool
    tag: str | None
    pid: int | None


def parse_leftover(path: str) -> Leftover | None:
    """``path`` as a :class:`Leftover`, or ``None`` when it is not named like one."""
    directory, name = os.path.split(os.path.abspath(path))
    if not name.startswith("."):
        return None
    for mark, staging in ((_TEMP, False), (_STAGING, True)):
        head, sep, rest = name[1:].rpartition(mark)
        if not (sep and head):
            continue
        target = os.path.join(directory, head)
        if staging and not rest:  # the fixed name older versions staged in
            return Leftover(path, target, True, None, None)
        if not staging and rest.isdigit():  # ".<name>.tmp-<pid>" of older versions
            return Leftover(path, target, False, None, int(rest))
        if staging:
            rest = rest[1:] if rest.startswith("-") else ""  # ".<name>.shardopt-staging-<host>-<id>-<pid>"
        found = _TAG.fullmatch(rest)
        if found:
            return Leftover(path, target, staging, f"{found['host']}-{found['id']}", int(found["pid"]))
    return None


def is_temp_name(path: str) -> bool:
    """Whether ``path`` is named like the temporary file of an unfinished write."""
    found = parse_leftover(path)
    return found is not None and not found.staging


class Writer(enum.Enum):
    """Whether a leftover's writer still runs (Note [leftovers of killed saves])."""

    GONE = "gone"
    """Provably not writing any more: the leftover is removed."""
    RUNNING = "running"
    """A live process of this host and pid namespace: a save in progress, left alone."""
    UNKNOWN = "unknown"
    """Another host, container or boot, or an older name: named in a warning, left alone."""


def _process(pid: int) -> tuple[str, float] | None:
    """(state letter, start time in seconds since the epoch) of a process, from /proc; ``None`` elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return fields[0], boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def writer_state(item: Leftover, modified: float) -> Writer:
    """Whether ``item``'s writer still runs; ``modified``: when ``item`` was last modified."""
    if item.tag != writer_tag() or item.pid is None:
        return Writer.UNKNOWN
    if item.pid == os.getpid():
        return Writer.RUNNING
    try:
        os.kill(item.pid, 0)
    except ProcessLookupError:
        return Writer.GONE
    except PermissionError:
        pass  # another user's live process
    found = _process(item.pid)
    if found is None:
        return Writer.RUNNING
    state, started = found
    return Writer.GONE if state in ("Z", "X") or started > modified + _CLOCK_SLACK_S else Writer.RUNNING


@dataclass(frozen=True)
class Tidied:
    """What :func:`tidy` did.

    Attributes:
        removed: leftovers removed (their writers were gone).
        named: leftovers left in place and named in a warning.
    """

    removed: tuple[str, ...] = ()
    named: tuple[str, ...] = ()


def _where(tag: str) -> str:
    host = tag.rpartition("-")[0]
    if host == writer_tag().rpartition("-")[0]:
        return "on this host but in another container (pid namespace) or before a reboot"
    return f"on host {host!r}"


_named: set[str] = set()


def _name(item: Leftover, why: str) -> None:
    """Warn about ``item``, once per process (a job saving every few minutes would repeat it)."""
    if item.path in _named:
        return
    _named.add(item.path)
    what = "staging folder" if item.staging else "temporary file"
    warnings.warn(f"{item.path!r} is the {what} of a save of {item.target!r} that was killed or is still running "
                  f"{why}; it was left in place. If no save to {item.target!r} is running there, delete it",
                  stacklevel=2)


def tidy(directory: str, target: str | None = None) -> Tidied:
    """Remove what killed saves left in ``directory`` (Note [leftovers of killed saves]).

    How it works: every entry named like a :class:`Leftover` is removed when its writer is
    provably gone (:func:`writer_state`), left alone while its writer runs, and named in a
    warning (once per process) when this process cannot tell. A ``.<name>.shardopt-old``
    folder next to a complete ``<name>`` is removed too.

    Args:
        directory: the folder to look in.
        target: look only at the leftovers of this file or folder (default: all).

    Returns:
        What was removed and what was named.
    """
    removed: list[str] = []
    named: list[str] = []
    try:
        entries = sorted(os.listdir(directory))
    except OSError:
        return Tidied()
    wanted = os.path.abspath(target) if target is not None else None
    for entry in entries:
        full = os.path.join(os.path.abspath(directory), entry)
        item = parse_leftover(full)
        if item is None:
            finished = os.path.join(os.path.abspath(directory), entry[1:-len(_OLD)])
            if (entry.startswith(".") and entry.endswith(_OLD) and len(entry) > len(_OLD) + 1
                    and wanted in (None, finished) and os.path.isfile(os.path.join(finished, SHARDED_MARKER))):
                _remove(full, removed, named, None)  # a save killed after its swap (Note [sharded save staging])
            continue
        if wanted is not None and item.target != wanted:
            continue
        try:
            modified = os.lstat(full).st_mtime
        except OSError:
            continue  # gone meanwhile: its save finished
        state = writer_state(item, modified)
        if state is Writer.GONE:
            _remove(full, removed, named, item)
        elif state is Writer.UNKNOWN:
            named.append(full)
            _name(item, f"by process {item.pid} {_where(item.tag)}, which cannot be checked from here" if item.tag
                  else "(named by an older shardopt, without its writer's host)")
    return Tidied(tuple(removed), tuple(named))


def _remove(path: str, removed: list[str], named: list[str], item: Leftover | None) -> None:
    try:
        remove_path(path)
    except OSError as exc:
        named.append(path)
        if item is not None:
            _name(item, f"(its writer is gone, but it could not be removed: {exc.strerror})")
        return
    removed.append(path)
    logger.info("removed %s, left by a save that was killed", path)


@contextmanager
def replacing(path: str) -> Iterator[str]:
    """A temporary path to write ``path``'s new content to, renamed over ``path`` when the
    block ends without an error (Note [atomic writes]); removed when it raises.

    Args:
        path: the file to replace (its folder is created).

    Yields:
        The temporary path (:func:`temp_path`).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tidy(directory, target=path)
    tmp = temp_path(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(directory)


def atomic_write(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through ``write(file)`` atomically (Note [atomic writes]).

    Args:
        path: the file to replace (its folder is created).
        write: writes the whole content to the open binary file it is given.
    """
    with replacing(path) as tmp, open(tmp, "wb") as f:
        write(f)


# Note [sharded save staging]
# dcp writes into a hidden folder next to the target, ".<name>.shardopt-staging-<host>-<id>-<pid>"
# named after rank 0's process (staging_path; rank 0 hands the name to the other ranks);
# rank 0 writes the metadata file last, then swaps: the previous checkpoint is renamed to
# ".<name>.shardopt-old", the staging folder to <name>, and the old one is removed. A save
# that fails removes its staging folder (rank 0, once dcp has gathered every rank's result,
# so no rank is still writing into it); a killed save cannot, and the next save or load in
# that folder removes it once its writer is gone (Note [leftovers of killed saves]). The
# names are hidden and shardopt's own, so nothing of the user's next to the target is ever
# moved or removed (a plain "<name>.tmp" would be). A kill between the two renames leaves
# the previous checkpoint in ".<name>.shardopt-old", as load_sharded says.


def staging_path(path: str) -> str:
    """The staging folder this process (rank 0) writes ``path`` through (Note [sharded save staging])."""
    return _hidden(path, f"{_STAGING}-{writer_tag()}-{os.getpid()}")


def old_path(path: str) -> str:
    """Where the previous checkpoint ``path`` stays during the swap (Note [sharded save staging])."""
    return _hidden(path, _OLD)


def remove_path(path: str) -> None:
    """Remove a file or a folder tree (not what a link points to); nothing if absent."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def swap_in(staging: str, path: str, old: str) -> None:
    """Replace ``path`` by the finished ``staging`` folder (Note [sharded save staging])."""
    if os.path.exists(path):
        remove_path(old)  # left by a save killed after its swap
        os.replace(path, old)
        try:
            os.replace(staging, path)
        except BaseException:
            os.replace(old, path)
            raise
    else:
        os.replace(staging, path)
    fsync_dir(os.path.dirname(path))
    remove_path(old)


def check_writable(path: str, sharded: bool) -> None:
    """Fail now, not after training, when a checkpoint cannot be written at ``path``.

    Args:
        path: the checkpoint file (consolidated) or folder (sharded).
        sharded: whether a folder will be written.

    Raises:
        ValueError: a file where a folder is needed or the reverse (the path itself or one
            of its parents), a non-empty folder that is not a shardopt checkpoint, or a
            parent folder where files cannot be created.
    """
    path = os.path.abspath(path)
    if sharded and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is a file, but a sharded checkpoint is a folder; "
                         "pick another path or remove the file")
    if sharded and os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, SHARDED_MARKER)):
        raise ValueError(f"checkpoint path {path!r} is a folder that holds something else than a shardopt "
                         "checkpoint; pick an empty or new folder (it would be replaced)")
    if not sharded and os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is a folder, but a consolidated checkpoint is a file; "
                         "pick a file name")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"checkpoint path {path!r} cannot be created: {parent!r} is a file, not a folder: the "
                         "checkpoint cannot be created under it; pick another path")
    try:  # a real probe: access() says yes to root even where nothing can be created
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise ValueError(f"checkpoint path {path!r} cannot be written: no files can be created in {parent!r} "
                         f"({exc.strerror}); pick a writable folder") from exc
