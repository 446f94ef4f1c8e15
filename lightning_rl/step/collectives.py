"""What a stage of the RL step may do across ranks, without the trainer or the LightningModule.

Stages (rewards, filters, estimators, log-prob passes, the updater) receive a :class:`Collectives`:
sums and maxima over ranks and agreed forward / backward counts. Built from a trainer, it uses the
strategy's reduce; :meth:`Collectives.local` is one process (unit tests, scripts). Every rank must make
the same calls in the same order whatever its data (DESIGN.md, scaling rules).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_rl.models.sharding import agreed_count, collective_backward, collective_forward, zero_loss


class Collectives:
    """Reductions over the ranks of ``trainer`` (or none with ``trainer=None``)."""

    def __init__(self, trainer: Any = None) -> None:
        self.trainer = trainer

    @classmethod
    def local(cls) -> Collectives:
        return cls(None)

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    @property
    def rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    def sum(self, value: Tensor) -> Tensor:
        """``value`` summed over ranks (a copy on one process), on ``value``'s device."""
        return self._reduce(value, "sum")

    def max(self, value: Tensor) -> Tensor:
        return self._reduce(value, "max")

    def _reduce(self, value: Tensor, op: str) -> Tensor:
        if self.trainer is None:
            return value.clone()
        device = self.trainer.strategy.root_device  # NCCL reduces CUDA tensors only
        return self.trainer.strategy.reduce(value.clone().to(device), reduce_op=op).to(value.device)

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` holds on any rank (one all-reduce)."""
        return bool(self.max(torch.tensor(float(flag), device=device)) > 0)

    def agreed_count(self, model: nn.Module, count: int, backward: bool = False) -> int:
        """The largest ``count`` over ranks when ``model``'s forwards (or backwards) are collectives."""
        if self.trainer is None:
            return count
        return agreed_count(self.trainer, model, count, backward=backward)

    def forwards_are_collective(self, model: nn.Module) -> bool:
        return collective_forward(model)

    def backwards_are_collective(self, model: nn.Module) -> bool:
        return collective_backward(self.trainer, model) if self.trainer is not None else False

    def empty_loss(self, module: Any) -> Tensor:
        """A zero loss of ``module`` (a Policy or Critic) whose backward joins the gradient reduction."""
        return zero_loss(module, self.trainer)
