"""How a module's policy is sampled outside the learner: :class:`Completer`.

It binds the module's engine to the policy (whether generation is synced over ranks is the strategy's
decision, made anew on each use), refreshes the engine's weights, and produces completions of prompt rows:
the engine's texts, or whole episodes when the module has an environment or tools. The module builds one
per use (``module.completer``) from what it holds then; validation, predict, the sampler's
:class:`~lightning_rl.episodes.sampler.PolicyIO` and the worker sampling ahead all start here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_rl.algorithms.evaluation import Completions
from lightning_rl.episodes.runner import EpisodeRunner
from lightning_rl.episodes.sampler import PolicyIO, run_episodes
from lightning_rl.models.generation import Generation, SamplingParams
from lightning_rl.models.policy import Policy
from lightning_rl.models.prompt_codec import PromptCodec
from lightning_rl.models.sharding import needs_synced_generation
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.engine import RolloutEngine


@dataclass
class Completer:
    """Completions of ``policy`` through ``engine`` (see the module docstring).

    Args:
        engine: the module's rollout engine.
        policy: the trained policy.
        codec: how prompt rows are encoded and completions decoded.
        trainer: the trainer running now (``None`` outside a run: one process, weights always copied).
        max_new_tokens: the greedy completions' token budget (validation's).
        episodes: the episode runner (multi-turn), or ``None``.
        compact: the engine may use the compacting sampler (``model.sampling.share_prompt_prefix``).
    """

    engine: RolloutEngine
    policy: Policy
    codec: PromptCodec
    trainer: Any
    max_new_tokens: int
    episodes: EpisodeRunner | None = None
    compact: bool = False

    def attach(self) -> RolloutEngine:
        """Bind the engine to the policy (cheap, every time: the strategy decides ``synced``)."""
        self.engine.attach(self.policy, synced=needs_synced_generation(self.trainer, self.policy.model),
                           compact=self.compact)
        return self.engine

    def sync(self) -> None:
        """The engine samples with the trained weights as they are now (an engine with its own copy skips
        the copy when it already holds this optimiser step's weights)."""
        version = self.trainer.global_step if self.trainer is not None else None  # None: always copy
        self.attach().sync_weights(self.policy, version=version)

    def io(self) -> PolicyIO:
        """How samplers and episodes reach the policy: through the engine attached now."""
        engine = self.attach()
        return PolicyIO(self.codec.encode, engine.generate, self.codec.decode, engine.synced)

    def generate(self, prompts: Sequence[Any], *, num_samples: int = 1, sampling: SamplingParams,
                 seed: int | None = None) -> Generation:
        """Completions of ``prompts`` from the engine (sharded weights make every rank keep generating until
        all finish, whatever their lengths)."""
        ids, mask = self.codec.encode(prompts)
        return self.generate_tokens(ids, mask, num_samples=num_samples, sampling=sampling, seed=seed)

    def generate_tokens(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, num_samples: int = 1,
                        sampling: SamplingParams, seed: int | None = None) -> Generation:
        """:meth:`generate` for prompts already encoded (left-padded ids and mask)."""
        return self.attach().generate(prompt_ids, prompt_mask, num_samples=num_samples, sampling=sampling,
                                      seed=seed)

    def complete(self, batch: dict[str, list], *, num_samples: int = 1, sampling: SamplingParams,
                 seed: int | None = None) -> Completions:
        """``num_samples`` completions of each prompt row of ``batch`` (validation and predict): the engine's
        texts, or whole episodes when there is an episode runner."""
        if self.episodes is not None:
            done = run_episodes(self.episodes, batch, self.io(), num_samples=num_samples, sampling=sampling,
                                seed=seed, collectives=Collectives(self.trainer))
            lengths = done.generation.lengths.tolist()
            return Completions(done.texts, lengths, done.turns, done.returns.tolist(), done.failed.tolist())
        gen = self.generate(batch["prompt"], num_samples=num_samples, sampling=sampling, seed=seed)
        return Completions(self.codec.decode(gen.completion_ids, gen.completion_mask), gen.lengths.tolist())

    def greedy(self, prompts: Sequence[Any]) -> tuple[list[str], list[int]]:
        """Greedy completions of ``prompts`` within ``max_new_tokens`` and their lengths in tokens (EOS
        included)."""
        done = self.complete({"prompt": list(prompts)},
                             sampling=SamplingParams(self.max_new_tokens, do_sample=False))
        return done.texts, done.lengths
