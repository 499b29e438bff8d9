"""``shardopt env``: one plain block naming the versions, backends and the CPU kernels torch
dispatches, which is what explains a rounding difference between two machines."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
import torch

from shardopt import __version__
from shardopt.app.cli import main
from shardopt.app.env_report import report_rows


def test_env_prints_versions_backends_and_the_dispatched_cpu_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    values = {k.strip(): v for k, v in (line.split(" : ", 1) for line in out.splitlines())}
    assert values["shardopt"] == __version__
    assert values["torch"].startswith(torch.__version__)
    assert values["cpu capability"] == torch.backends.cpu.get_cpu_capability()
    assert values["gloo"] == "yes"
    assert values["pytest"] == metadata.version("pytest")
    assert "\x1b[" not in out  # plain text to paste, no terminal colours


def test_env_reads_missing_packages_without_importing_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shardopt.app.env_report.RELATED_PACKAGES", ("no-such-package-xyz",))
    assert dict(report_rows())["no-such-package-xyz"] == "not installed"


@pytest.mark.distributed  # starts a subprocess
def test_env_shows_a_lowered_cpu_capability() -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run([sys.executable, "-m", "shardopt", "env"], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    values = {k.strip(): v for k, v in (line.split(" : ", 1) for line in out.splitlines())}
    assert values["ATEN_CPU_CAPABILITY"] == "default"
    assert values["cpu capability"] == "DEFAULT"
