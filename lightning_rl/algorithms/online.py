"""The shared online RL step: one ``training_step`` = one RL iteration, composed of stages.

The sampler (``episodes.sampler``: engine, episodes, rewards) -> filters -> the learner's stages
(``step.learner``: log-prob passes, correction, PPO's values, the KL in the reward, advantages) -> the
updater -> statistics. Each stage is built from its option group (``algorithms.assembly``), returns a new
rollout and its numbers, which this module logs; none reaches into this module or the DataModule, and
callbacks only observe (``RLCallback``). Current, behaviour and reference log-probs are scored on the
tempered, unfiltered distribution (top-k / top-p belong to sampling only), so they share one support.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_rl.algorithms.assembly import (
    advantage_stage,
    episode_stage,
    filter_stages,
    objective_stages,
    reward_stages,
    update_stage,
)
from lightning_rl.algorithms.base import PolicyModule
from lightning_rl.algorithms.evaluation import Completions
from lightning_rl.algorithms.options import (
    EpisodeOptions,
    FilterOptions,
    LogProbOptions,
    ObjectiveOptions,
    PolicyOptions,
    RewardOptions,
    SamplingOptions,
    UpdateOptions,
    ValidationOptions,
)
from lightning_rl.algorithms.presets import ONLINE_MOVED_KEYS
from lightning_rl.algorithms.stepping import ManualSteps
from lightning_rl.episodes.sampler import PolicyIO, Sampler
from lightning_rl.models.generation import SamplingParams
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.correction import RolloutCorrection
from lightning_rl.step.engine import RolloutEngine
from lightning_rl.step.estimators import AdvantageEstimator
from lightning_rl.step.learner import prepare
from lightning_rl.step.logprobs import LogProbPasses, resolve_behaviour
from lightning_rl.step.rollout import Rollout, merge_stats
from lightning_rl.step.update import TrainedModel, policy_loss
from lightning_rl.text.prompts import render_prompts


class OnlineRL(ManualSteps, PolicyModule):
    """Online RL on prompts with verifiable or model-scored rewards (GRPO family; PPO adds a value model).

    Each argument is one group of options (``lightning_rl.algorithms.options``), a nested mapping in YAML
    (``model.init_args.sampling.temperature``); a preset changes the defaults of a few groups.

    Args:
        policy: the model, its dtype, adapters, prompt length and sharding.
        sampling: G, the token budget, temperature / top-p / top-k, prompt sharing, the seed.
        rewards: reward functions and weights, a reward model, overlong shaping, correctness, error policy.
        episodes: multi-turn episodes with an environment and / or tools (off unless one is set).
        objective: the policy loss (ratio level, trust region, aggregation, KL, entropy).
        advantage: the estimator (``class_path``, ``lightning_rl.step.estimators``); ``None``: the preset's
            (group z-score here).
        filters: dynamic sampling, overlong filtering and more rollout filters.
        logprobs: the behaviour log-probs' source and the rollout correction.
        update: epochs, minibatches, micro-batch size, gradient clipping.
        engine: what samples rollouts, validation and predictions (``class_path``; ``None``: ``HFEngine``).
        optimizer: the policy's optimiser factory (``class_path`` + ``init_args``); AdamW by default.
        lr_scheduler: the policy's LR scheduler factory, stepped once per optimiser step.
    """

    moved_keys: ClassVar[dict[str, str]] = ONLINE_MOVED_KEYS

    def __init__(
        self, policy: PolicyOptions = PolicyOptions(), sampling: SamplingOptions = SamplingOptions(),
        rewards: RewardOptions = RewardOptions(), episodes: EpisodeOptions = EpisodeOptions(),
        objective: ObjectiveOptions = ObjectiveOptions(), advantage: AdvantageEstimator | None = None,
        filters: FilterOptions = FilterOptions(), logprobs: LogProbOptions = LogProbOptions(),
        update: UpdateOptions = UpdateOptions(), engine: RolloutEngine | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW, lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        validation = ValidationOptions(sampling.max_new_tokens, rewards.accuracy_fn)
        super().__init__(policy, validation, engine, optimizer, lr_scheduler)
        self.automatic_optimization = False
        self.advantage = advantage_stage(advantage, sampling.num_generations)
        self.num_generations = sampling.num_generations
        self.sampling = self.sampling_params(sampling.temperature, sampling.top_p, sampling.top_k)
        self.objective, self.kl_reward = objective_stages(objective)
        self.updater = update_stage(update)
        self.episodes, self.prompt_tools = episode_stage(
            episodes, tokenizer=self.tokenizer, chat=self.chat_template, max_new_tokens=self.max_new_tokens,
            max_prompt_length=self.max_prompt_length, context=self.policy.context_length)
        budget = self.episodes.max_episode_tokens if self.episodes is not None else self.max_new_tokens
        stages = reward_stages(rewards, environment_only=episodes.environment is not None, budget=budget,
                               render=self.render_for_reward_model,
                               trust_remote_code=policy.trust_remote_code)
        self.rewards, self.reward_pipeline = stages.scorer, stages.pipeline
        self.accuracy_fn, self.accuracy_name = stages.accuracy_fn, stages.accuracy_name
        self.correctness_fn = stages.correctness_fn
        self.filters = filter_stages(filters)
        self.behaviour_logp = logprobs.behaviour
        self.correction = logprobs.correction if logprobs.correction is not None else RolloutCorrection()
        resolve_behaviour(logprobs.behaviour, self.updater.updates_per_rollout, self.engine)  # fails early
        self.entropy_coef = objective.entropy_coef
        self.share_prompt_prefix, self.rollout_seed = sampling.share_prompt_prefix, sampling.seed
        self.sampler = Sampler(self.num_generations, self.sampling, self.reward_pipeline, self.episodes,
                               filters.mask_truncated)
        # The reference: the policy as loaded (resuming too), frozen, out of checkpoints and optimisers; built
        # for fit only (`setup`), so validate and predict never hold a copy they do not use.
        self.needs_reference = self.objective.needs_reference or self.kl_reward is not None
        self.__dict__["_reference"] = None
        self._generation_round = 0

    def setup(self, stage: str) -> None:
        """``fit``: build the reference now, before Lightning loads a resumed checkpoint's trained weights."""
        super().setup(stage)
        if stage == "fit":
            self.reference_policy()

    def reference_policy(self) -> Any:
        """The frozen reference (``None`` when no KL term is on), built on first use."""
        if self._reference is None and self.needs_reference:
            self.__dict__["_reference"] = self.policy.reference()
        return self._reference

    def render_for_reward_model(self, prompts: list[Any]) -> tuple[list[str], bool]:
        texts = render_prompts(self.tokenizer, prompts, self.chat_template)
        return texts, all(self.add_special_tokens(prompts))

    # ---- the step ---------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        start, collectives = time.perf_counter(), Collectives(self.trainer)
        self._generation_round = 0
        self.attach_engine().sync_weights(self.policy)  # after the optimiser steps of the previous step
        sync_time = time.perf_counter() - start
        rollout, stats = self.sample(batch, collectives)
        for rollout_filter in self.filters:
            rollout, extra = rollout_filter(rollout, self.refill, collectives)
            stats = merge_stats(stats, extra)
        behaviour = resolve_behaviour(self.behaviour_logp if self.kl_reward is None else "recompute",
                                      self.updater.updates_per_rollout, self.engine)
        passes = LogProbPasses(behaviour, self.sampling.temperature, self.updater.micro_batch_size)
        rollout, extra = prepare(rollout, passes=passes, policy=self.policy,
                                 reference=self.reference_policy(), correction=self.correction,
                                 stages=[*self.before_advantages(), self.advantage], collectives=collectives)
        self.observe(rollout)
        update_start = time.perf_counter()
        step = self.trainer.fit_loop.total_batch_idx
        generator = torch.Generator().manual_seed(self.rollout_seed * 1_000_003 + step)
        trained, hooks = self.trained_models(), self.update_hooks()
        for metrics, share in self.updater.run(rollout, trained, hooks, collectives, generator):
            self.step_metrics.add(self.device, metrics, share)
        step_time = time.perf_counter() - start
        stats = merge_stats(merge_stats(stats, extra), {
            "perf/step_time": step_time, "perf/weight_sync_time": sync_time,
            "perf/update_time": time.perf_counter() - update_start,
            "perf/tokens_per_sec": stats["perf/generated_tokens"] / step_time})
        self.reward_pipeline.warn_if_slow(stats.get("perf/reward_time", 0.0), step_time)  # once per run
        self.end_step(stats)

    def policy_io(self) -> PolicyIO:
        """The sampler's handles on the policy, through the engine attached now."""
        engine = self.attach_engine()
        synced = bool(getattr(engine, "synced", False))
        return PolicyIO(self.encode_prompts, engine.generate, self.decode, synced)

    def sample(self, batch: dict[str, list], collectives: Collectives | None,
               decide: bool = True) -> tuple[Rollout, dict[str, float]]:
        """The sampler's rollout of ``batch``, seeded by (seed, step, round, rank): a resumed run samples
        the same (``decide``: the reward-failure limit, on the step's first round only)."""
        seed = hash((self.rollout_seed, self.trainer.fit_loop.total_batch_idx, self._generation_round,
                     self.global_rank)) % 2**31
        self._generation_round += 1
        return self.sampler(batch, self.policy_io(), seed=seed, collectives=collectives, decide=decide,
                            device=self.device)

    def complete(self, batch: dict[str, list], *, num_samples: int = 1, sampling: SamplingParams,
                 seed: int | None = None) -> Completions:
        """Validation and predict: whole episodes when the module has an environment or tools."""
        if self.episodes is None:
            return super().complete(batch, num_samples=num_samples, sampling=sampling, seed=seed)
        done = self.sampler.run_episodes(batch, self.policy_io(), num_samples=num_samples, sampling=sampling,
                                         seed=seed, collectives=Collectives(self._trainer))
        return Completions(done.texts, done.generation.lengths.tolist(), done.turns, done.returns.tolist())

    def refill(self) -> tuple[Rollout, dict[str, float]]:
        """A fresh prompt batch from the DataModule's refill stream, sampled and scored (for filters)."""
        refill_batch = getattr(self.trainer.datamodule, "refill_batch", None)
        if refill_batch is None:
            raise RuntimeError("dynamic sampling needs a DataModule with `refill_batch()` (PromptDataModule)")
        rollout, stats = self.sample(refill_batch(), Collectives(self.trainer), decide=False)
        for name in [k for k in stats if k.endswith("_mean") or k == "rollout/env_time"]:
            stats.pop(name)  # means: the first round's stand for the step
        return rollout, stats

    def before_advantages(self) -> list[Any]:
        """Stages ``(rollout, collectives) -> (rollout, stats)`` run before the advantage estimator."""
        return [self.kl_reward] if self.kl_reward is not None else []

    def trained_models(self) -> list[TrainedModel]:
        """What the updater trains: the policy (and the companions, for presets that have them)."""
        return [TrainedModel("policy", self.policy, self.optimizers(), self.policy_loss, ("policy/loss",))]

    def policy_loss(self, micro: Rollout, num_tokens: torch.Tensor,
                    num_seqs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return policy_loss(self.policy, micro, self.objective, self.entropy_coef, self.sampling.temperature,
                           num_tokens, num_seqs)

    def correct(self, prompts: list[Any], completions: list[str], columns: dict[str, list]) -> list[Any]:
        """Per-completion correctness by ``correctness_fn``: rollouts and ``val/accuracy`` alike."""
        return self.correctness_fn(prompts=prompts, completions=completions, **columns)

    def validation_extra(self, batch: dict[str, list], done: Completions, columns: dict[str, list],
                         weight: float) -> None:
        rewards, _ = self.reward_pipeline.score(batch["prompt"], done.texts, done.lengths, columns)
        self.log_val_mean("val/reward_mean", torch.tensor(done.with_returns(rewards.tolist())).mean(), weight)

