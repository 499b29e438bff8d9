"""The command's help and JSON output: every subcommand's ``--help`` ends with examples that
parse, and ``--json -`` puts the JSON alone on standard output with the tables and progress
on standard error."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shlex
import subprocess
import sys
from typing import Any

import pytest

from shardopt.app.cli import EXAMPLES, build_parser, main
from tests.helpers.cli import TINY
from tests.helpers.processes import REPO


def _subcommands() -> list[str]:
    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return list(actions[0].choices)


def _arguments(line: str) -> list[str]:
    """The ``shardopt`` arguments of an example command line (after torchrun's ``-m shardopt``,
    before a redirection)."""
    words = shlex.split(line)
    words = words[:next((i for i, w in enumerate(words) if w in (">", "|")), len(words))]
    start = words.index("shardopt") + 1
    return words[start:]


def test_every_subcommand_help_ends_with_two_or_three_examples_that_parse(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert sorted(_subcommands()) == sorted(EXAMPLES)  # a new subcommand needs its examples
    for command in _subcommands():
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0
        text = capsys.readouterr().out
        examples = EXAMPLES[command]
        assert 2 <= len(examples) <= 3, command
        tail = text.rstrip("\n").splitlines()[-2 * len(examples) - 1:]
        assert tail[0] == "examples:", (command, tail)
        for (line, what), (comment, shown) in zip(examples, zip(tail[1::2], tail[2::2]), strict=True):
            assert comment == f"  # {what}" and shown == f"  {line}", (command, comment, shown)
            args = build_parser().parse_args(_arguments(line))  # a usage error would raise SystemExit(2)
            assert args.command == command, line


def test_estimate_json_dash_writes_only_json_to_stdout_and_the_table_to_stderr(
        capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--params", "7.5e9", "--world-size", "64", "--json", "-"]) == 0
    out, err = capfd.readouterr()
    data = json.loads(out)
    assert round(data["stage2_bytes"] / 1e9, 1) == 16.6 and data["command"] == "estimate"
    assert "ZeRO-3" in err and "16.6" in err


@pytest.mark.distributed
def test_demo_json_dash_writes_only_json_to_stdout_and_the_table_to_stderr() -> None:
    # A fresh command, as a user runs it: rank 0 writes the JSON, and ranks inherit their
    # standard output from a fork server that, inside this test process, an earlier test
    # may have started with its own captured output.
    done = subprocess.run([sys.executable, "-m", "shardopt", "demo", *TINY, "--steps", "3", "--warmup-steps", "1",
                           "--json", "-"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out, err = done.stdout, done.stderr
    data: dict[str, Any] = json.loads(out)  # nothing else on stdout: no table, no progress bar
    assert data["command"] == "demo" and [r["rank"] for r in data["ranks"]] == [0, 1]
    assert "shardopt demo: training tiny with zero2" in err and "step 3/3" in err  # the header and the bar


@pytest.mark.distributed
def test_bench_shows_overall_progress_on_stderr_and_json_dash_keeps_stdout_for_json(
        capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *TINY, "--steps", "3", "--warmup-steps", "1", "--modes", "zero2", "--rounds", "2",
                 "--json", "-"]) == 0
    out, err = capfd.readouterr()
    data: dict[str, Any] = json.loads(out)
    assert data["command"] == "bench" and [r["mode"] for r in data["results"]] == ["ddp", "zero2"]
    # the progress bar counts runs (2 modes x 2 rounds) and shows elapsed time and time left
    assert "4/4 runs," in err and "elapsed, about" in err and "left: done" in err, err
    assert "median step ms" in err  # the table


def test_bench_eta_appears_after_the_first_run_and_survives_runs_longer_than_richs_window() -> None:
    from rich.console import Console

    from shardopt.app.bench import bench_progress, start_runs

    now = [100.0]
    progress = bench_progress(Console(file=io.StringIO()), get_time=lambda: now[0])
    task = start_runs(progress, 4)
    assert progress.tasks[0].time_remaining is None  # nothing done yet: no rate
    now[0] += 40.0  # one run longer than rich's default 30 s window
    progress.advance(task)
    assert progress.tasks[0].time_remaining == pytest.approx(120.0)  # 3 runs left at 40 s each
    now[0] += 80.0
    progress.advance(task)
    assert progress.tasks[0].time_remaining == pytest.approx(120.0)  # 2 left at the mean of 60 s


def test_docs_cli_md_shows_every_subcommand_help_as_the_command_prints_it() -> None:
    spec = importlib.util.spec_from_file_location("cli_docs", os.path.join(REPO, "scripts", "cli_docs.py"))
    assert spec is not None and spec.loader is not None
    cli_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli_docs)
    with open(os.path.join(REPO, "docs", "cli.md")) as f:
        doc = f.read()
    for command in _subcommands():
        assert f"### `shardopt {command} --help`" in doc, command
    assert cli_docs.render(doc) == doc, "docs/cli.md differs from the command's --help: run python scripts/cli_docs.py"
