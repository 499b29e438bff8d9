"""``python -m tests.helpers.restart_entry demo ...``: the ``shardopt`` command with a restart made
to happen the way it does on a loaded machine, without the demo's own fault hooks (so the same
test runs against code that has none).

In torchrun's first attempt rank 1 SIGKILLs itself as soon as the checkpoint file appears
(after the first save). In every later attempt rank 1 starts :data:`START_DELAY_S` late, as a
rank does when its machine is busy or its imports are slow: rank 0 then joins the process
group first, which is when a store key left by the dead attempt is read instead of the new one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

START_DELAY_S = 3.0


def _kill_when_saved(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.005)
    os.kill(os.getpid(), signal.SIGKILL)


def _checkpoint(argv: list[str]) -> str:
    return os.path.abspath(argv[argv.index("--checkpoint") + 1])


if __name__ == "__main__":
    argv = sys.argv[1:]
    if os.environ.get("RANK") == "1":
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            threading.Thread(target=_kill_when_saved, args=(_checkpoint(argv),), daemon=True).start()
        else:
            time.sleep(START_DELAY_S)
    from shardopt.app.cli import main

    sys.exit(main(argv))
