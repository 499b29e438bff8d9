"""Fault injection for ``shardopt demo``: a rank kills itself (SIGKILL) at a chosen step and phase.

The restart tests and ``scripts/chaos.py`` set :data:`FAULTS_ENV` to kill ranks at exact
points of a torchrun run, so every kill lands where it should and the run is repeatable::

    SHARDOPT_DEMO_FAULTS="0:1:3:backward,1:0:6:save,2:1:8:exit"

Each entry is ``attempt:rank:step:phase``:

- ``attempt``: the ``TORCHELASTIC_RESTART_COUNT`` at which it fires (0: the first attempt;
  0 outside torchrun). A restarted attempt replays the steps after its checkpoint, so an
  entry fires in one attempt only;
- ``rank``: the global rank that dies;
- ``step``: the step count the phase belongs to, from 1: ``forward``, ``backward`` and
  ``step`` are inside the training step that completes step ``step`` (``forward`` as the
  last block starts, ``backward`` when the gradient reaches the last block's input, so the
  blocks after it have been reduced or are in flight; ``step`` after the local optimizer's
  update, before a sharded optimizer re-gathers the parameters); ``save`` is inside the
  checkpoint written at step ``step`` (rank 0, which writes the file, dies with half of it
  written; another rank dies as the save starts); ``exit`` is after the final checkpoint,
  before the rank reports (``step`` must then be ``--steps``).

Without the variable nothing is armed and nothing is checked per step.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["FAULTS_ENV", "PHASES", "Fault", "FaultPlan", "parse_faults"]

FAULTS_ENV = "SHARDOPT_DEMO_FAULTS"
PHASES = ("forward", "backward", "step", "save", "exit")


@dataclass(frozen=True)
class Fault:
    """Where one rank dies: see the module's docstring."""

    attempt: int
    rank: int
    step: int
    phase: str


def parse_faults(text: str) -> tuple[Fault, ...]:
    """The entries of a :data:`FAULTS_ENV` value.

    Raises:
        ValueError: an entry that is not ``attempt:rank:step:phase`` with integers >= 0
            (step >= 1) and a phase in :data:`PHASES`.
    """
    faults = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        parts = entry.split(":")
        ok = len(parts) == 4 and all(p.isdigit() for p in parts[:3]) and parts[3] in PHASES
        if not ok or int(parts[2]) < 1:
            raise ValueError(f"{FAULTS_ENV}: entry {entry!r} is not attempt:rank:step:phase with integers (step >= 1) "
                             f"and a phase in {PHASES}, e.g. 0:1:3:backward")
        faults.append(Fault(int(parts[0]), int(parts[1]), int(parts[2]), parts[3]))
    return tuple(faults)


def _die(fault: Fault) -> None:
    """Say which fault fires (one line on stderr, for the tests to count), then SIGKILL this process."""
    sys.stderr.write(f"shardopt demo: fault injected: attempt {fault.attempt} rank {fault.rank} step {fault.step} "
                     f"phase {fault.phase}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class FaultPlan:
    """This rank's faults in this attempt, and the hooks that fire them.

    Args:
        faults: every entry (all ranks, all attempts).
        rank: this process's global rank.
        attempt: this attempt's number (``TORCHELASTIC_RESTART_COUNT``).
    """

    def __init__(self, faults: tuple[Fault, ...], rank: int, attempt: int) -> None:
        self._mine = {(f.step, f.phase): f for f in faults if f.rank == rank and f.attempt == attempt}
        self._step = 0
        self._handles: list[Any] = []

    @classmethod
    def from_env(cls, rank: int) -> FaultPlan | None:
        """The plan from :data:`FAULTS_ENV`, or ``None`` when it is unset or names nothing for this rank."""
        text = os.environ.get(FAULTS_ENV, "")
        if not text:
            return None
        plan = cls(parse_faults(text), rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        return plan if plan._mine else None

    def _fire(self, phase: str, step: int | None = None) -> None:
        """Die here when this rank has a fault at ``phase`` of ``step`` (the current step by default)."""
        fault = self._mine.get((self._step if step is None else step, phase))
        if fault is not None:
            _die(fault)

    def _due(self, phase: str, step: int | None = None) -> bool:
        return (self._step if step is None else step, phase) in self._mine

    def arm(self, module: nn.Module) -> None:
        """Hook the forward, backward and optimizer-step kills onto ``module`` (the demo's GPT)."""
        last = list(module.get_submodule("blocks").children())[-1]

        def in_forward(_: nn.Module, args: tuple[Any, ...]) -> None:
            self._fire("forward")
            if self._due("backward") and torch.is_grad_enabled() and args[0].requires_grad:
                args[0].register_hook(lambda grad: self._fire("backward"))

        self._handles.append(last.register_forward_pre_hook(in_forward))
        # The first optimizer to finish its step() is the local one (inside a sharded optimizer's step).
        self._handles.append(register_optimizer_step_post_hook(lambda *_: self._fire("step")))

    def begin_step(self, done: int) -> None:
        """The training step that completes step ``done`` starts."""
        self._step = done

    @contextlib.contextmanager
    def saving(self, step: int, rank: int) -> Iterator[None]:
        """Around the checkpoint written at ``step``: rank 0 dies half-way through writing it, others as it starts."""
        if not self._due("save", step):
            yield
            return
        if rank != 0:
            self._fire("save", step)
        real_save = torch.save

        def half_then_die(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            self._fire("save", step)

        torch.save = half_then_die  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.save = real_save
        self._fire("save", step)  # rank 0 wrote nothing through torch.save: die as the save ends

    def at_exit(self, step: int) -> None:
        """After the final checkpoint, at ``step``."""
        self._fire("exit", step)
