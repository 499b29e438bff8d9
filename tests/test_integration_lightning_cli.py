"""LightningCLI / YAML users name a shardopt strategy by ``class_path`` without importing
shardopt first: Lightning 2.6 reads no entry point for strategies (only
``lightning.pytorch.callbacks_factory`` for callbacks), so the documented way is the class
path, which jsonargparse imports (and that import registers the ``shardopt_zero*`` names)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("lightning.pytorch")
pytest.importorskip("jsonargparse")

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent('''
    import sys
    import torch
    import lightning.pytorch as L
    from lightning.pytorch.cli import LightningCLI

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(2, 2)

    assert "shardopt.integrations.lightning" not in sys.modules
    cli = LightningCLI(Tiny, run=False, args=["--config", sys.argv[1]], save_config_callback=None)
    strategy = cli.trainer.strategy
    print(type(strategy).__name__, strategy.checkpoint.value, strategy.sdp_kwargs, strategy.offload)
''')

CONFIG = textwrap.dedent('''
    trainer:
      accelerator: cpu
      devices: 1
      logger: false
      enable_progress_bar: false
      strategy:
        class_path: shardopt.integrations.lightning.ZeRO2Strategy
        init_args:
          checkpoint: sharded
          sdp_kwargs: {reduce_buffer_size: 0}
          offload: cpu
''')


def test_yaml_names_a_strategy_by_class_path_without_importing_shardopt(tmp_path: object) -> None:
    config = os.path.join(str(tmp_path), "config.yaml")
    script = os.path.join(str(tmp_path), "cli.py")
    with open(config, "w") as f:
        f.write(CONFIG)
    with open(script, "w") as f:
        f.write(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    done = subprocess.run([sys.executable, script, config], capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ZeRO2Strategy sharded {'reduce_buffer_size': 0} cpu", done.stdout
