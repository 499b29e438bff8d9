"""The LightningModule the Lightning integration tests train: a seeded MLP regressor with
AdamW and a step-wise LR schedule. Import it after ``pytest.importorskip("lightning.pytorch")``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn


class TinyRegressor(L.LightningModule):
    """An MLP regressor; :meth:`param_groups` decides AdamW's groups (one group by default)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x).float(), y.float())

    def param_groups(self) -> Any:
        return self.parameters()

    def _optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.param_groups(), lr=1e-2, weight_decay=0.1)

    def configure_optimizers(self) -> Any:
        opt = self._optimizer()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
