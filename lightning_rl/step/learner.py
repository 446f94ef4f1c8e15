"""The learner's stages before the update, in order: log-prob passes (reference, behaviour), non-finite
tokens out of the loss, correction weights, the stages before the advantages (PPO's values, the KL in the
reward), then the advantages, once, after filtering.

Each stage takes the rollout and returns a new one with its statistics; :func:`prepare` runs them in turn
and returns the rollout the updater trains on. The sampler's half of the step (sampling, rewards, filters)
is ``lightning_rl.episodes.sampler``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lightning_rl.step.collectives import Collectives
from lightning_rl.step.logprobs import LogProbPasses
from lightning_rl.step.rollout import Rollout, exclude_nonfinite

Stage = Callable[[Rollout, Collectives], tuple[Rollout, dict[str, float]]]


def prepare(rollout: Rollout, *, passes: LogProbPasses, policy: Any, reference: Any,
            correction: Callable[[Rollout], tuple[Rollout, dict[str, float]]], stages: Sequence[Stage],
            collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
    """The rollout with behaviour / reference log-probs, correction weights and advantages (``stages``
    ends with the advantage estimator), and every stage's statistics."""
    rollout, stats = passes(rollout, policy, reference, collectives)
    rollout, excluded = exclude_nonfinite(rollout)
    rollout, weights = correction(rollout)
    stats = {**stats, **weights, "rollout/excluded_tokens": excluded}
    for stage in stages:
        rollout, extra = stage(rollout, collectives)
        stats.update(extra)
    return rollout, stats
