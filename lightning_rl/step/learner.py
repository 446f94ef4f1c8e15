"""The learner's half of the online step (:class:`Learner`): the stages a preset declares, in order (the
frozen models' log-probs, the behaviour log-probs, non-finite tokens out of the loss, the correction
weights, a companion's values, the KL in the reward...), then the advantages, once, after filtering, then
the updater's passes over the rollout.

Each stage takes the rollout and returns a new one with its statistics. The sampler's half of the step
(sampling, rewards, filters) is ``lightning_rl.episodes.source``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from lightning_rl.step.collectives import Collectives
from lightning_rl.step.rollout import Rollout
from lightning_rl.step.update import TrainedModel, UpdateHooks, Updater

Stage = Callable[[Rollout, Collectives], tuple[Rollout, dict[str, float]]]


class Learner:
    """Prepares a scored rollout for the update and runs the update (see the module docstring).

    Args:
        stages: the stages before the advantages, in order (``OnlineStep.learner_stages``).
        advantage: the advantage estimator, the last stage.
        updater: epochs, minibatches and micro-batches of the update.
        seed: the run's seed; minibatches are shuffled by ``(seed, step)``.
    """

    def __init__(self, stages: Sequence[Stage], advantage: Stage, updater: Updater, seed: int) -> None:
        self.stages, self.advantage, self.updater, self.seed = tuple(stages), advantage, updater, seed

    def prepare(self, rollout: Rollout, collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        """The rollout through every stage and the advantages, and every stage's statistics."""
        stats: dict[str, float] = {}
        for stage in [*self.stages, self.advantage]:
            rollout, extra = stage(rollout, collectives)
            stats.update(extra)
        return rollout, stats

    def update(self, rollout: Rollout, trained: list[TrainedModel], hooks: UpdateHooks,
               collectives: Collectives, step: int) -> Iterator[tuple[dict, float]]:
        """Every optimiser step of trainer step ``step``; yields each micro-batch's metrics and its share."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        yield from self.updater.run(rollout, trained, hooks, collectives, generator)
