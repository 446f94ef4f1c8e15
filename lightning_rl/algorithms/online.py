"""The shared online RL step: one ``training_step`` = one RL iteration, composed of stages.

engine.generate -> rewards -> filters -> log-prob passes (reference, behaviour) -> values (with a critic)
-> KL in the reward (optional) -> advantages (once, after filtering) -> updater -> statistics. Each stage
is a small typed class (``lightning_rl.step.engine``, ``rewards``, ``filters``, ``logprobs``, ``estimators``,
``update``) chosen in YAML; none reaches into this module or the DataModule, and every one returns its
numbers, which this module logs. Callbacks only observe (``RLCallback``).

Scoring: top-k / top-p belong to sampling only. Current, behaviour and reference log-probs are scored on
the tempered, unfiltered distribution, so they share one support; a token whose behaviour or reference
log-prob is still not finite leaves the loss (``loss_mask``), not the context (``attention_mask``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

import torch

from lightning_rl.algorithms.base import PolicyModule
from lightning_rl.algorithms.evaluation import Completions
from lightning_rl.algorithms.stepping import ManualSteps
from lightning_rl.episodes.environments import Environment, EpisodeBatch, episode_runner
from lightning_rl.episodes.tools import HermesFormat
from lightning_rl.maths.advantages import KLEstimator
from lightning_rl.maths.aggregation import Aggregation, aggregate, masked_mean
from lightning_rl.maths.objective import Objective
from lightning_rl.maths.ratio_levels import RatioLevel
from lightning_rl.maths.trust_regions import TrustRegion
from lightning_rl.models.generation import SamplingParams
from lightning_rl.models.reward_model import RewardModelScorer
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.correction import RolloutCorrection
from lightning_rl.step.engine import RolloutEngine
from lightning_rl.step.estimators import AdvantageEstimator, GroupNormalized, KLInReward
from lightning_rl.step.filters import DynamicSampling, RolloutFilter
from lightning_rl.step.logprobs import BehaviourSource, LogProbPasses, resolve_behaviour, score_values
from lightning_rl.step.rewards import FullScore, RewardPipeline, RewardScorer, import_reward, overlong_shaping
from lightning_rl.step.rollout import Rollout, exclude_nonfinite, merge_stats
from lightning_rl.step.update import TrainedModel, Updater
from lightning_rl.text.prompts import batch_columns, render_prompts


class OnlineRL(ManualSteps, PolicyModule):
    """Online RL on prompts with verifiable or model-scored rewards (GRPO family; PPO adds a critic).

    Args:
        num_generations: samples per prompt (G), at least the estimator's ``min_group_size``.
        temperature, top_p, top_k: sampling; log-probs are scored at ``temperature``, unfiltered.
        engine: the rollout engine (``class_path``); default ``lightning_rl.step.engine.HFEngine``.
        reward_fns, reward_weights: reward functions by import path and their weights (default
            ``exact_match``, or none with a ``reward_model``).
        reward_model, reward_model_weight: a one-label sequence-classification folder whose weighted score
            of the rendered prompt + completion is added (kept out of checkpoints and optimisers).
        correctness_fn: decides ``rollout.correct`` (filters, ``rollout/correct_frac``); ``None`` uses
            ``accuracy_fn``, which when unset follows the main reward function (the first of the largest
            weight): a sample is correct where it scores 1.0 or more. Validation, DAPO's filter and predict
            then agree with the reward.
        on_reward_error: ``raise`` stops on a reward function error or NaN; ``zero`` scores it 0, counts it
            in ``rollout/reward_errors`` and warns, naming the function and its last error.
        max_reward_error_frac: with ``on_reward_error: zero``, stop the run when more than this fraction (in
            [0, 1]) of a step's samples, counted over all ranks, had a failed reward.
        overlong_buffer: DAPO's soft overlong punishment over the last this-many tokens of ``max_new_tokens``
            (``advantages.overlong_penalty``): ``None`` (default here) or 0: off; ``auto``: a fifth of
            ``max_new_tokens``, at least 1. Logged as ``rollout/overlong_penalty_mean``.
        overlong_penalty_factor: weight of the overlong penalty added to the reward.
        mask_truncated: leave completions that hit ``max_new_tokens`` out of the loss.
        dynamic_sampling, max_gen_batches: DAPO's filter (``lightning_rl.step.filters.DynamicSampling``).
        filters: more rollout filters (``class_path``), applied after dynamic sampling.
        advantage: the estimator (``class_path``, ``lightning_rl.step.estimators``); default group z-score.
        behaviour_logp: ``auto``, ``recompute``, ``from_engine`` or ``on_policy``
            (``lightning_rl.step.logprobs``).
        rollout_correction: importance weights for an engine that is not the trained module
            (``lightning_rl.step.correction.RolloutCorrection``; default token-level, truncated at 2.0).
        ppo_epochs, num_minibatches, micro_batch_size, max_grad_norm: the updater
            (``lightning_rl.step.update``).
        ratio_level, trust_region, clip_low, clip_high, clip_ratio_c, tau_pos, tau_neg, aggregation,
            kl_coef, kl_estimator: the objective axes, see :class:`lightning_rl.maths.objective.Objective`.
        kl_clamp: the per-token KL term in the loss is clamped to ``[-kl_clamp, kl_clamp]`` (``null``, the
            default: off; verl clamps its low-variance KL at 10); ``policy/kl_clamp_frac`` says how often it
            bites, ``policy/kl_ref_max`` the largest per-token KL (logged whenever a reference is scored).
        kl_in_reward, kl_target, kl_horizon: the KL to the reference as a per-token reward penalty
            (``kl_coef``, ``kl_estimator``) instead of the loss term, optionally adaptive
            (``lightning_rl.step.estimators.KLInReward``).
        entropy_coef: weight of an entropy bonus aggregated like the loss (0: off; always logged).
        share_prompt_prefix: run each distinct prompt once in sampling and scoring (same numbers; off
            under FSDP2 / ZeRO-3, and for scoring under gradient checkpointing).
        rollout_seed: sampling is seeded by (this, step, round, rank): a resumed run samples the same.
        environment: multi-turn episodes (``lightning_rl.episodes.environments.Environment`` as
            ``class_path``): the
            environment answers each model turn without a tool call; its step and final rewards are added to
            the reward functions' (``reward_fns: []`` for the environment's alone).
        tools: callables the model may call (``package.module:function``; ``lightning_rl.episodes.tools``),
            their
            schemas rendered by the chat template where it supports tools; with tools or an environment
            every rollout, validation and prediction is an episode (``lightning_rl.episodes.environments``).
        max_turns: model turns per episode; ``max_new_tokens`` is then the budget of one turn.
        max_episode_tokens: tokens after the prompt (model and observation tokens) per episode; an episode
            that would pass it ends ``truncated``. ``None``: ``max_turns * max_new_tokens``.
        tool_format: ``auto`` (Hermes ``<tool_call>`` JSON through a chat template that supports tools, else
            the plain ``<tool>name(args)</tool>`` format), ``hermes`` or ``plain``
            (``lightning_rl.episodes.tools``).
        tool_timeout: seconds a tool call may take; a slower call answers an error observation.
        on_env_error: ``raise`` stops on an environment exception, naming it and the episode; ``zero`` ends
            the episode with return 0 and counts it in ``rollout/env_errors``.
        **kwargs: see :class:`~lightning_rl.algorithms.base.PolicyModule`.
    """

    def __init__(
        self, *args: Any, num_generations: int = 8, temperature: float = 1.0, top_p: float = 1.0,
        top_k: int = 0, engine: RolloutEngine | None = None, reward_fns: list[str] | None = None,
        reward_weights: list[float] | None = None, reward_model: str | None = None,
        reward_model_weight: float = 1.0, correctness_fn: str | None = None,
        on_reward_error: Literal["raise", "zero"] = "raise", max_reward_error_frac: float = 0.5,
        overlong_buffer: int | Literal["auto"] | None = None, overlong_penalty_factor: float = 1.0,
        mask_truncated: bool = False, dynamic_sampling: bool = False, max_gen_batches: int = 3,
        filters: list[RolloutFilter] | None = None, advantage: AdvantageEstimator | None = None,
        behaviour_logp: BehaviourSource = "auto", rollout_correction: RolloutCorrection | None = None,
        ppo_epochs: int = 1, num_minibatches: int = 1, micro_batch_size: int | None = None,
        max_grad_norm: float | None = 1.0, ratio_level: RatioLevel = "token",
        trust_region: TrustRegion = "clip", clip_low: float = 0.2, clip_high: float = 0.2,
        clip_ratio_c: float | None = None, tau_pos: float = 1.0, tau_neg: float = 1.05,
        aggregation: Aggregation = "seq-mean-token-mean", kl_coef: float = 0.0,
        kl_estimator: KLEstimator = "k3", kl_clamp: float | None = None, kl_in_reward: bool = False,
        kl_target: float | None = None, kl_horizon: int = 10000, entropy_coef: float = 0.0,
        share_prompt_prefix: bool = True,
        rollout_seed: int = 0, environment: Environment | None = None, tools: list[str] | None = None,
        max_turns: int = 4, max_episode_tokens: int | None = None,
        tool_format: Literal["auto", "hermes", "plain"] = "auto", tool_timeout: float = 10.0,
        on_env_error: Literal["raise", "zero"] = "raise", **kwargs: Any,
    ) -> None:
        super().__init__(*args, engine=engine, **kwargs)
        self.automatic_optimization = False
        self.advantage = advantage if advantage is not None else GroupNormalized()
        check_keys(num_generations, self.advantage, entropy_coef, temperature, kl_in_reward, kl_coef,
                   kl_target, kl_horizon)
        self.num_generations, self.sampling = num_generations, self.sampling_params(temperature, top_p, top_k)
        self.init_objective(ratio_level, trust_region, clip_low, clip_high, clip_ratio_c, tau_pos, tau_neg,
                            aggregation, kl_coef, kl_estimator, kl_clamp, kl_in_reward, kl_target, kl_horizon)
        self.updater = Updater(ppo_epochs, num_minibatches, micro_batch_size, max_grad_norm)
        self.init_episodes(environment, tools, max_turns, max_episode_tokens, tool_format, tool_timeout,
                           on_env_error)
        self.init_rewards(reward_fns, reward_weights, reward_model, correctness_fn, on_reward_error,
                          max_reward_error_frac, kwargs.get("accuracy_fn"), environment)
        remote = kwargs.get("trust_remote_code", False)
        self.reward_pipeline = self.reward_stage(reward_model, reward_model_weight, overlong_buffer,
                                                 overlong_penalty_factor, remote)
        self.filters = ([DynamicSampling(max_gen_batches)] if dynamic_sampling else []) + list(filters or [])
        self.behaviour_logp = behaviour_logp
        self.correction = rollout_correction if rollout_correction is not None else RolloutCorrection()
        resolve_behaviour(behaviour_logp, self.updater.updates_per_rollout, self.engine)  # fails early
        self.mask_truncated, self.entropy_coef = mask_truncated, entropy_coef
        self.share_prompt_prefix, self.rollout_seed = share_prompt_prefix, rollout_seed
        self.critic: Any = None  # PPO's value model: a second trained model
        # The reference: the policy as loaded (resuming too), frozen, out of checkpoints and optimisers; built
        # for fit only (`setup`), so validate and predict never hold a copy they do not use.
        self.needs_reference = self.objective.needs_reference or self.kl_reward is not None
        self.__dict__["_reference"] = None
        self._generation_round = 0

    def init_objective(
        self, ratio_level: RatioLevel, trust_region: TrustRegion, clip_low: float, clip_high: float,
        clip_ratio_c: float | None, tau_pos: float, tau_neg: float, aggregation: Aggregation, kl_coef: float,
        kl_estimator: KLEstimator, kl_clamp: float | None, kl_in_reward: bool, kl_target: float | None,
        kl_horizon: int,
    ) -> None:
        """``objective`` (the loss; its KL term off when the KL is in the reward) and ``kl_reward`` (the
        KL-in-reward penalty: ``None`` unless ``kl_in_reward`` with ``kl_coef`` > 0)."""
        self.objective = Objective(  # with the KL in the reward, not in the loss
            ratio_level=ratio_level, trust_region=trust_region, clip_low=clip_low, clip_high=clip_high,
            clip_ratio_c=clip_ratio_c, tau_pos=tau_pos, tau_neg=tau_neg, aggregation=aggregation,
            kl_coef=0.0 if kl_in_reward else kl_coef, kl_estimator=kl_estimator, kl_clamp=kl_clamp)
        in_reward = kl_in_reward and kl_coef > 0
        self.kl_reward = KLInReward(kl_coef, kl_estimator, kl_target, kl_horizon) if in_reward else None

    def init_episodes(
        self, environment: Environment | None, tools: list[str] | None, max_turns: int,
        max_episode_tokens: int | None, tool_format: Literal["auto", "hermes", "plain"], tool_timeout: float,
        on_env_error: Literal["raise", "zero"],
    ) -> None:
        """``episodes`` (``None`` without an environment or tools) and, for the Hermes tool format, the tool
        schemas the chat template renders into prompts (``prompt_tools``)."""
        self.episodes = episode_runner(
            environment, tools, tokenizer=self.tokenizer, chat=self.chat_template, max_turns=max_turns,
            max_new_tokens=self.max_new_tokens, max_episode_tokens=max_episode_tokens,
            max_prompt_length=self.max_prompt_length, context=self.policy.context_length,
            tool_format=tool_format, tool_timeout=tool_timeout, on_env_error=on_env_error)
        if self.episodes is not None and isinstance(self.episodes.format, HermesFormat):
            self.prompt_tools = [t.schema for t in self.episodes.tools.values()] or None

    def init_rewards(
        self, reward_fns: list[str] | None, reward_weights: list[float] | None, reward_model: str | None,
        correctness_fn: str | None, on_reward_error: Literal["raise", "zero"], max_reward_error_frac: float,
        accuracy_fn: str | None, environment: Environment | None,
    ) -> None:
        """``rewards`` (the reward functions' scorer; ``None`` for a reward model's or an environment's
        rewards alone) and ``correctness_fn``; an unset ``accuracy_fn`` follows the main reward function."""
        default = None if reward_model else ["lightning_rl.step.rewards:exact_match"]
        functions = reward_fns if reward_fns is not None else default
        if functions == [] and self.episodes is not None and environment is not None:
            functions = None  # the environment's rewards alone
        self.rewards = RewardScorer(functions, reward_weights, on_reward_error, max_reward_error_frac) \
            if functions is not None else None
        if accuracy_fn is None and self.rewards is not None:  # follow the main reward function
            self.accuracy_fn = main_reward(self.rewards)
            self.accuracy_name = repr(self.accuracy_fn)
        self.correctness_fn = import_reward(correctness_fn) if correctness_fn else self.accuracy_fn

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

    def reward_stage(self, reward_model: str | None, weight: float, overlong_buffer: int | str | None,
                     overlong_factor: float, trust_remote_code: bool) -> RewardPipeline:
        """The rewards stage over ``self.rewards`` and ``self.correctness_fn``; a reward model is a plain
        object (never checkpointed or optimised)."""
        scorer = None
        if reward_model:
            scorer = RewardModelScorer(reward_model, trust_remote_code=trust_remote_code)
        budget = self.episodes.max_episode_tokens if self.episodes is not None else self.max_new_tokens
        overlong = overlong_shaping(overlong_buffer, overlong_factor, budget)
        return RewardPipeline(self.rewards, self.correctness_fn, reward_model=scorer,
                              reward_model_weight=weight, render=self.render_for_reward_model,
                              overlong=overlong)

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
        rollout, extra = passes(rollout, self.policy, self.reference_policy(), collectives)
        rollout, excluded = exclude_nonfinite(rollout)
        extra.update(self.correction(rollout))
        rollout, more = self.estimate(rollout, collectives)
        self.observe(rollout)
        update_start = time.perf_counter()
        step = self.trainer.fit_loop.total_batch_idx
        generator = torch.Generator().manual_seed(self.rollout_seed * 1_000_003 + step)
        trained, hooks = self.trained_models(), self.update_hooks()
        for metrics, share in self.updater.run(rollout, trained, hooks, collectives, generator):
            self.step_metrics.add(self.device, metrics, share)
        step_time = time.perf_counter() - start
        stats = merge_stats(merge_stats(stats, extra), {
            **more, "rollout/excluded_tokens": excluded, "perf/step_time": step_time,
            "perf/weight_sync_time": sync_time,
            "perf/update_time": time.perf_counter() - update_start,
            "perf/tokens_per_sec": stats["perf/generated_tokens"] / step_time})
        self.reward_pipeline.warn_if_slow(stats.get("perf/reward_time", 0.0), step_time)  # once per run
        self.end_step(stats)

    def sample(self, batch: dict[str, list], collectives: Collectives | None,
               decide: bool = True) -> tuple[Rollout, dict[str, float]]:
        """The engine's G samples per prompt of ``batch``, scored by the reward pipeline (``decide``: the
        reward-failure limit, on the step's first batch only)."""
        G, prompts = self.num_generations, batch["prompt"]
        seed = hash((self.rollout_seed, self.trainer.fit_loop.total_batch_idx, self._generation_round,
                     self.global_rank)) % 2**31
        self._generation_round += 1
        start = time.perf_counter()
        columns = {k: [v for v in vals for _ in range(G)] for k, vals in batch_columns(batch).items()}
        episodes = None
        if self.episodes is not None:
            episodes = self.run_episodes(batch, G, self.sampling, seed, collectives)
            gen, texts, columns["turns"] = episodes.generation, episodes.texts, episodes.turns
        else:
            gen = self.generate(prompts, num_samples=G, sampling=self.sampling, seed=seed)
            texts = self.decode(gen.completion_ids, gen.completion_mask)
        gen_time = time.perf_counter() - start
        result = self.reward_pipeline([p for p in prompts for _ in range(G)], texts, gen.lengths.tolist(),
                                      columns, collectives=collectives, decide=decide)
        rewards, correct, stats = result.rewards, result.correct, result.stats
        if episodes is not None:
            rewards, correct = rewards + episodes.returns, episodes.correct(correct)
            stats = {**stats, **episodes.stats}
            gen_time -= stats["perf/env_time"]
        group_ids = torch.arange(len(prompts), device=self.device).repeat_interleave(G)
        rollout = Rollout.from_generation(gen, group_ids, rewards.to(self.device), correct.to(self.device),
                                          self.mask_truncated)
        sampled = gen.lengths if gen.model_mask is None else gen.model_mask.sum(-1)
        return rollout, {**stats, "perf/generation_time": gen_time,
                         "perf/generated_tokens": float(sampled.sum())}

    def run_episodes(self, batch: dict[str, list], num_samples: int, sampling: SamplingParams,
                     seed: int | None, collectives: Collectives | None) -> EpisodeBatch:
        """``num_samples`` episodes per prompt row of ``batch`` with the module's engine."""
        rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        self.attach_engine()
        return self.episodes(rows, num_samples=num_samples, sampling=sampling, seed=seed,
                             encode=self.encode_prompts, generate=self.engine.generate,
                             collectives=collectives, synced=bool(getattr(self.engine, "synced", False)))

    def complete(self, batch: dict[str, list], *, num_samples: int = 1, sampling: SamplingParams,
                 seed: int | None = None) -> Completions:
        """Validation and predict: whole episodes when the module has an environment or tools."""
        if self.episodes is None:
            return super().complete(batch, num_samples=num_samples, sampling=sampling, seed=seed)
        done = self.run_episodes(batch, num_samples, sampling, seed, Collectives(self._trainer))
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

    def estimate(self, rollout: Rollout, collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        """Values (with a critic), the KL-in-reward penalty, then advantages: once, after filtering."""
        stats: dict[str, float] = {}
        if self.critic is not None:
            rollout.values = score_values(self.critic, rollout, self.updater.micro_batch_size, collectives)
        if self.kl_reward is not None:
            rollout.token_rewards, stats = self.kl_reward(rollout, collectives)
        rollout.advantages, extra = self.advantage(rollout, collectives)
        return rollout, {**stats, **extra}

    def trained_models(self) -> list[TrainedModel]:
        """What the updater trains: the policy (PPO adds its critic)."""
        return [TrainedModel("policy", self.policy, self.optimizers(), self.policy_loss, ("policy/loss",))]

    def policy_loss(self, micro: Rollout, num_tokens: torch.Tensor,
                    num_seqs: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The objective (normalised by the minibatch's global counts) minus the entropy bonus."""
        logp, entropy = self.policy.token_logprobs(micro.prompt_ids, micro.prompt_mask, micro.completion_ids,
                                                   micro.attention_mask, with_entropy=True,
                                                   temperature=self.sampling.temperature)
        old_logp = micro.old_logp if micro.old_logp is not None else logp.detach()
        loss, metrics = self.objective(logp, old_logp, micro.ref_logp, micro.advantages, micro.loss_mask,
                                       num_tokens=num_tokens, num_seqs=num_seqs,
                                       token_weights=micro.is_weights)
        if self.entropy_coef:
            loss = loss - self.entropy_coef * aggregate(entropy, micro.loss_mask, self.objective.aggregation,
                                                        num_tokens=num_tokens, num_seqs=num_seqs)
        metrics["policy/entropy"] = masked_mean(entropy.detach(), micro.loss_mask.bool())
        metrics["policy/loss"] = loss
        return loss, metrics

    def correct(self, prompts: list[Any], completions: list[str], columns: dict[str, list]) -> list[Any]:
        """Per-completion correctness by ``correctness_fn``: rollouts and ``val/accuracy`` alike."""
        return self.correctness_fn(prompts=prompts, completions=completions, **columns)

    def validation_extra(self, batch: dict[str, list], done: Completions, columns: dict[str, list],
                         weight: float) -> None:
        rewards, _ = self.reward_pipeline.score(batch["prompt"], done.texts, done.lengths, columns)
        self.log_val_mean("val/reward_mean", torch.tensor(done.with_returns(rewards.tolist())).mean(), weight)


def main_reward(scorer: RewardScorer) -> FullScore:
    """Correctness by the first reward function of the largest weight, at its full score."""
    best = max(range(len(scorer.fns)), key=lambda i: (scorer.weights[i], -i))
    return FullScore(scorer.names[best], scorer.fns[best])


def check_keys(num_generations: int, advantage: AdvantageEstimator, entropy_coef: float, temperature: float,
               kl_in_reward: bool, kl_coef: float, kl_target: float | None, kl_horizon: int) -> None:
    """Ranges and combinations of ``OnlineRL``'s own keys, each error naming its YAML key."""
    if num_generations < advantage.min_group_size:
        raise ValueError(f"`model.num_generations` must be >= {advantage.min_group_size} for "
                         f"{type(advantage).__name__} advantages, got {num_generations}")
    checks = {"entropy_coef": entropy_coef >= 0, "temperature": temperature > 0,
              "kl_horizon": kl_horizon >= 1, "kl_target": kl_target is None or kl_target > 0,
              "kl_coef": kl_coef >= 0}
    for key, ok in checks.items():
        if not ok:
            raise ValueError(f"`model.{key}` is out of range, got {locals()[key]}")
    if kl_target is not None and not (kl_in_reward and kl_coef > 0):
        raise ValueError("`model.kl_target` (adaptive KL) needs `model.kl_in_reward: true` and "
                         "`model.kl_coef` > 0")
