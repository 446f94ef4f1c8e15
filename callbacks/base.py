"""``RLCallback``: Lightning callbacks with three more hooks, called by the online RL modules.

The order of one RL step is: generate and score a prompt batch -> ``on_rollout_scored`` (may drop
or add groups: dynamic sampling) -> reference log-probs -> ``on_rollout_end`` (old-policy snapshot,
rollout metrics) -> updates, each followed by ``on_update_end`` (loss metrics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L

if TYPE_CHECKING:
    from lightning_rl.rollout import Rollout


class RLCallback(L.Callback):
    """Base class for callbacks that take part in the RL step. Every hook is a no-op by default."""

    def on_rollout_scored(self, trainer: L.Trainer, pl_module: Any, rollout: Rollout) -> Rollout:
        """After rewards and advantages, before log-probs: return the rollout to train on."""
        return rollout

    def on_rollout_end(self, trainer: L.Trainer, pl_module: Any, rollout: Rollout, stats: dict[str, Any]) -> None:
        """The final rollout of this step, and its statistics (``rollout/*``, ``perf/*``)."""

    def on_update_end(self, trainer: L.Trainer, pl_module: Any, metrics: dict[str, Any], weight: float) -> None:
        """After each micro-batch's backward pass: its loss metrics and its share of the minibatch."""
