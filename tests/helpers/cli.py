"""Shared by the CLI tests: the tiny-model arguments and the check that a bad command line
ends in one line of error naming the problem."""

from __future__ import annotations

import pytest

from shardopt.app.cli import main

TINY = ["--model", "tiny", "--batch-size", "2", "--threads-per-rank", "1", "--device", "cpu"]
"""Arguments for a quick run: the tiny model, batch 2, one thread per rank, on the CPU (gloo)
even where a GPU is visible (``--device auto`` would take it: NCCL with one GPU per rank)."""


def assert_one_line_errors(cases: list[tuple[list[str], str]], capsys: pytest.CaptureFixture[str]) -> None:
    """Each ``(argv, expected)`` exits with code 2 and one line on stderr containing ``expected``."""
    for argv, expected in cases:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2, (argv, err)
        assert err.count("\n") == 1 and err.startswith(f"shardopt {argv[0]}: error: "), (argv, err)
        assert expected in err, (argv, err)
