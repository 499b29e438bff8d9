"""Usage errors of the ``shardopt`` command: one line on standard error, exit code 2, and
the check that an output path can be written before any rank starts."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import NoReturn

from shardopt.app.render import JSON_TO_STDOUT

__all__ = ["check_writable", "fail"]


def fail(command: str, message: str) -> NoReturn:
    """End the command with ``shardopt <command>: error: <message>`` and exit code 2."""
    sys.stderr.write(f"shardopt {command}: error: {message}\n")
    raise SystemExit(2)


# Note [paths checked at startup]
# Checkpoints and results are written after training, so a path that cannot be written
# would cost the whole run. Every output path is checked before any rank starts: the path
# must not be a folder where a file goes (or a file where a folder goes), and the nearest
# existing folder on the way to it must be a folder in which this process can create a
# file (missing folders below it are created at save time, as before). A probe file is
# created and removed rather than asking os.access, which says yes to root everywhere.


def check_writable(command: str, option: str, path: str, folder: bool, why: str) -> None:
    """Fail now with one line when ``path`` cannot be written later (Note [paths checked at startup]).

    ``--json -`` (standard output) is always writable.
    """
    if option == "--json" and path == JSON_TO_STDOUT:
        return
    path = os.path.abspath(path)
    if folder and os.path.exists(path) and not os.path.isdir(path):
        fail(command, f"{option} {path!r} is a file, but {why}; remove it or choose another path")
    if not folder and os.path.isdir(path):
        fail(command, f"{option} {path!r} is a folder, but {why}; choose a file path")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        fail(command, f"{option} {path!r} cannot be written: {parent!r} is a file, not a folder; choose another "
              "path")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".shardopt-probe-")
    except OSError as exc:
        fail(command, f"{option} {path!r} cannot be written: cannot create files in {parent!r} ({exc.strerror}); "
              "choose a writable path")
    os.close(fd)
    os.remove(probe)
