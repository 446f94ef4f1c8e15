"""The shared online RL step: one ``training_step`` = one RL iteration, composed of stages.

The module holds its online step (:class:`~lightning_rl.algorithms.online_step.OnlineStep`, built from the
option groups by ``algorithms.assembly.online_step``) and talks to it: the sampler's half
(``episodes.source``: engine or episodes, rewards, filters with their refills) -> the learner's stages, as
the preset declares them (``OnlineStep.learner_stages``: the frozen models' and the behaviour log-probs,
correction, the preset's own stages such as PPO's values, the KL in the reward; then the advantages;
``step.learner``) -> the updater, with the policy's loss (``step.policy_loss.PolicyLoss``) -> statistics.
Each stage returns a new rollout and its numbers, which the step's
:class:`~lightning_rl.algorithms.step_observer.StepObserver` logs; none reaches into this module or the
DataModule, and callbacks only observe (``RLCallback``). Current, behaviour and reference log-probs are
scored on the tempered, unfiltered distribution (top-k / top-p belong to sampling only), so they share one
support.

Manual optimisation: the updater decides what to accumulate and when to step, and the module hands it
:class:`~lightning_rl.algorithms.optimiser_steps.OptimiserSteps` (the strategy's gradient sync, clipping and
stepping) for the policy and any companion (a model trained beside it with its own optimiser, such as PPO's
value model). What its checkpoints carry beyond the base's is its ``CheckpointState``'s (the adaptive KL,
the rollouts sampled ahead).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_rl.algorithms import assembly
from lightning_rl.algorithms.ahead import start_worker
from lightning_rl.algorithms.base import PolicyModule
from lightning_rl.algorithms.checkpoint_state import CheckpointState
from lightning_rl.algorithms.learner_options import (
    FilterOptions,
    LogProbOptions,
    ObjectiveOptions,
    UpdateOptions,
)
from lightning_rl.algorithms.online_step import StepField
from lightning_rl.algorithms.optimiser_steps import OptimiserSteps
from lightning_rl.algorithms.options import PolicyOptions, ValidationOptions
from lightning_rl.algorithms.presets import ONLINE_MOVED_KEYS
from lightning_rl.algorithms.sampler_options import EpisodeOptions, RewardOptions, SamplingOptions
from lightning_rl.algorithms.step_observer import StepObserver
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.engine import RolloutEngine
from lightning_rl.step.estimators import AdvantageEstimator
from lightning_rl.step.learner import Stage
from lightning_rl.step.metrics import StepClock, StepMetrics
from lightning_rl.step.rollout import Rollout, merge_stats
from lightning_rl.step.update import TrainedModel, UpdateHooks


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
    # the online step's fields that presets, callbacks, the base and tests read (and set) on the module
    sampling, num_generations, episodes, rollouts = (StepField() for _ in range(4))
    updater, frozen, objective = (StepField() for _ in range(3))

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
        self.compact_sampling = sampling.share_prompt_prefix  # the engine may use the compacting sampler
        self.policy.logprob_chunk, self.policy.packing = update.logprob_chunk, update.packing
        self.online = assembly.online_step(
            self.policy, self.codec, self.engine, sampling=sampling, rewards=rewards, episodes=episodes,
            objective=objective, advantage=advantage, filters=filters, logprobs=logprobs, update=update,
            reads_behaviour=self.reads_behaviour, trust_remote_code=policy.trust_remote_code)
        stages = self.online.rewards  # what validation, predictions and the input checks read
        self.reward_pipeline, self.correctness_fn = stages.pipeline, stages.correctness_fn
        self.accuracy_fn, self.accuracy_name = stages.accuracy_fn, stages.accuracy_name
        self.reference_stages = ("fit",) if self.online.needs_reference else ()  # validate / predict: none
        self.step_metrics = StepMetrics()  # the step's numbers, logged at its end

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
        """The base's checks, then the online step's settling (``OnlineStep.start``)."""
        super().on_fit_start()
        self.online.start(self.device)

    def on_train_start(self) -> None:
        super().on_train_start()  # after a resumed checkpoint's weights and RNG: the worker starts from them
        if self.rollouts.max_staleness:
            spec = self.online.worker_spec(self.completer.io(), self.device)
            start_worker(spec, self.rollouts, self.trainer)

    def teardown(self, stage: str) -> None:
        self.rollouts.close()  # a worker sampling ahead stops with the run, however it ends
        super().teardown(stage)

    def checkpoint_state(self) -> CheckpointState:
        """The base's, with the adaptive KL coefficient and the rollouts sampled ahead."""
        return CheckpointState(self.policy.model, self.online.kl_reward, self.rollouts)

    def optimiser_steps(self) -> OptimiserSteps:
        return OptimiserSteps(self, self.step_metrics, self.updater.max_grad_norm, self.companions())

    def update_hooks(self) -> UpdateHooks:
        return self.optimiser_steps().hooks()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.optimiser_steps().clip(optimizer)

    # ---- the step ---------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int) -> None:
        clock, collectives = StepClock(), Collectives(self.trainer)
        step, observer = self.trainer.fit_loop.total_batch_idx, StepObserver(self, self.step_metrics)
        if self.rollouts.max_staleness:  # to the worker sampling ahead, as version `step`; the module's own
            self.rollouts.publish(step, self.policy.model)  # engine serves validation (synced there)
        else:  # after the optimiser steps of the previous step
            self.completer.sync()
        clock.synced()
        rollout, stats = self.online.sample(batch, self.completer.io(), self.trainer.datamodule, step=step,
                                            rank=self.global_rank, device=self.device,
                                            collectives=collectives)
        learner = self.online.learner(self.preset_stages)
        rollout, extra = learner.prepare(rollout, collectives)
        observer.rollout(rollout)
        clock.updating()
        for metrics, share in learner.update(rollout, self.trained_models(), self.update_hooks(), collectives,
                                             step):
            observer.update(metrics, share)
        stats = merge_stats(merge_stats(stats, extra), clock.stats(stats["perf/generated_tokens"]))
        self.reward_pipeline.warn_if_slow(stats.get("perf/reward_time", 0.0), stats["perf/step_time"])  # once
        observer.end(stats)

    def trained_models(self) -> list[TrainedModel]:
        """What the updater trains: the policy (and the companions, for presets that have them)."""
        return [self.online.policy_loss().trained(self.optimizers(), self.policy_loss)]

    def select_tokens(self, minibatch: Rollout, collectives: Collectives, seed: int) -> Rollout:
        """The objective's whole-minibatch token selection (``PolicyLoss.select``)."""
        return self.online.policy_loss().select(minibatch, collectives, seed)

    def policy_loss(self, micro: Rollout, num_tokens: torch.Tensor,
                    num_seqs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """A micro-batch's policy loss (``step.policy_loss.PolicyLoss``), with the objective held now."""
        return self.online.policy_loss()(micro, num_tokens, num_seqs)
