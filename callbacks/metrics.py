"""Training metrics of the online RL step, aggregated with torchmetrics and synced across ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torchmetrics import MeanMetric

from lightning_rl.callbacks.base import RLCallback
from lightning_rl.rollout import Rollout

STEP_STAT_PREFIXES = ("perf/", "rollout/", "critic/", "policy/")  # step statistics that are logged


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
    computed (an all-reduce across ranks), logged, and reset.

    Collectives are symmetric by construction: a rank whose rollout is empty (dynamic sampling kept
    nothing) updates no ``rollout/*`` or ``policy/*`` metric, yet it must join every all-reduce the
    other ranks make. So the key set is not "what this rank updated" but *every name any rank has
    updated so far in this run*: at the end of each step the ranks exchange the names they updated
    (one ``all_gather_object``, the same on every rank) and add them to a registry that only grows.
    Every rank then computes every registered metric, in sorted order; a rank without data for a
    name contributes weight 0, so the value is the weighted mean over the ranks that had data. When
    no rank had data (total weight 0, MeanMetric gives NaN; NaN inputs are ignored, so a NaN result
    means exactly that) nothing is logged for that name this step: the decision follows the reduced
    value, so every rank makes it alike and the logger never sees a NaN.
    """

    def __init__(self) -> None:
        self.metrics: dict[str, MeanMetric] = {}
        self.updated: set[str] = set()  # names this rank updated during the current step

    def _metric(self, device: torch.device, name: str) -> MeanMetric:
        if name not in self.metrics:
            self.metrics[name] = MeanMetric(nan_strategy="ignore").to(device)
        return self.metrics[name]

    def _update(self, device: torch.device, name: str, value: Any, weight: float) -> None:
        value = torch.as_tensor(value, dtype=torch.float32, device=device)
        self._metric(device, name).update(value, torch.as_tensor(weight, dtype=torch.float32, device=device))
        self.updated.add(name)

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
            if name.startswith(STEP_STAT_PREFIXES) and name != "perf/generated_tokens":
                self._update(pl_module.device, name, value, 1.0)
        for name in agreed_names(self.updated):
            self._metric(pl_module.device, name)
        self.updated = set()
        for name in sorted(self.metrics):  # every rank: the same names, in the same order
            metric = self.metrics[name]
            if not metric.update_called:  # weight 0: joins the all-reduce without changing the mean
                zero = torch.zeros((), dtype=torch.float32, device=pl_module.device)
                metric.update(zero, zero)
            value = metric.compute()
            metric.reset()
            if torch.isnan(value):  # no rank had data
                continue
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1,
                          prog_bar=name in ("rollout/reward_mean",))


def agreed_names(names: set[str]) -> set[str]:
    """The union of ``names`` over all ranks (one ``all_gather_object``; ``names`` alone on one process)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return set(names)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(names))
    return set().union(*gathered)
