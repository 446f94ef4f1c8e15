"""Training metrics of the online RL step, aggregated with torchmetrics and synced across ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torchmetrics import MeanMetric

from lightning_rl.callbacks.base import RLCallback
from lightning_rl.rollout import Rollout


def rollout_stats(rollout: Rollout, group_size: int) -> dict[str, tuple[torch.Tensor, float]]:
    """``rollout/*`` statistics of one rollout as ``{name: (value, weight)}``."""
    n = float(len(rollout))
    rewards = rollout.rewards.float()
    grouped = rewards.view(-1, group_size) if len(rollout) else rewards.view(0, group_size)
    zero_std = (
        (grouped.max(-1).values == grouped.min(-1).values).float() if len(grouped) else rewards.new_zeros(0)
    )
    return {
        "rollout/reward_mean": (rewards.mean(), n),
        "rollout/reward_std": (rewards.std() if len(rewards) > 1 else rewards.new_zeros(()), n),
        "rollout/correct_frac": (rollout.correct.float().mean(), n),
        "rollout/response_length_mean": (rollout.lengths.float().mean(), n),
        "rollout/truncated_frac": (rollout.truncated.float().mean(), n),
        "rollout/zero_std_group_frac": (zero_std.mean(), float(len(zero_std))),
    }


class PolicyMetrics(RLCallback):
    """Log ``rollout/*``, ``policy/*`` and ``perf/*`` once per RL step.

    Each value is fed to a ``torchmetrics.MeanMetric`` with its weight (samples for rollout
    statistics, the micro-batch's share for loss terms); at the end of the step every metric is
    computed (an all-reduce across ranks), logged, and reset. Every rank must produce the same
    names, which holds because they run the same configuration.
    """

    def __init__(self) -> None:
        self.metrics: dict[str, MeanMetric] = {}

    def _update(self, device: torch.device, name: str, value: Any, weight: float) -> None:
        if name not in self.metrics:
            self.metrics[name] = MeanMetric(nan_strategy="ignore").to(device)
        value = torch.as_tensor(value, dtype=torch.float32, device=device)
        self.metrics[name].update(value, torch.as_tensor(weight, dtype=torch.float32, device=device))

    def on_rollout_end(self, trainer: L.Trainer, pl_module: Any, rollout: Rollout) -> None:
        if len(rollout):
            for name, (value, weight) in rollout_stats(rollout, pl_module.num_generations).items():
                self._update(pl_module.device, name, value, weight)

    def on_update_end(
        self, trainer: L.Trainer, pl_module: Any, metrics: dict[str, Any], weight: float
    ) -> None:
        for name, value in metrics.items():
            self._update(pl_module.device, name, value, weight)

    def on_step_end(self, trainer: L.Trainer, pl_module: Any, stats: Mapping[str, float]) -> None:
        for name, value in stats.items():
            if name.startswith(("perf/", "rollout/")) and name != "perf/generated_tokens":
                self._update(pl_module.device, name, value, 1.0)
        for name in sorted(self.metrics):
            metric = self.metrics[name]
            if metric.update_called:
                pl_module.log(name, metric.compute(), on_step=True, on_epoch=False, batch_size=1,
                              prog_bar=name in ("rollout/reward_mean",))
            metric.reset()
