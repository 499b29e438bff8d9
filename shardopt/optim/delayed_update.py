"""The delayed parameter update of ``OSS(..., offload="cpu", delay_update_after=k)``: DeepSpeed
ZeRO-Offload's DPU (Ren et al. 2021, "ZeRO-Offload", one-step delayed parameter update).

OSS creates one :class:`DelayedUpdate` at construction and asks it, at each step, whether the
step runs in the background (:meth:`~DelayedUpdate.begin_step`); it hands it that step
(:meth:`~DelayedUpdate.launch`) and waits for it (:meth:`~DelayedUpdate.wait`) before anything
reads or writes what the step changes.

Note [delayed update]
With ``delay_update_after=k``, the first ``k`` steps are ordinary; from then on ``OSS.step()``
at iteration i (1) finishes the host step launched at iteration i-1: waits for it, rounds the
masters into the parameters and gathers them, as an ordinary step ends; (2) launches the
wrapped optimizer's step over iteration i's gradients on a worker thread and returns. torch's
kernels release the GIL, so the host step runs while the caller does iteration i+1's forward
and backward, whose gradients are then taken at parameters without step i's update: one step
stale, as in the paper, which also turns the delay on only after a warm-up (early gradients
change fast). It changes the results, hence off by default. Only an offloaded OSS delays:
its step touches host tensors alone, and on a GPU the parameters are copied host to device
only once the step is over (1), so no copy races it.

What the step reads is kept from the next iteration. The masters' gradients are written
during the next backward (ShardedDataParallel adds reduced gradients into their buffer as
they arrive), freed by ``zero_grad``, scaled by clipping and by the grad scaler; and a torch
optimizer reads ``p.grad`` of its parameters when its step starts, on the worker, at a time
the caller does not know. So (a) the optimizer steps tensors of its own: an offloaded
group's flat tensor and a second leaf view of each master's segment (``FlatGroup.stepped``),
never the masters the gradients are added to, and their ``.grad`` is set only at the launch
and dropped only after the wait; (b) the launch copies the group's gradient buffer into a
second buffer, which the step alone reads: a double buffer, copied rather than swapped,
because a mirror's gradient outlives the step (Note [mirrors carry gradients] in
:mod:`shardopt.optim.masters`): the next backward must find it where it adds, so a swap
would copy it back anyway. The cost is 4 bytes per owned element of host memory and one host
copy of them per step, on the caller's thread: about 21 ms of the 25-27 ms a launch took for
31.8M fp32 elements on the project's 2-core CPU machine (``scripts/bench_delayed_update.py``,
docs/offload.md). After the copy the launch frees or hands back the masters' gradients
exactly as an ordinary step does after stepping, so the next iteration sees what it would
without the delay.

Clipping and the grad scaler run on iteration i's gradients before ``step()``, as without the
delay; a step the scaler skips (inf/nan on any rank) never reaches ``OSS.step``: nothing is
launched and the update already running stays pending; the scaler's ``update()`` reads only
its agreed flag. Whatever reads or saves the masters, the optimizer state or the parameters
waits first and writes the update into the parameters: ``OSS.finish_update()``,
``consolidate_state_dict`` (so ``state_dict(all_ranks=True)``), ``sharded_state_entries``,
``add_param_group``, ``refresh_trainable`` (freezing under ShardedDataParallel), and
``checkpoint.save_consolidated`` / ``save_sharded`` before reading the model, so a checkpoint's
model and optimizer are of the same step and training goes on from the written parameters (the
next iteration's gradients are then not stale). A load waits and drops the update: the loaded
state replaces it. So after the last ``step()`` the parameters lack its update until
``finish_update()`` or a save; a parameter written while an update is pending is overwritten
when it finishes.

Note [saved step count]
``delay_update_after`` counts this optimizer's ``step()`` calls (:attr:`DelayedUpdate.steps`; a step
the grad scaler skips never reaches ``OSS.step``, so it is none), and a resumed run must know how
many were taken or its warm-up starts again. So the count is saved with the optimizer state:
``OSS.state_dict()`` holds it under :data:`~shardopt.state_checks.STEPS_KEY` (``"oss_steps"``) beside
``state`` and ``param_groups`` (torch's ``load_state_dict`` reads only those two, so a plain torch
optimizer takes the dict as before), and ``save_sharded`` writes it in its metadata file
(``optim_entries``, from ``OSS.state_dict_entries()``). A load takes it, so a run resumed with the
same ``delay_update_after`` equals bit for bit the run that saved and went on (a save writes the
pending update, so in both the iteration after it is not stale). A dict or folder without the
entry (saved before it existed, or by a plain torch optimizer) starts the count from 0. It is
saved whether or not the optimizer offloads or delays, as the count the next run's warm-up is
measured against: one saved after 100 steps without the delay and resumed with
``delay_update_after=40`` delays from its first step.

A step that raises on the worker is logged at once and raised on the caller's thread by the
next wait, as a ``RuntimeError`` chained from it, before that wait's gather: that rank stops
there, and its peers fail in their next collective, as with any error raised on one rank. The
parameters keep the update before it; the masters and the optimizer state may hold part of it:
resume from a checkpoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from shardopt.state_checks import STEPS_KEY

__all__ = ["DelayedUpdate", "check_delay_update_after"]

logger = logging.getLogger(__name__)


def check_delay_update_after(value: object, offload: torch.device | None) -> int | None:
    """Refuse an ``OSS(delay_update_after=...)`` that is no step count, or used without offload.

    Args:
        value: the argument; ``None`` (default) never delays.
        offload: OSS's host device (``None``: no offload).

    Returns:
        ``value``.

    Raises:
        TypeError: ``value`` is neither ``None`` nor an int (a bool is refused).
        ValueError: ``value`` is negative, or given without ``offload="cpu"``.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"delay_update_after must be an int (the steps taken before the update is delayed) or None, "
                        f"got {type(value).__name__} {value!r}; pass e.g. delay_update_after=50, or None to never delay")
    if value < 0:
        raise ValueError(f"delay_update_after must be >= 0 (the ordinary steps before the update is delayed), got "
                         f"{value}; pass 0 to delay from the first step, or None (default) to never delay")
    if offload is None:
        raise ValueError(f"delay_update_after={value} needs offload='cpu': only a step in host memory runs in the "
                         "background while the device computes the next iteration (Note [delayed update]); pass "
                         "OSS(..., offload='cpu', delay_update_after=...) or drop delay_update_after")
    return value


@dataclass(frozen=True)
class PendingUpdate:
    """A host step running on its worker thread.

    Attributes:
        step: the number of the step (0 for the first ``OSS.step()`` of this optimizer).
        done: completes when the step returns, with its exception if it raised.
    """

    step: int
    done: Future[None]


class DelayedUpdate:
    """When OSS's steps run in the background, and the one that runs (Note [delayed update]).

    How it works: :meth:`begin_step` counts the steps (saved and loaded with the optimizer state: Note
    [saved step count]); from the ``after_steps``-th on it says to delay. :meth:`launch` runs the step
    on a new worker thread (one per step: it lives as long as the step) and keeps a
    :class:`PendingUpdate`; at most one is pending, since OSS waits before launching. :meth:`wait`
    waits for it and re-raises its error.

    Args:
        after_steps: the ordinary steps before the delay starts; ``None``: never delay.
        rank: this rank in OSS's group, for messages.
    """

    def __init__(self, after_steps: int | None, rank: int) -> None:
        self.after_steps = after_steps
        self._rank = rank
        self._steps = 0
        self._pending: PendingUpdate | None = None

    @property
    def steps(self) -> int:
        """The ``step()`` calls counted so far, those of the run it was loaded from included (Note [saved step count])."""
        return self._steps

    def saved_entries(self) -> dict[str, Any]:
        """What an optimizer state dict keeps of this object: ``{STEPS_KEY: steps}`` (Note [saved step count])."""
        return {STEPS_KEY: self._steps}

    def load(self, entries: Mapping[str, Any]) -> None:
        """Wait for a pending step and drop it (the loaded state replaces its update: Note [delayed update]),
        then take the count saved in ``entries`` (checked by ``state_checks.check_optimizer_entries``); 0
        when it holds none (Note [saved step count]).

        Raises:
            RuntimeError: as :meth:`wait`.
        """
        self.wait()
        self._steps = int(entries.get(STEPS_KEY, 0))

    @property
    def pending(self) -> bool:
        """Whether a launched step has not been waited for."""
        return self._pending is not None

    def refuse_closure(self, closure: object) -> None:
        """Raise ``ValueError`` for ``OSS.step(closure)`` with a delay: a closure re-evaluates the
        model, whose parameters a delayed update has not reached."""
        if closure is not None and self.after_steps is not None:
            raise ValueError(f"OSS(delay_update_after={self.after_steps}).step(closure): a closure re-evaluates the "
                             "model at parameters that lack the delayed update; call step() without a closure, or "
                             "build OSS with delay_update_after=None")

    def begin_step(self) -> bool:
        """Count a step of OSS; whether it is delayed (``after_steps`` steps were taken before it)."""
        delayed = self.after_steps is not None and self._steps >= self.after_steps
        self._steps += 1
        return delayed

    def launch(self, step: Callable[[], object]) -> None:
        """Run ``step`` (the wrapped optimizer's step) on a worker thread and return at once."""
        assert self._pending is None, f"[rank {self._rank}] a delayed update was launched before the last one was waited"
        pending = PendingUpdate(self._steps - 1, Future())

        def run() -> None:
            try:
                with torch.profiler.record_function("shardopt::oss::delayed_update"):
                    step()
            except BaseException as exc:  # surfaced by wait(); logged now in case no wait comes
                logger.exception("[rank %s] the delayed update of step %s failed on its worker thread",
                                 self._rank, pending.step)
                pending.done.set_exception(exc)
            else:
                pending.done.set_result(None)

        self._pending = pending
        threading.Thread(target=run, name=f"shardopt-delayed-update-{pending.step}", daemon=True).start()

    def wait(self) -> bool:
        """Wait for the pending step, if any.

        Returns:
            Whether a step was pending (its update is now in the masters).

        Raises:
            RuntimeError: the step raised on its worker (chained from its exception); it is
                no longer pending.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        try:
            pending.done.result()
        except Exception as exc:
            raise RuntimeError(
                f"[rank {self._rank}] OSS: the delayed update of step {pending.step} failed on its worker thread: "
                f"{type(exc).__name__}: {exc}. The parameters keep the update before it; the masters and optimizer "
                "state may hold part of it: resume from a checkpoint (Note [delayed update] in "
                "shardopt.optim.delayed_update)") from exc
        return True
