"""The delayed parameter update under shardopt's ZeRO-1/2 Lightning strategies: their hooks write a
pending update before anything reads the model (Note [delayed update in the integrations] in
:mod:`shardopt.integrations.offload`)."""

from __future__ import annotations

from typing import Any

from shardopt.integrations.extras import raise_missing_extra

try:
    from lightning.pytorch.strategies import DDPStrategy
except ModuleNotFoundError as e:
    raise_missing_extra(e, __name__, "lightning")

from shardopt.integrations.lightning_precision import unwrap_optimizer
from shardopt.optim import OSS

__all__ = ["FinishesDelayedUpdates"]


class FinishesDelayedUpdates(DDPStrategy):
    """Strategy hooks that call ``finish_update()`` on every OSS of the strategy where Lightning is about
    to read the model during or after ``fit``: the model state of a checkpoint (a sharded one is written by
    ``save_sharded``, which finishes it itself), the start of validation, and the end of training (so
    ``test``, ``predict`` and the module after ``fit`` see every update). Without ``delay_update_after``
    nothing is pending and each call does nothing.

    How it works: each hook finishes, then runs the next class's hook. Lightning runs them on every rank,
    as ``finish_update()`` needs (it gathers the parameters).
    """

    def finish_updates(self) -> None:
        """Write every OSS's pending update into the parameters (a collective: call on every rank)."""
        for optimizer in self.optimizers:
            inner = unwrap_optimizer(optimizer)
            if isinstance(inner, OSS):
                inner.finish_update()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The next class's, after :meth:`finish_updates`."""
        self.finish_updates()
        return super().lightning_module_state_dict()

    def on_validation_start(self) -> None:
        """The next class's, after :meth:`finish_updates`."""
        self.finish_updates()
        super().on_validation_start()

    def on_train_end(self) -> None:
        """The next class's, after :meth:`finish_updates`: the trained module holds the last update."""
        self.finish_updates()
        super().on_train_end()
