"""The online step's stages, each built from its option group (``lightning_rl.algorithms.options``).

``OnlineRL.__init__`` calls :func:`online_step`, which calls the others in order and returns the
:class:`~lightning_rl.algorithms.online_step.OnlineStep` the module holds; each function takes one group (and
the little it needs from the module: the tokenizer, the token budget, a render function, the engine) and
returns the stage objects. A contributor who adds an option to a group builds it here, next to the other
stages of that group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_rl.algorithms.learner_options import (
    FilterOptions,
    LogProbOptions,
    ObjectiveOptions,
    UpdateOptions,
)
from lightning_rl.algorithms.online_step import OnlineStep
from lightning_rl.algorithms.sampler_options import EpisodeOptions, RewardOptions, SamplingOptions
from lightning_rl.episodes.async_source import AsyncRollouts
from lightning_rl.episodes.runner import EpisodeRunner, episode_runner
from lightning_rl.episodes.sampler import Sampler
from lightning_rl.episodes.source import RolloutSource
from lightning_rl.episodes.tool_formats import HermesFormat
from lightning_rl.maths.objective import Objective
from lightning_rl.models.frozen import FrozenModels
from lightning_rl.models.generation import SamplingParams
from lightning_rl.models.prompt_codec import PromptCodec
from lightning_rl.models.reward_model import RewardModelScorer
from lightning_rl.step.correction import RolloutCorrection
from lightning_rl.step.engine import RolloutEngine
from lightning_rl.step.estimators import AdvantageEstimator, GroupNormalized, KLInReward
from lightning_rl.step.filters import DynamicSampling, RolloutFilter
from lightning_rl.step.logprobs import resolve_behaviour
from lightning_rl.step.reward_pipeline import RewardPipeline, overlong_shaping
from lightning_rl.step.reward_scorer import RewardScorer
from lightning_rl.step.rewards import FullScore, import_reward
from lightning_rl.step.update import Updater

DEFAULT_REWARD = "lightning_rl.step.rewards:exact_match"


def online_step(policy: Any, codec: PromptCodec, engine: RolloutEngine, *, sampling: SamplingOptions,
                rewards: RewardOptions, episodes: EpisodeOptions, objective: ObjectiveOptions,
                advantage: AdvantageEstimator | None, filters: FilterOptions, logprobs: LogProbOptions,
                update: UpdateOptions, reads_behaviour: bool, trust_remote_code: bool) -> OnlineStep:
    """The online step of a module's ``policy``, ``codec`` and ``engine`` from its option groups, each stage
    built in order (a wrong choice fails here, before training). Sets the codec's tool schemas (Hermes
    tools); the reference is declared among the frozen models when a KL term is on."""
    estimator = advantage_stage(advantage, sampling.num_generations)
    runner, codec.tools = episode_stage(episodes, tokenizer=policy.tokenizer, chat=codec.chat_template,
                                        max_new_tokens=sampling.max_new_tokens, context=policy.context_length,
                                        max_prompt_length=codec.max_prompt_length)
    budget = runner.max_episode_tokens if runner is not None else sampling.max_new_tokens
    loss, kl_reward = objective_stages(objective, default_length=budget)
    stages = reward_stages(rewards, environment_only=episodes.environment is not None, budget=budget,
                           render=codec.render_for_reward_model, trust_remote_code=trust_remote_code,
                           decouple_eps=estimator.decouple_eps)
    updater = update_stage(update)
    behaviour, correction = behaviour_stage(logprobs, engine, updater.updates_per_rollout,
                                            kl_in_reward=kl_reward is not None,
                                            ahead=sampling.max_staleness > 0, reads_behaviour=reads_behaviour)
    params = SamplingParams(sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k)
    sampler = Sampler(sampling.num_generations, params, stages.pipeline, runner, filters.mask_truncated)
    step = OnlineStep(policy, engine, params, sampling.num_generations, sampling.seed,
                      sampling.share_prompt_prefix, runner, stages, sampler,
                      rollout_source(sampler, filters, sampling), estimator, loss, objective.entropy_coef,
                      kl_reward, updater, behaviour, correction, reads_behaviour, FrozenModels())
    if step.needs_reference:
        step.frozen.declare("reference", policy.reference)
    return step


def advantage_stage(advantage: AdvantageEstimator | None, num_generations: int) -> AdvantageEstimator:
    """The estimator (``None``: group z-score), refused when G is below its smallest group."""
    estimator = advantage if advantage is not None else GroupNormalized()
    if num_generations < estimator.min_group_size:
        raise ValueError(f"`model.sampling.num_generations` must be >= {estimator.min_group_size} for "
                         f"{type(estimator).__name__} advantages, got {num_generations}")
    return estimator


def update_stage(o: UpdateOptions) -> Updater:
    """The updater: epochs over the rollout, minibatches, micro-batches, clipping."""
    return Updater(o.epochs, o.num_minibatches, o.micro_batch_size, o.max_grad_norm, o.skip_zero_rows,
                   o.micro_batch_tokens)


def objective_stages(o: ObjectiveOptions, *, default_length: int | None = None,
                     ) -> tuple[Objective, KLInReward | None]:
    """The loss (its KL term off when the KL is in the reward) and the KL-in-reward penalty (``None`` unless
    ``kl_in_reward`` with ``kl_coef`` > 0). ``default_length``: ``seq-mean-token-sum-norm``'s length when
    the group leaves it unset, the completion budget (``max_new_tokens``, or the episode's); fixed, so that
    the loss does not change with a batch's padding, micro-batch or rank."""
    axes = {f.name: getattr(o, f.name) for f in dataclasses.fields(Objective)}  # the group holds each axis
    length = o.aggregation_length
    if length is None and o.aggregation == "seq-mean-token-sum-norm":
        length = default_length
    objective = Objective(**{**axes, "kl_coef": 0.0 if o.kl_in_reward is not None else o.kl_coef,
                             "aggregation_length": length})
    in_reward = o.kl_in_reward is not None and o.kl_coef > 0
    return objective, KLInReward(o.kl_coef, o.kl_estimator, o.kl_in_reward) if in_reward else None


def filter_stages(o: FilterOptions) -> list[RolloutFilter]:
    """Dynamic sampling (when on), then the extra filters, in the order they run."""
    return ([DynamicSampling(o.max_gen_batches)] if o.dynamic_sampling else []) + list(o.extra)


def rollout_source(sampler: Sampler, filters: FilterOptions,
                   sampling: SamplingOptions) -> RolloutSource | AsyncRollouts:
    """The sampler's half of the step: in the step (``max_staleness`` 0), or in a worker running ahead."""
    source = RolloutSource(sampler, filter_stages(filters), sampling.seed)
    if not sampling.max_staleness:
        return source
    return AsyncRollouts(source, sampling.max_staleness, sampling.worker_threads, sampling.worker,
                         sampling.worker_timeout)


def episode_stage(o: EpisodeOptions, *, tokenizer: Any, chat: bool, max_new_tokens: int,
                  max_prompt_length: int, context: int | None) -> tuple[EpisodeRunner | None, list | None]:
    """The episode runner (``None`` without an environment or tools) and, for the Hermes tool format, the
    tool schemas the chat template renders into prompts."""
    runner = episode_runner(
        o.environment, o.tools, tokenizer=tokenizer, chat=chat, max_turns=o.max_turns,
        max_new_tokens=max_new_tokens, max_episode_tokens=o.max_episode_tokens,
        max_prompt_length=max_prompt_length, context=context, tool_format=o.tool_format,
        tool_timeout=o.tool_timeout, on_env_error=o.on_error, max_error_frac=o.max_error_frac,
        allow_unsafe_tools=o.allow_unsafe_tools)
    if runner is not None and isinstance(runner.format, HermesFormat):
        return runner, [t.schema for t in runner.tools.values()] or None
    return runner, None


@dataclass
class RewardStages:
    """The reward functions' scorer (``None`` for a reward model's or an environment's rewards alone), what
    decides ``val/accuracy`` and the rollouts' correctness, and the pipeline that alone assembles the
    reward."""

    scorer: RewardScorer | None
    accuracy_fn: Callable[..., Any]
    accuracy_name: str
    correctness_fn: Callable[..., Any]
    pipeline: RewardPipeline


def reward_stages(o: RewardOptions, *, environment_only: bool, budget: int, render: Callable,
                  trust_remote_code: bool, decouple_eps: float | None = None) -> RewardStages:
    """The reward stages; an unset ``accuracy_fn`` follows the main reward function (or ``exact_match``
    when there are no reward functions); an unset ``correctness_fn`` follows ``accuracy_fn``.

    ``environment_only``: ``functions: []`` with an environment means the environment's rewards alone.
    ``budget``: the tokens a sample may take (one turn, or the episode), for overlong shaping.
    ``decouple_eps``: the advantage estimator is GDPO (``AdvantageEstimator.decouple_eps``).
    """
    functions = o.functions if o.functions is not None else (None if o.model else [DEFAULT_REWARD])
    if functions == [] and environment_only:
        functions = None
    if decouple_eps is not None:
        check_decoupled(o, functions, environment_only)
    scorer = None if functions is None else RewardScorer(functions, o.weights, o.on_error, o.max_error_frac,
                                                         timeout=o.timeout, isolate=o.isolate)
    if o.accuracy_fn is None and scorer is not None:
        accuracy_fn: Any = main_reward(scorer)
        accuracy_name = repr(accuracy_fn)
    else:
        accuracy_name = o.accuracy_fn or DEFAULT_REWARD
        accuracy_fn = import_reward(accuracy_name, "model.rewards.accuracy_fn")
    correctness_fn = import_reward(o.correctness_fn, "model.rewards.correctness_fn") if o.correctness_fn \
        else accuracy_fn
    model = RewardModelScorer(o.model, trust_remote_code=trust_remote_code) if o.model else None
    overlong = overlong_shaping(o.overlong_buffer, o.overlong_penalty_factor, budget)
    pipeline = RewardPipeline(scorer, correctness_fn, reward_model=model, reward_model_weight=o.model_weight,
                              render=render, overlong=overlong, decouple_eps=decouple_eps)
    return RewardStages(scorer, accuracy_fn, accuracy_name, correctness_fn, pipeline)


def check_decoupled(o: RewardOptions, functions: list | None, environment: bool) -> None:
    """GDPO normalises each reward function's scores: refuse rewards it would leave out of the advantage."""
    other = {"model.rewards.model": o.model, "model.rewards.overlong_buffer": o.overlong_buffer,
             "model.episodes.environment": environment or None}
    given = [key for key, value in other.items() if value]
    if not functions or given:
        why = f"{', '.join(f'`{k}`' for k in given)} would be left out of the advantage" if given else \
            "`model.rewards.functions` is empty"
        raise ValueError(f"`model.advantage` GDPO normalises each of `model.rewards.functions` within its "
                         f"group and sums them with `model.rewards.weights`: {why}; use GroupNormalized")


def main_reward(scorer: RewardScorer) -> FullScore:
    """Correctness by the first reward function of the largest weight, at its full score."""
    best = max(range(len(scorer.fns)), key=lambda i: (scorer.weights[i], -i))
    return FullScore(scorer.names[best], scorer.fns[best])


def behaviour_stage(o: LogProbOptions, engine: RolloutEngine, updates_per_rollout: int, *, kl_in_reward: bool,
                    ahead: bool, reads_behaviour: bool) -> tuple[str, RolloutCorrection]:
    """Where the behaviour log-probs come from (checked against the engine now, so that a wrong choice fails
    before training) and the correction; the engine told what it must keep (``ahead``: a worker sampling
    ahead; ``reads_behaviour``: a stage reads the sampling policy's log-probs)."""
    if ahead:  # the worker's weights are k steps old: its log-probs are the behaviour's
        engine.sample_ahead()
    if reads_behaviour:
        engine.keep_logprobs()  # else the learner's behaviour pass scores them
    behaviour = behaviour_source(o.behaviour, kl_in_reward=kl_in_reward)
    resolve_behaviour(behaviour, updates_per_rollout, engine)
    return behaviour, o.correction if o.correction is not None else RolloutCorrection()


def behaviour_source(behaviour: str, *, kl_in_reward: bool) -> str:
    """The behaviour source the learner uses: ``model.logprobs.behaviour``, or ``recompute`` when the KL is in
    the reward (its penalty needs the trained policy's own log-probs of the rollout). An explicit other
    source is refused rather than overridden."""
    if not kl_in_reward or behaviour in ("auto", "recompute"):
        return "recompute" if kl_in_reward else behaviour
    raise ValueError(f"`model.objective.kl_in_reward` (the KL in the reward) scores the behaviour log-probs "
                     f"with the trained policy (`recompute`), which `model.logprobs.behaviour: {behaviour}` "
                     "contradicts: leave `model.logprobs.behaviour` at auto or recompute")
