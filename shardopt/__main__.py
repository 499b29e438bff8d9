"""``python -m shardopt``: the ``shardopt`` command (see :mod:`shardopt.cli`)."""

import sys

from shardopt.cli import main

if __name__ == "__main__":
    sys.exit(main())
