"""``RLCallback``: Lightning callbacks that observe the online RL step (read-only).

The step's stages compute every number (``lightning_rl.algorithms.online``); callbacks only see the
results: ``on_rollout_end`` gets the final rollout of the step (filtered, scored, with advantages) before
any update, and ``on_step_end`` the step's final statistics (``rollout/*``, ``perf/*``, ...), read-only.
Removing a callback never changes a number the run computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning as L

if TYPE_CHECKING:
    from lightning_rl.step.rollout import Rollout


class RLCallback(L.Callback):
    """Base class for callbacks that observe the RL step. Every hook is a no-op by default."""

    def on_rollout_end(self, trainer: L.Trainer, pl_module: Any, rollout: Rollout) -> None:
        """The final rollout of this step, before any update. Do not modify it."""

    def on_step_end(self, trainer: L.Trainer, pl_module: Any, stats: Mapping[str, float]) -> None:
        """The end of the RL step: its final statistics, read-only."""
