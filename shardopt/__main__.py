"""``python -m shardopt``: the ``shardopt`` command (see :mod:`shardopt.app.cli`)."""

import sys

from shardopt.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
