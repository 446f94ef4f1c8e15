"""Where one online RL step's rollout and numbers go (:class:`StepObserver`): the step's metrics, logged once
at its end through the module's ``log``, and the trainer's ``RLCallback``s, which only observe.

Stages return their numbers and the module hands them here; nothing here changes a number the run computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from lightning_rl.step.metrics import StepMetrics
from lightning_rl.step.rollout import Rollout, rollout_stats


class StepObserver:
    """One training step's observer.

    Args:
        module: the ``LightningModule`` in its ``training_step`` (its ``log``, device and trainer).
        metrics: the run's step metrics (``OnlineRL.step_metrics``: weighted means over the step and ranks).
    """

    def __init__(self, module: Any, metrics: StepMetrics) -> None:
        self.module, self.metrics = module, metrics

    def rollout(self, rollout: Rollout) -> None:
        """The prepared rollout, before any update: its statistics (weighted by samples) into the step's
        metrics, then the callbacks' ``on_rollout_end``."""
        if len(rollout):
            for name, (value, weight) in rollout_stats(rollout).items():
                self.metrics.add(self.module.device, {name: value}, weight)
        for cb in self.callbacks():
            cb.on_rollout_end(self.module.trainer, self.module, rollout)

    def update(self, metrics: Mapping[str, Any], share: float) -> None:
        """One micro-batch's metrics of the update, weighted by its share of the minibatch."""
        self.metrics.add(self.module.device, metrics, share)

    def end(self, stats: dict[str, float]) -> None:
        """The step's statistics into its metrics, every metric reduced over ranks and logged (every rank
        alike), then the callbacks' ``on_step_end`` with ``stats``, read-only."""
        device = self.module.device
        self.metrics.add_stats(device, stats)
        self.metrics.log(device, lambda name, value: self.module.log(
            name, value, on_step=True, on_epoch=False, batch_size=1, prog_bar=name == "rollout/reward_mean"))
        for cb in self.callbacks():
            cb.on_step_end(self.module.trainer, self.module, MappingProxyType(stats))

    def callbacks(self) -> list:
        """The trainer's ``RLCallback``s, in its order."""
        from lightning_rl.callbacks.base import RLCallback

        return [cb for cb in self.module.trainer.callbacks if isinstance(cb, RLCallback)]
