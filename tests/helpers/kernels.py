"""Counting the host work of an optimizer step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def optimizer_kernels(step: Callable[[], Any], cls: type[torch.optim.Optimizer]) -> int:
    """The aten calls (nested ones too: a CPU foreach kernel calls one per tensor) inside the
    ``step`` of the torch optimizer ``cls`` during ``step()`` (OSS's own step is one too)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()

    def inside(event: Any) -> bool:
        while event is not None:
            if event.name == f"Optimizer.step#{cls.__name__}.step":
                return True
            event = event.cpu_parent
        return False

    return sum(1 for e in prof.events() if e.name.startswith("aten::") and inside(e))
