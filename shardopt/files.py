"""Atomic file writes: the one way shardopt replaces a file (checkpoints, JSON results), and
the staging folder through which a sharded checkpoint replaces a folder, and the check that a
checkpoint can be written at all (:func:`check_writable`, re-exported by :mod:`shardopt.checkpoint`).

Note [atomic writes]
The content goes to a temporary file next to the target, named ``.<name>.tmp-<pid>``, is
flushed to disk, and is renamed over the target with ``os.replace``; then the folder entry
is flushed too. A crash therefore leaves either the old file or the new one, never half of
one. A write that fails removes its temporary file; a process killed mid-write (SIGKILL,
the OOM killer) cannot, so the next write to the same target removes temporary files whose
process is gone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from typing import IO

__all__ = ["SHARDED_MARKER", "atomic_write", "check_writable", "fsync_dir", "is_temp_name", "remove_path",
           "remove_stale_temps", "remove_stale_temps_in", "staging_paths", "swap_in"]

SHARDED_MARKER = "shardopt_meta.pt"
"""The metadata file every shardopt sharded checkpoint folder holds (written last)."""


def _temp_name(path: str, pid: int) -> str:
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.tmp-{pid}")


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(path: str) -> list[str]:
    """Remove temporary files of earlier writes to ``path`` whose process is gone.

    Returns:
        The files removed.
    """
    directory, name = os.path.split(os.path.abspath(path))
    prefix = f".{name}.tmp-"
    removed: list[str] = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        pid_text = entry[len(prefix):]
        if entry.startswith(prefix) and pid_text.isdigit() and not _alive(int(pid_text)):
            stale = os.path.join(directory, entry)
            try:
                os.remove(stale)
                removed.append(stale)
            except OSError:
                pass
    return removed


def is_temp_name(path: str) -> bool:
    """Whether ``path`` is named like the temporary file of an unfinished write (``.NAME.tmp-PID``)."""
    name = os.path.basename(path)
    head, sep, pid = name.rpartition(".tmp-")
    return name.startswith(".") and bool(sep) and len(head) > 1 and pid.isdigit()


def remove_stale_temps_in(directory: str) -> list[str]:
    """Remove, in ``directory``, every temporary file of an earlier write whose process is gone.

    Called by rank 0 at the start of every save and load (temporary files are written by
    rank 0 only, so its process table is the one that knows their writers).

    Returns:
        The files removed.
    """
    removed: list[str] = []
    try:
        entries = os.listdir(directory)
    except OSError:
        return removed
    for entry in entries:
        if is_temp_name(entry):
            removed += remove_stale_temps(os.path.join(directory, entry.rpartition(".tmp-")[0][1:]))
    return removed


def atomic_write(path: str, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through ``write(file)`` atomically (Note [atomic writes]).

    Args:
        path: the file to replace (its folder is created).
        write: writes the whole content to the open binary file it is given.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temps(path)
    tmp = _temp_name(path, os.getpid())
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(directory)


# Note [sharded save staging]
# dcp writes into a hidden folder next to the target, ".<name>.shardopt-staging"; rank 0
# writes the metadata file last, then swaps: the previous checkpoint is renamed to
# ".<name>.shardopt-old", the staging folder to <name>, and the old one is removed. A save
# that fails removes its staging folder (rank 0, once dcp has gathered every rank's result,
# so no rank is still writing into it); a killed save cannot, and the next save removes what
# it left. The names are hidden and shardopt's own, so nothing of the user's next to the
# target is ever moved or removed (a plain "<name>.tmp" would be). A kill between the two
# renames leaves the previous checkpoint in ".<name>.shardopt-old", as load_sharded says.


def staging_paths(path: str) -> tuple[str, str]:
    """(staging folder, previous checkpoint during the swap) of ``path`` (Note [sharded save staging])."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.shardopt-staging"), os.path.join(directory, f".{name}.shardopt-old")


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
