"""The sampler, the online step's first stage: G completions per prompt row (single turns from the rollout
engine, or whole episodes when there is an environment or tools), scored by the rewards pipeline, as one
:class:`~lightning_rl.step.rollout.Rollout` with its statistics.

It reaches the policy only through :class:`PolicyIO` (encode, the engine's generate, decode), so it never
holds the LightningModule; the module decides the seed of each round. Episodes are one way of sampling, so
the sampler sits in this layer, above the step's stages it uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_rl.episodes.environments import EpisodeBatch
from lightning_rl.episodes.runner import EpisodeRunner
from lightning_rl.models.generation import Generation, SamplingParams
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.reward_pipeline import RewardPipeline
from lightning_rl.step.rollout import Rollout
from lightning_rl.text.prompts import batch_columns


@dataclass
class PolicyIO:
    """How the sampler reaches the policy: ``encode(prompts) -> (ids, mask)`` (left-padded, as the module
    renders them), ``generate(ids, mask, *, num_samples, sampling, seed)`` (the attached engine),
    ``decode(completion_ids, completion_mask)``, and whether generation is synced over ranks."""

    encode: Callable[[Sequence[Any]], tuple[Tensor, Tensor]]
    generate: Callable[..., Generation]
    decode: Callable[[Tensor, Tensor], list[str]]
    synced: bool = False


class Sampler:
    """Samples and scores one batch of prompt rows (see the module docstring).

    Args:
        num_generations: samples per prompt row (G); the samples of row ``i`` are rows ``i*G .. i*G+G-1``.
        sampling: the rollout's sampling parameters (its record carries their temperature, which the
            learner's log-prob passes score at).
        rewards: the rewards pipeline, which alone assembles the reward (an episode's returns included);
            an episode whose environment failed (``model.episodes.on_error: zero``) then gets reward 0 and
            is not correct.
        episodes: the episode runner, or ``None`` for single-turn rollouts; its ``check_failures`` stops a
            step with too many failed episodes before they are scored.
        mask_truncated: completions that hit the token budget leave the loss.
    """

    def __init__(self, num_generations: int, sampling: SamplingParams, rewards: RewardPipeline,
                 episodes: EpisodeRunner | None, mask_truncated: bool) -> None:
        self.num_generations, self.sampling, self.rewards = num_generations, sampling, rewards
        self.episodes, self.mask_truncated = episodes, mask_truncated

    def __call__(self, batch: dict[str, list], io: PolicyIO, *, seed: int, collectives: Collectives | None,
                 decide: bool, device: torch.device) -> tuple[Rollout, dict[str, float]]:
        """The rollout of ``batch`` and its statistics (``decide``: the reward-failure limit, on the step's
        first round only)."""
        G, prompts = self.num_generations, batch["prompt"]
        start = time.perf_counter()
        columns = {k: [v for v in vals for _ in range(G)] for k, vals in batch_columns(batch).items()}
        episodes = None
        if self.episodes is not None:
            episodes = run_episodes(self.episodes, batch, io, num_samples=G, sampling=self.sampling,
                                    seed=seed, collectives=collectives)
            self.episodes.check_failures(episodes, collectives, decide)
            gen, texts, columns["turns"] = episodes.generation, episodes.texts, episodes.turns
        else:
            gen = io.generate(*io.encode(prompts), num_samples=G, sampling=self.sampling, seed=seed)
            texts = io.decode(gen.completion_ids, gen.completion_mask)
        gen_time = time.perf_counter() - start
        returns, said = (episodes.returns, episodes.said_correct) if episodes is not None else (None, None)
        result = self.rewards([p for p in prompts for _ in range(G)], texts, gen.lengths.tolist(), columns,
                              collectives=collectives, decide=decide, returns=returns, said_correct=said,
                              failed=None if episodes is None else episodes.failed, group_size=G)
        rewards, correct, stats = result.rewards, result.correct, result.stats
        outcome = None if result.outcome is None else result.outcome.to(device)
        decoupled = None if result.decoupled is None else result.decoupled.to(device)
        if episodes is not None:
            stats = {**stats, **episodes.stats}
            gen_time -= stats["perf/env_time"]
        group_ids = torch.arange(len(prompts), device=device).repeat_interleave(G)
        rollout = Rollout.from_generation(gen, group_ids, rewards.to(device), correct.to(device),
                                          temperature=self.sampling.temperature,
                                          mask_truncated=self.mask_truncated, outcome=outcome,
                                          decoupled_rewards=decoupled)
        sampled = gen.lengths if gen.model_mask is None else gen.model_mask.sum(-1)
        return rollout, {**stats, "perf/generation_time": gen_time,
                         "perf/generated_tokens": float(sampled.sum())}


def run_episodes(runner: EpisodeRunner, batch: dict[str, list], io: PolicyIO, *, num_samples: int,
                 sampling: SamplingParams, seed: int | None, collectives: Collectives | None) -> EpisodeBatch:
    """``num_samples`` episodes per prompt row of ``batch`` (rollouts, validation and predict)."""
    rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
    return runner(rows, num_samples=num_samples, sampling=sampling, seed=seed, encode=io.encode,
                  generate=io.generate, collectives=collectives, synced=io.synced)
