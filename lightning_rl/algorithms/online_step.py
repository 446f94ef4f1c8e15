"""The online step an ``OnlineRL`` module holds (:class:`OnlineStep`): the sampler's half and the learner's
stages, built from the option groups by ``assembly.online_step``, and what the module asks of them.

The module talks to it: its ``training_step`` has it sample (:meth:`OnlineStep.sample`), build the learner
once (:meth:`OnlineStep.learner`) and the policy's loss of each update (:meth:`OnlineStep.policy_loss`); its
``on_fit_start`` has it settle scoring (:meth:`OnlineStep.start`); its worker sampling ahead is handed
:meth:`OnlineStep.worker_spec`. What presets, callbacks and the base read on the module (``updater``,
``frozen``, ``rollouts``...) are :class:`StepField` attributes: this record's fields, read and written here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_rl.algorithms.ahead import WorkerSpec
from lightning_rl.episodes.async_source import AsyncRollouts
from lightning_rl.episodes.runner import EpisodeRunner
from lightning_rl.episodes.sampler import PolicyIO, Sampler
from lightning_rl.episodes.source import RolloutSource
from lightning_rl.maths.objective import Objective
from lightning_rl.models.frozen import FrozenModels
from lightning_rl.models.generation import SamplingParams
from lightning_rl.models.sharding import prompt_sharing
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.correction import RolloutCorrection
from lightning_rl.step.engine import RolloutEngine
from lightning_rl.step.estimators import AdvantageEstimator, KLInReward
from lightning_rl.step.filters import DynamicSampling
from lightning_rl.step.learner import Learner, Stage
from lightning_rl.step.logprobs import BehaviourLogProbs, ExcludeNonfinite, FrozenLogProbs
from lightning_rl.step.policy_loss import PolicyLoss
from lightning_rl.step.rollout import Rollout
from lightning_rl.step.update import Updater

if TYPE_CHECKING:
    from lightning_rl.algorithms.assembly import RewardStages


@dataclass
class OnlineStep:
    """One online RL step's parts, none of them a Lightning hook (see the module docstring).

    Attributes:
        policy, engine: the module's trained policy and what samples its rollouts.
        sampling, num_generations, seed: the rollouts' sampling parameters, G, the run's seed.
        share_prompt_prefix: scoring may run each distinct prompt once (settled by :meth:`start`).
        episodes: the multi-turn runner (``None``: one completion per prompt).
        rewards: the reward stages (the pipeline, the accuracy and correctness functions).
        sampler, rollouts: the sampler and the rollout source (in the step, or a worker sampling ahead).
        advantage, objective, entropy_coef, kl_reward: the estimator, the policy loss, its entropy bonus, the
            KL penalty in the reward (``None``: off).
        updater: the update's epochs, minibatches and micro-batches.
        behaviour, correction, reads_behaviour: the behaviour log-probs' source, the rollout correction, and
            whether a stage reads the sampling policy's log-probs (distillation).
        frozen: the frozen models the learner scores with (the reference when a KL term is on; a preset's
            own), out of the module tree: never in checkpoints or optimisers.
    """

    policy: Any
    engine: RolloutEngine
    sampling: SamplingParams
    num_generations: int
    seed: int
    share_prompt_prefix: bool
    episodes: EpisodeRunner | None
    rewards: RewardStages
    sampler: Sampler
    rollouts: RolloutSource | AsyncRollouts
    advantage: AdvantageEstimator
    objective: Objective
    entropy_coef: float
    kl_reward: KLInReward | None
    updater: Updater
    behaviour: str
    correction: RolloutCorrection
    reads_behaviour: bool
    frozen: FrozenModels
    built_learner: Learner | None = None

    @property
    def needs_reference(self) -> bool:
        """A KL term is on (in the loss or in the reward): the learner scores with the frozen reference."""
        return self.objective.needs_reference or self.kl_reward is not None

    def learner(self, preset_stages: Callable[[], list[Stage]]) -> Learner:
        """The learner, built once from :meth:`learner_stages` (on first use: a preset's own models, such as
        PPO's critic, exist by then)."""
        if self.built_learner is None:
            self.built_learner = Learner(self.learner_stages(preset_stages()), self.advantage, self.updater,
                                         self.seed)
        return self.built_learner

    def learner_stages(self, preset: list[Stage]) -> list[Stage]:
        """The learner's stages before the advantages, in order: the reference's log-probs, the behaviour
        log-probs, non-finite tokens out of the loss, the correction weights, ``preset`` (a preset's own
        stages), the KL in the reward."""
        rows = self.updater.micro_batch_size
        return [FrozenLogProbs(self.frozen, "reference", policy=self.policy, micro_batch_size=rows,
                               time_key="perf/reference_time"),
                BehaviourLogProbs(self.behaviour, engine=self.engine, policy=self.policy,
                                  updates_per_rollout=self.updater.updates_per_rollout, micro_batch_size=rows,
                                  read_later=self.reads_behaviour),
                ExcludeNonfinite(), self.correction, *preset,
                *([self.kl_reward] if self.kl_reward is not None else [])]

    def policy_loss(self) -> PolicyLoss:
        """The policy's loss with the objective, entropy bonus and correction held now."""
        return PolicyLoss(self.policy, self.objective, self.entropy_coef, self.correction,
                          self.updater.micro_rows)

    def sample(self, batch: dict[str, list], io: PolicyIO, data: Any, *, step: int, rank: int,
               collectives: Collectives, device: torch.device) -> tuple[Rollout, dict[str, float]]:
        """The sampler's half of trainer step ``step`` on ``batch``: the rollout and its statistics. ``data``:
        the DataModule, whose ``refill_batch`` refills what filters drop and whose ``record_outcomes`` (a
        curriculum) learns the prompts' pass rates, its numbers joining the statistics."""
        pools: dict[str, float] = {}
        record = getattr(data, "record_outcomes", None)
        report = None if record is None else lambda rates: pools.update(record(step, rates))
        refill = getattr(data, "refill_batch", None)
        rollout, stats = self.rollouts(batch, io, step=step, rank=rank, collectives=collectives,
                                       device=device, refill=refill, report=report)
        return rollout, {**stats, **pools}

    def start(self, device: torch.device) -> None:
        """Before fit's first step: no dropout (log-probs must match what sampling saw), prompt sharing and
        packing settled, the frozen models scored like the policy, the reward model on ``device``."""
        self.policy.disable_dropout()
        self.policy.share_prompts = prompt_sharing(self.share_prompt_prefix, self.policy.model)
        self.frozen.score_like(self.policy, self.policy.share_prompts, device)  # reference, teacher
        if self.policy.packing:
            self.policy.check_packing()  # every rank at once, before the first step
        if self.rewards.pipeline.reward_model is not None:
            self.rewards.pipeline.reward_model.to(device)
        filters = getattr(self.rollouts, "source", self.rollouts).filters
        if any(isinstance(f, DynamicSampling) for f in filters):
            rank_zero_info("dynamic sampling keeps the groups whose samples' outcomes differ; the outcome: "
                           f"{self.rewards.pipeline.outcome_name()}")

    def worker_spec(self, io: PolicyIO, device: torch.device) -> WorkerSpec:
        """What the worker sampling ahead is handed (``io``: ``completer.io()``, which attaches the engine and
        builds a ``CopyEngine``'s copy before the fork)."""
        return WorkerSpec(io=io, engine=self.engine, model=self.policy.model, frozen=self.frozen.all(),
                          micro_batch_size=self.updater.micro_batch_size, kind=self.rollouts.worker,
                          device=device)


class StepField:
    """A module attribute that is its online step's field of the same name (``module.online``), read and
    written there: ``module.updater`` is ``module.online.updater``, and setting one sets the other."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, module: Any, owner: type | None = None) -> Any:
        return self if module is None else getattr(module.online, self.name)

    def __set__(self, module: Any, value: Any) -> None:
        setattr(module.online, self.name, value)
