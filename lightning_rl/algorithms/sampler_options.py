"""The sampler's option groups (``model.init_args.sampling``, ``rewards``, ``episodes``): how completions are
drawn, scored and, in episodes, played out. Each a frozen dataclass checking its own fields, naming the YAML
key (the other groups: :mod:`lightning_rl.algorithms.options`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_rl.algorithms.options import OnError, require
from lightning_rl.episodes.environments import Environment
from lightning_rl.step.reward_calls import RewardFunction


@dataclass(frozen=True)
class SamplingOptions:
    """The rollout: how many completions per prompt, how long, and how they are drawn.

    Args:
        num_generations: samples per prompt (G), at least the advantage estimator's ``min_group_size``.
        max_new_tokens: completion budget of a rollout, of validation and of predict (one turn's budget in
            episodes).
        temperature: sampling temperature; log-probs are scored at it too, on the unfiltered distribution.
        top_p: nucleus sampling (1.0: off); sampling only, never scoring.
        top_k: top-k sampling (0: off); sampling only, never scoring.
        share_prompt_prefix: run each distinct prompt once in sampling and scoring (same numbers; off under
            FSDP2 / ZeRO-3, and for scoring under gradient checkpointing).
        seed: sampling is seeded by (this, step, round, rank): a resumed run samples the same.
        max_staleness: ``k`` >= 1: a worker samples step ``t``'s rollout with the weights of step ``t - k``
            while the learner trains (``lightning_rl.episodes.async_source``); 0: synchronous.
        worker_threads: torch intra-op threads of that worker when it is a process (forked from a fresh
            thread, so parallel regions work there whatever the learner ran).
        worker: ``process`` (a forked process with its own threads, killed when the learner's process ends),
            ``thread`` (a thread of the learner's process with its own copy of the weights and CUDA stream;
            transformers' ``generate``, which draws from the global RNG, is refused there) or ``auto``: a
            process on CPU, a thread on GPUs.
        worker_timeout: seconds the worker may go without reporting progress while the learner waits for it
            (it reports each phase: waiting for weights, each generation call, rewards and tools, sending)
            before the run stops naming it, its step and its phase; a slow step is fine, one phase (a
            generation, a reward call) longer than this is a stall. ``null``: no limit.
    """

    num_generations: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    share_prompt_prefix: bool = True
    seed: int = 0
    max_staleness: int = 0
    worker_threads: int = 1
    worker: str = "auto"
    worker_timeout: float | None = 600.0

    def __post_init__(self) -> None:
        require("sampling", num_generations=(self.num_generations >= 1, self.num_generations, ">= 1"),
                max_new_tokens=(self.max_new_tokens >= 1, self.max_new_tokens, ">= 1"),
                temperature=(self.temperature > 0, self.temperature, "> 0"),
                top_p=(0 < self.top_p <= 1, self.top_p, "in (0, 1]"),
                top_k=(self.top_k >= 0, self.top_k, ">= 0 (0: off)"),
                max_staleness=(self.max_staleness >= 0, self.max_staleness, ">= 0 (0: synchronous)"),
                worker_threads=(self.worker_threads >= 1, self.worker_threads, ">= 1"),
                worker=(self.worker in ("auto", "process", "thread"), self.worker,
                        "one of auto, process, thread"),
                worker_timeout=(self.worker_timeout is None or self.worker_timeout > 0, self.worker_timeout,
                                "> 0 seconds, or null for no limit"))


@dataclass(frozen=True)
class RewardOptions:
    """The reward: functions, a reward model, shaping, and what counts as correct.

    Args:
        functions: reward functions by import path (``package.module:function``) or as ``class_path`` +
            ``init_args`` (a ``lightning_rl.step.reward_calls.RewardFunction``, e.g. the LLM judge
            ``lightning_rl.step.judge.LLMJudge``); ``None``: ``exact_match``, or none with a reward
            ``model``; ``[]`` with an environment: the environment's rewards alone. A group reward
            (``reward_calls.group_reward``) is called once per group of G completions of one prompt.
        weights: one weight per function (default 1.0 each).
        model: a one-label sequence-classification folder whose weighted score of the rendered prompt +
            completion is added (kept out of checkpoints and optimisers).
        model_weight: the reward model's weight.
        correctness_fn: decides ``rollout.correct`` (filters, ``rollout/correct_frac``); ``None`` uses
            ``accuracy_fn``.
        accuracy_fn: decides greedy ``val/accuracy``; ``None`` follows the main reward function (the first
            of the largest weight): a sample is correct where it scores 1.0 or more.
        on_error: ``raise`` stops on a reward function error or NaN; ``zero`` scores it 0, counts it in
            ``rollout/reward_errors`` and warns, naming the function and its last error.
        max_error_frac: with ``on_error: zero``, stop when more than this fraction of a step's samples (all
            ranks) had a failed reward.
        overlong_buffer: DAPO's soft overlong punishment over the last this-many tokens of the budget:
            ``None`` or 0: off; ``auto``: a fifth of the budget, at least 1. Logged as
            ``rollout/overlong_penalty_mean``.
        overlong_penalty_factor: weight of the overlong penalty added to the reward.
        timeout: seconds each reward function may take on a batch (the functions run at once, plain ones
            in threads, ``async def`` ones awaited); a slower one fails on every sample of the batch
            (``on_error`` decides). ``None``: no limit.
        isolate: reward functions (import paths from ``functions``, or ``true``: all) run in worker processes
            that are killed on timeout (a timed-out thread cannot be stopped).
    """

    functions: list[str | RewardFunction] | None = None
    weights: list[float] | None = None
    model: str | None = None
    model_weight: float = 1.0
    correctness_fn: str | None = None
    accuracy_fn: str | None = None
    on_error: OnError = "raise"
    max_error_frac: float = 0.5
    overlong_buffer: int | Literal["auto"] | None = None
    overlong_penalty_factor: float = 1.0
    timeout: float | None = None
    isolate: bool | list[str] = False

    def __post_init__(self) -> None:
        require("rewards", max_error_frac=(0 <= self.max_error_frac <= 1, self.max_error_frac, "in [0, 1]"),
                timeout=(self.timeout is None or self.timeout > 0, self.timeout, "> 0 or null"))


@dataclass(frozen=True)
class EpisodeOptions:
    """Multi-turn episodes: on when an ``environment`` or ``tools`` is set; every rollout, validation and
    prediction is then an episode (``lightning_rl.episodes.environments``).

    Args:
        environment: a ``lightning_rl.episodes.environments.Environment`` as ``class_path``: it answers each
            model turn without a tool call; its step and final rewards are added to the reward functions'.
        tools: callables the model may call (``package.module:function``), their schemas rendered by the chat
            template where it supports tools.
        max_turns: model turns per episode; ``sampling.max_new_tokens`` is then one turn's budget.
        max_episode_tokens: tokens after the prompt (model and observation tokens) per episode; an episode
            that would pass it ends ``truncated``. ``None``: ``max_turns * max_new_tokens``.
        tool_format: ``auto`` (Hermes ``<tool_call>`` JSON through a chat template that supports tools, else
            the plain ``<tool>name(args)</tool>`` format), ``hermes`` or ``plain``.
        tool_timeout: seconds a tool call may take; a slower call answers an error observation and its worker
            process is killed.
        allow_unsafe_tools: accept tools that run commands, evaluate code or delete files (``os:system``,
            ``subprocess:run``, ``builtins:eval``...); run model-written code in
            ``lightning_rl.sandbox:python`` instead.
        on_error: ``raise`` stops on an environment exception, naming it and the episode; ``zero`` ends the
            episode with return 0 and counts it in ``rollout/env_errors``.
        max_error_frac: with ``on_error: zero``, stop when more than this fraction of a step's episodes (all
            ranks) failed; a failed episode's reward is 0 whatever the reward functions say.
    """

    environment: Environment | None = None
    tools: list[str] | None = None
    max_turns: int = 4
    max_episode_tokens: int | None = None
    tool_format: Literal["auto", "hermes", "plain"] = "auto"
    tool_timeout: float = 10.0
    allow_unsafe_tools: bool = False
    on_error: OnError = "raise"
    max_error_frac: float = 0.5

    def __post_init__(self) -> None:
        require("episodes", max_error_frac=(0 <= self.max_error_frac <= 1, self.max_error_frac, "in [0, 1]"))

    @property
    def enabled(self) -> bool:
        return self.environment is not None or bool(self.tools)
