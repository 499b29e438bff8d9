"""Counting the host work of an optimizer step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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


class _InPlaceWrites(TorchDispatchMode):
    """Records the storage each in-place aten call writes: its first argument, or each tensor of a
    foreach call's first list (a CPU foreach kernel does one write per tensor). The storages are
    kept alive, so that no later allocation gets the address of one written before."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[torch.UntypedStorage] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name.endswith("_") and args:
            first = args[0]
            for t in first if isinstance(first, (list, tuple)) else [first]:
                if isinstance(t, torch.Tensor):
                    self.storages.append(t.untyped_storage())
        return func(*args, **(kwargs or {}))


def writes_into(run: Callable[[], Any], targets: Callable[[], list[torch.Tensor]]) -> int:
    """The in-place aten calls (a foreach call counting once per tensor) during ``run()`` that wrote
    into the storage of one of ``targets()``, taken after ``run`` (e.g. a gradient buffer it allocated)."""
    with _InPlaceWrites() as mode:
        run()
    storages = {t.untyped_storage().data_ptr() for t in targets() if t.numel()}
    return sum(1 for s in mode.storages if s.nbytes() and s.data_ptr() in storages)


class _Calls(TorchDispatchMode):
    """Counts aten calls by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def aten_calls(run: Callable[[], Any], name: str) -> int:
    """How many times the aten op ``name`` (e.g. ``"aten::_to_copy"``) ran during ``run()``."""
    with _Calls() as mode:
        run()
    return mode.names.count(name)
