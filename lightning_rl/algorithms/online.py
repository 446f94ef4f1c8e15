"""The shared online RL step: one ``training_step`` = one RL iteration, composed of stages.

The sampler's half (``episodes.source``: engine or episodes, rewards, filters with their refills) -> the
learner's stages, as the preset declares them (``learner_stages``: the frozen models' and the behaviour
log-probs, correction, the preset's own stages such as PPO's values, the KL in the reward; then the
advantages; ``step.learner``) -> the updater -> statistics. Each stage is built from its option
group (``algorithms.assembly``), returns a new rollout and its numbers, which this module logs; none reaches
into this module or the DataModule, and callbacks only observe (``RLCallback``). Current, behaviour and
reference log-probs are scored on the tempered, unfiltered distribution (top-k / top-p belong to sampling
only), so they share one support.

Manual optimisation: the updater decides what to accumulate and when to step, and the module hands it
:class:`~lightning_rl.algorithms.optimiser_steps.OptimiserSteps` (the strategy's gradient sync, clipping and
stepping) for the policy and any companion (a model trained beside it with its own optimiser, such as PPO's
value model). What its checkpoints carry beyond the base's is its ``CheckpointState``'s (the adaptive KL,
the rollouts sampled ahead).
"""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info

from lightning_rl.algorithms import assembly
from lightning_rl.algorithms.ahead import WorkerSpec, start_worker
from lightning_rl.algorithms.base import PolicyModule
from lightning_rl.algorithms.checkpoint_state import CheckpointState
from lightning_rl.algorithms.optimiser_steps import OptimiserSteps
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
from lightning_rl.episodes.sampler import Sampler
from lightning_rl.models.frozen import FrozenModels
from lightning_rl.models.sharding import prompt_sharing
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.correction import RolloutCorrection
from lightning_rl.step.engine import RolloutEngine
from lightning_rl.step.estimators import AdvantageEstimator
from lightning_rl.step.filters import DynamicSampling
from lightning_rl.step.learner import Learner, Stage
from lightning_rl.step.logprobs import BehaviourLogProbs, ExcludeNonfinite, FrozenLogProbs, resolve_behaviour
from lightning_rl.step.metrics import StepMetrics
from lightning_rl.step.rollout import Rollout, merge_stats, rollout_stats
from lightning_rl.step.selection import select_tokens
from lightning_rl.step.update import TrainedModel, UpdateHooks, micro_batch_policy_loss, policy_rows


class OnlineRL(PolicyModule):
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
    reads_behaviour: ClassVar[bool] = False  # a stage reads the sampling policy's log-probs (distillation)

    def __init__(
        self, policy: PolicyOptions = PolicyOptions(), sampling: SamplingOptions = SamplingOptions(),
        rewards: RewardOptions = RewardOptions(), episodes: EpisodeOptions = EpisodeOptions(),
        objective: ObjectiveOptions = ObjectiveOptions(), advantage: AdvantageEstimator | None = None,
        filters: FilterOptions = FilterOptions(), logprobs: LogProbOptions = LogProbOptions(),
        update: UpdateOptions = UpdateOptions(), engine: RolloutEngine | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW, lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__(policy, ValidationOptions(sampling.max_new_tokens, rewards.accuracy_fn), engine,
                         optimizer, lr_scheduler)
        self.automatic_optimization = False
        self.num_generations = sampling.num_generations
        self.share_prompt_prefix = self.compact_sampling = sampling.share_prompt_prefix
        self.sampling = self.sampling_params(sampling.temperature, sampling.top_p, sampling.top_k)
        self.advantage = assembly.advantage_stage(advantage, sampling.num_generations)
        self.entropy_coef = objective.entropy_coef
        self.episodes, self.codec.tools = assembly.episode_stage(
            episodes, tokenizer=self.tokenizer, chat=self.codec.chat_template,
            max_new_tokens=self.max_new_tokens, max_prompt_length=self.codec.max_prompt_length,
            context=self.policy.context_length)
        budget = self.episodes.max_episode_tokens if self.episodes is not None else self.max_new_tokens
        self.objective, self.kl_reward = assembly.objective_stages(objective, default_length=budget)
        stages = assembly.reward_stages(rewards, environment_only=episodes.environment is not None,
                                        budget=budget, render=self.codec.render_for_reward_model,
                                        trust_remote_code=policy.trust_remote_code,
                                        decouple_eps=self.advantage.decouple_eps)
        self.reward_pipeline, self.correctness_fn = stages.pipeline, stages.correctness_fn
        self.accuracy_fn, self.accuracy_name = stages.accuracy_fn, stages.accuracy_name
        self.updater = assembly.update_stage(update)
        self.policy.logprob_chunk, self.policy.packing = update.logprob_chunk, update.packing
        self.set_behaviour(logprobs, ahead=sampling.max_staleness > 0)
        self.seed = sampling.seed
        self.sampler = Sampler(self.num_generations, self.sampling, self.reward_pipeline, self.episodes,
                               filters.mask_truncated)
        self.rollouts = assembly.rollout_source(self.sampler, filters, sampling)
        self.needs_reference = self.objective.needs_reference or self.kl_reward is not None
        self.reference_stages = ("fit",) if self.needs_reference else ()  # validate / predict hold no copy
        self.frozen = FrozenModels()  # out of the module tree: never in checkpoints or optimisers
        if self.needs_reference:
            self.frozen.declare("reference", self.policy.reference)
        self._learner: Learner | None = None
        self.step_metrics = StepMetrics()  # the step's numbers, logged at its end

    def set_behaviour(self, logprobs: LogProbOptions, *, ahead: bool) -> None:
        """Where the behaviour log-probs come from (checked against the engine now, so a wrong choice fails
        before training) and the correction; the engine told what it must keep."""
        if ahead:  # the worker's weights are k steps old: its log-probs are the behaviour's
            self.engine.sample_ahead()
        if self.reads_behaviour:
            self.engine.keep_logprobs()  # else the learner's behaviour pass scores them
        self.behaviour = behaviour_source(logprobs.behaviour, kl_in_reward=self.kl_reward is not None)
        resolve_behaviour(self.behaviour, self.updater.updates_per_rollout, self.engine)
        self.correction = logprobs.correction if logprobs.correction is not None else RolloutCorrection()

    @property
    def learner(self) -> Learner:
        """The learner, built once from the declared stages (on first use: a preset's own models, such as
        PPO's critic, exist by then)."""
        if self._learner is None:
            self._learner = Learner(self.learner_stages(), self.advantage, self.updater, self.seed)
        return self._learner

    def learner_stages(self) -> list[Stage]:
        """The learner's stages before the advantages, in order: the reference's log-probs, the behaviour
        log-probs, non-finite tokens out of the loss, the correction weights, the preset's own stages
        (:meth:`preset_stages`), the KL in the reward."""
        rows = self.updater.micro_batch_size
        return [FrozenLogProbs(self.frozen, "reference", policy=self.policy, micro_batch_size=rows,
                               time_key="perf/reference_time"),
                BehaviourLogProbs(self.behaviour, engine=self.engine, policy=self.policy,
                                  updates_per_rollout=self.updater.updates_per_rollout, micro_batch_size=rows,
                                  read_later=self.reads_behaviour),
                ExcludeNonfinite(), self.correction, *self.preset_stages(),
                *([self.kl_reward] if self.kl_reward is not None else [])]

    def preset_stages(self) -> list[Stage]:
        """A preset's own stages, after the correction and before the KL in the reward (PPO: its critic's
        values; distillation: the teacher's log-probs); none here."""
        return []

    def reference_policy(self) -> Any:
        """The frozen reference (``None`` when no KL term is on), built on first use: the policy as loaded,
        out of checkpoints and optimisers."""
        return self.frozen.get("reference")

    # ---- Lightning hooks: fit, the worker, checkpoints, clipping ---------------------------------------
    def deepspeed_defaults(self) -> dict[str, Any]:
        """Under DeepSpeed the engine clips (after unscaling, on its partitions): ``max_grad_norm`` goes
        there."""
        return {**super().deepspeed_defaults(), "gradient_clipping": self.updater.max_grad_norm or 0.0}

    def on_fit_start(self) -> None:
        """The base's checks, then: no dropout (log-probs must match what sampling saw), prompt sharing and
        packing settled, the frozen models scored like the policy, the reward model on this device."""
        super().on_fit_start()
        self.policy.disable_dropout()
        self.policy.share_prompts = prompt_sharing(self.share_prompt_prefix, self.policy.model)
        self.frozen.score_like(self.policy, self.policy.share_prompts, self.device)  # reference, teacher
        if self.policy.packing:
            self.policy.check_packing()  # every rank at once, before the first step
        if self.reward_pipeline.reward_model is not None:
            self.reward_pipeline.reward_model.to(self.device)
        filters = getattr(self.rollouts, "source", self.rollouts).filters
        if any(isinstance(f, DynamicSampling) for f in filters):
            rank_zero_info("dynamic sampling keeps the groups whose samples' outcomes differ; the outcome: "
                           f"{self.reward_pipeline.outcome_name()}")

    def on_train_start(self) -> None:
        super().on_train_start()  # after a resumed checkpoint's weights and RNG: the worker starts from them
        if self.rollouts.max_staleness:
            start_worker(self.worker_spec(), self.rollouts, self.trainer)

    def worker_spec(self) -> WorkerSpec:
        """What the worker sampling ahead is handed (``completer.io()`` attaches the engine and builds a
        ``CopyEngine``'s copy before the fork)."""
        return WorkerSpec(io=self.completer.io(), engine=self.engine, model=self.policy.model,
                          frozen=self.frozen.all(), micro_batch_size=self.updater.micro_batch_size,
                          kind=self.rollouts.worker, device=self.device)

    def teardown(self, stage: str) -> None:
        self.rollouts.close()  # a worker sampling ahead stops with the run, however it ends
        super().teardown(stage)

    def checkpoint_state(self) -> CheckpointState:
        """The base's, with the adaptive KL coefficient and the rollouts sampled ahead."""
        return CheckpointState(self.policy.model, self.kl_reward, self.rollouts)

    def optimiser_steps(self) -> OptimiserSteps:
        return OptimiserSteps(self, self.step_metrics, self.updater.max_grad_norm, self.companions())

    def update_hooks(self) -> UpdateHooks:
        return self.optimiser_steps().hooks()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.optimiser_steps().clip(optimizer)

    # ---- the step ---------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        start, collectives = time.perf_counter(), Collectives(self.trainer)
        step = self.trainer.fit_loop.total_batch_idx
        if self.rollouts.max_staleness:  # to the worker sampling ahead, as version `step`; the module's own
            self.rollouts.publish(step, self.policy.model)  # engine serves validation (synced there)
        else:  # after the optimiser steps of the previous step
            self.completer.sync()
        sync_time = time.perf_counter() - start
        data, pools = self.trainer.datamodule, {}
        record = getattr(data, "record_outcomes", None)  # a curriculum learns from the prompts' pass rates
        report = None if record is None else lambda rates: pools.update(record(step, rates))
        rollout, stats = self.rollouts(batch, self.completer.io(), step=step, rank=self.global_rank,
                                       collectives=collectives, device=self.device,
                                       refill=getattr(data, "refill_batch", None), report=report)
        stats = {**stats, **pools}
        rollout, extra = self.learner.prepare(rollout, collectives)
        self.observe(rollout)
        update_start = time.perf_counter()
        for metrics, share in self.learner.update(rollout, self.trained_models(), self.update_hooks(),
                                                  collectives, step):
            self.step_metrics.add(self.device, metrics, share)
        step_time = time.perf_counter() - start
        stats = merge_stats(merge_stats(stats, extra), {
            "perf/step_time": step_time, "perf/weight_sync_time": sync_time,
            "perf/update_time": time.perf_counter() - update_start,
            "perf/tokens_per_sec": stats["perf/generated_tokens"] / step_time})
        self.reward_pipeline.warn_if_slow(stats.get("perf/reward_time", 0.0), step_time)  # once per run
        self.end_step(stats)

    def trained_models(self) -> list[TrainedModel]:
        """What the updater trains: the policy (and the companions, for presets that have them)."""
        return [TrainedModel("policy", self.policy, self.optimizers(), self.policy_loss, ("policy/loss",),
                             reaches=self.policy_rows, select=self.select_tokens, packed=self.policy.packing)]

    def select_tokens(self, minibatch: Rollout, collectives: Collectives, seed: int) -> Rollout:
        """The objective's whole-minibatch token selection (entropy, Clip-Cov, KL-Cov), before the
        micro-batches (``lightning_rl.step.selection``)."""
        return select_tokens(self.policy, minibatch, self.objective, self.updater.micro_rows, collectives,
                             seed)

    def policy_rows(self, micro: Rollout) -> torch.Tensor:
        return policy_rows(micro, self.objective.kl_coef, self.entropy_coef)

    def policy_loss(self, micro: Rollout, num_tokens: torch.Tensor,
                    num_seqs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return micro_batch_policy_loss(self.policy, micro, self.objective, self.entropy_coef, num_tokens,
                                       num_seqs, self.correction)

    # ---- observing: stages return numbers, this module logs them, callbacks read them ----------
    def observe(self, rollout: Rollout) -> None:
        if len(rollout):
            for name, (value, weight) in rollout_stats(rollout).items():
                self.step_metrics.add(self.device, {name: value}, weight)
        for cb in self.rl_callbacks():
            cb.on_rollout_end(self.trainer, self, rollout)

    def end_step(self, stats: dict[str, float]) -> None:
        self.step_metrics.add_stats(self.device, stats)
        self.step_metrics.log(self.device, lambda name, value: self.log(
            name, value, on_step=True, on_epoch=False, batch_size=1, prog_bar=name == "rollout/reward_mean"))
        for cb in self.rl_callbacks():
            cb.on_step_end(self.trainer, self, MappingProxyType(stats))

    def rl_callbacks(self) -> list:
        from lightning_rl.callbacks.base import RLCallback

        return [cb for cb in self.trainer.callbacks if isinstance(cb, RLCallback)]


def behaviour_source(behaviour: str, *, kl_in_reward: bool) -> str:
    """The behaviour source the learner uses: ``model.logprobs.behaviour``, or ``recompute`` when the KL is in
    the reward (its penalty needs the trained policy's own log-probs of the rollout). An explicit other
    source is refused rather than overridden."""
    if not kl_in_reward or behaviour in ("auto", "recompute"):
        return "recompute" if kl_in_reward else behaviour
    raise ValueError(f"`model.objective.kl_in_reward: true` scores the behaviour log-probs with the trained "
                     f"policy (`recompute`), which `model.logprobs.behaviour: {behaviour}` contradicts: "
                     "leave `model.logprobs.behaviour` at auto or recompute")
