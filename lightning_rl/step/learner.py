"""The learner's half of the online step (:class:`Learner`): the stages before the update, in order (log-prob
passes for reference and behaviour, non-finite tokens out of the loss, correction weights, the stages
before the advantages such as PPO's values and the KL in the reward, then the advantages, once, after
filtering), then the updater's passes over the rollout.

Each stage takes the rollout and returns a new one with its statistics. The sampler's half of the step
(sampling, rewards, filters) is ``lightning_rl.episodes.source``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from lightning_rl.step.collectives import Collectives
from lightning_rl.step.logprobs import LogProbPasses, resolve_behaviour
from lightning_rl.step.rollout import Rollout, exclude_nonfinite
from lightning_rl.step.update import TrainedModel, UpdateHooks, Updater

Stage = Callable[[Rollout, Collectives], tuple[Rollout, dict[str, float]]]


class Learner:
    """Prepares a scored rollout for the update and runs the update (see the module docstring).

    Args:
        behaviour: where behaviour log-probs come from (``model.logprobs.behaviour``; resolved against the
            engine each step).
        temperature: the sampling temperature the tokens were drawn at.
        correction: the off-policy correction stage ``rollout -> (rollout, stats)``.
        before: stages run before the advantages (the KL-in-reward penalty).
        advantage: the advantage estimator, the last stage.
        updater: epochs, minibatches and micro-batches of the update.
        seed: the run's seed; minibatches are shuffled by ``(seed, step)``.

    Attributes:
        reads_behaviour: a stage before the update reads the sampling policy's log-probs (distillation's
            advantages): an on-policy step then scores them when the engine did not return them.
    """

    reads_behaviour = False

    def __init__(self, behaviour: str, temperature: float, correction: Callable, before: Sequence[Stage],
                 advantage: Stage, updater: Updater, seed: int) -> None:
        self.behaviour, self.temperature, self.correction = behaviour, temperature, correction
        self.before, self.advantage, self.updater, self.seed = list(before), advantage, updater, seed

    def passes(self, engine: Any, rollout: Rollout) -> LogProbPasses:
        """This step's log-prob passes (the behaviour source resolved against the engine attached now)."""
        behaviour = resolve_behaviour(self.behaviour, self.updater.updates_per_rollout, engine)
        if behaviour == "on_policy" and self.reads_behaviour and rollout.rollout_logp is None:
            behaviour = "recompute"  # the same numbers as the current log-probs before the update
        return LogProbPasses(behaviour, self.temperature, self.updater.micro_batch_size)

    def prepare(self, rollout: Rollout, *, policy: Any, reference: Any, engine: Any, collectives: Collectives,
                companions: Sequence[Stage] = ()) -> tuple[Rollout, dict[str, float]]:
        """The rollout with behaviour / reference log-probs, correction weights and advantages, and every
        stage's statistics (``companions``: the companions' stages, run first before the advantages)."""
        rollout, stats = self.passes(engine, rollout)(rollout, policy, reference, collectives)
        rollout, excluded = exclude_nonfinite(rollout)
        rollout, weights = self.correction(rollout)
        stats = {**stats, **weights, "rollout/excluded_tokens": excluded}
        for stage in [*companions, *self.before, self.advantage]:
            rollout, extra = stage(rollout, collectives)
            stats.update(extra)
        return rollout, stats

    def update(self, rollout: Rollout, trained: list[TrainedModel], hooks: UpdateHooks,
               collectives: Collectives, step: int) -> Iterator[tuple[dict, float]]:
        """Every optimiser step of trainer step ``step``; yields each micro-batch's metrics and its share."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        yield from self.updater.run(rollout, trained, hooks, collectives, generator)
