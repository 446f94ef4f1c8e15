"""``RLCallback``: Lightning callbacks with four more hooks, called by the online RL modules.

The order of one RL step is: generate and score a prompt batch -> ``on_rollout_scored`` (may drop
or add groups: dynamic sampling; returns its own statistics) -> reference log-probs ->
``on_rollout_end`` (old-policy snapshot, rollout metrics) -> updates, each micro-batch followed by
``on_update_end`` (loss metrics) -> ``on_step_end`` with the step's final statistics (read-only).
Statistics flow one way: a callback returns what it measured and never holds the module's dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning as L

if TYPE_CHECKING:
    from lightning_rl.rollout import Rollout


class RLCallback(L.Callback):
    """Base class for callbacks that take part in the RL step. Every hook is a no-op by default."""

    def on_rollout_scored(
        self, trainer: L.Trainer, pl_module: Any, rollout: Rollout
    ) -> tuple[Rollout, dict[str, float]]:
        """After rewards and advantages, before log-probs: the rollout to train on, and statistics to add
        to the step's (values of names the step already has are summed, e.g. ``perf/generation_time``)."""
        return rollout, {}

    def on_rollout_end(self, trainer: L.Trainer, pl_module: Any, rollout: Rollout) -> None:
        """The final rollout of this step, before any update."""

    def on_update_end(
        self, trainer: L.Trainer, pl_module: Any, metrics: dict[str, Any], weight: float
    ) -> None:
        """After each micro-batch's backward pass: its loss metrics and its share of the minibatch."""

    def on_step_end(self, trainer: L.Trainer, pl_module: Any, stats: Mapping[str, float]) -> None:
        """The end of the RL step: its final statistics (``rollout/*``, ``perf/*``), read-only."""
