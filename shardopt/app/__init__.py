"""The ``shardopt`` command (``demo``, ``bench``, ``estimate``): the application layer.

It is built on the library (``shardopt.comm``, ``optim``, ``nn``, ``checkpoint``, ``memory``)
and is the only part of shardopt that imports ``rich``; nothing in the library imports it
(``python scripts/module_graph.py --check`` enforces both).

Modules: :mod:`~shardopt.app.cli` (arguments and commands), :mod:`~shardopt.app.launch`
(local ranks through torch's elastic launcher), :mod:`~shardopt.app.lifeline` (ranks die
with the launcher), :mod:`~shardopt.app.runner` (one rank's measured training run),
:mod:`~shardopt.app.modes` (ddp/zero1/zero2/zero3 and peers), :mod:`~shardopt.app.bench`,
:mod:`~shardopt.app.render` (tables, JSON) and :mod:`~shardopt.app.models` (the built-in GPT).
"""
