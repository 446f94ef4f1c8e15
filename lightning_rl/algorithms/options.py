"""The option groups: what a YAML sets under ``model.init_args``, one small frozen dataclass per concern,
each checking its own fields when built and naming the YAML key that is wrong. A preset (GRPO, DAPO, PPO...)
is the same module with other default groups; a YAML that sets one field of a group keeps the preset's
others, as ``DAPO.configured(objective={...})`` does from Python. ``PolicyOptions`` and ``ValidationOptions``
are every algorithm's; the rest are the online step's (PPO's critic: ``models.critic.CriticOptions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from lightning_rl.episodes.environments import Environment
from lightning_rl.maths.checks import require as require_in
from lightning_rl.maths.covariance_regions import ClipCov, KLCov
from lightning_rl.maths.objective import Objective
from lightning_rl.maths.penalties import AdaptiveKL, KLController
from lightning_rl.models.sharding import FSDPOptions
from lightning_rl.step.correction import RolloutCorrection
from lightning_rl.step.filters import RolloutFilter
from lightning_rl.step.logprobs import BehaviourSource
from lightning_rl.step.reward_calls import RewardFunction

OnError = Literal["raise", "zero"]
# every shipped trust region imported, so that a YAML may name one by its class alone (`trust_region:
# ClipCov`)
TRUST_REGIONS_BY_NAME = (ClipCov, KLCov)


def require(group: str, **checks: tuple[bool, Any, str]) -> None:
    """Raise ``ValueError`` naming ``model.<group>.<key>``, its valid range and the value, for the first
    check ``key=(ok, value, expected)`` that fails."""
    require_in(f"model.{group}", **checks)


@dataclass(frozen=True)
class PolicyOptions:
    """The trained policy: what is loaded and how it is held.

    Args:
        model: hub id, local ``save_pretrained`` folder, or ``builtin:tiny-sort`` / ``builtin:tiny-scratch``.
        dtype: weights dtype (``float32``, ``bfloat16``, ``float16``, ``auto``); ``None`` loads float32
            whatever the checkpoint holds, ``auto`` keeps the checkpoint's.
        trust_remote_code: allow model code from the hub (off by default).
        gradient_checkpointing: trade compute for memory in the forward pass (the critic's too).
        chat_template: render plain-string prompts with the tokenizer's chat template.
        max_prompt_length: longest prompt in tokens; longer ones fail before training, naming the row.
        peft: train adapters only: a ``peft.PeftConfig`` subclass as ``class_path`` + ``init_args`` (e.g.
            ``peft.LoraConfig``), applied right after loading. The KL / DPO reference is then the same
            weights with the adapters disabled, and checkpoints hold the adapters and optimiser state only.
            From Python a ``peft.PeftConfig`` instance works too. Needs ``pip install 'lightning-rl[peft]'``.
        export_merged: with adapters, the exported policy folder holds the merged weights instead of the
            adapter folder.
        fsdp: under FSDP2, CPU offload and the mixed-precision dtypes
            (:class:`~lightning_rl.models.sharding.FSDPOptions`: ``cpu_offload``, ``param_dtype``,
            ``reduce_dtype``); ``null``: FSDP2's defaults.
    """

    model: str = "builtin:tiny-sort"
    dtype: str | None = None
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    chat_template: bool = False
    max_prompt_length: int = 512
    peft: dict[str, Any] | None = None
    export_merged: bool = False
    fsdp: FSDPOptions | None = None

    def __post_init__(self) -> None:
        require("policy", max_prompt_length=(self.max_prompt_length >= 1, self.max_prompt_length, ">= 1"))


@dataclass(frozen=True)
class ValidationOptions:
    """How held-out prompts (and predict) are completed and judged (SFT, DPO; the online family sets these
    from ``sampling`` and ``rewards``).

    Args:
        max_new_tokens: completion budget of greedy validation and predict.
        accuracy_fn: ``module:function`` scoring greedy completions; ``val/accuracy`` is its mean
            (``None``: ``lightning_rl.step.rewards:exact_match``).
    """

    max_new_tokens: int = 64
    accuracy_fn: str | None = None

    def __post_init__(self) -> None:
        require("validation", max_new_tokens=(self.max_new_tokens >= 1, self.max_new_tokens, ">= 1"))


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


@dataclass(frozen=True, kw_only=True)
class ObjectiveOptions(Objective):
    """The policy loss: a point on the objective's axes (:class:`lightning_rl.maths.objective.Objective`,
    whose fields and checks it inherits: ratio level, trust region and its options, the token selections,
    aggregation, the KL to the reference), where the KL goes (the loss or the reward) and the entropy bonus.

    Args:
        kl_in_reward: the KL as a per-token reward penalty (``lightning_rl.step.estimators.KLInReward``)
            instead of the loss term, its coefficient ``kl_coef`` moved by this controller:
            ``FixedKL`` or ``AdaptiveKL`` (``target``, ``horizon``) of ``lightning_rl.maths.penalties``, as a
            ``class_path`` (the class name is enough); ``null``: the KL is a loss term.
        entropy_coef: weight of an entropy bonus aggregated like the loss (0: off; always logged).

    ``aggregation_length`` here: ``None`` is ``sampling.max_new_tokens``, or the episode budget
    (``episodes.max_episode_tokens``) in multi-turn episodes; only ``seq-mean-token-sum-norm`` reads it.
    """

    kl_in_reward: KLController | None = None
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        length = self.aggregation_length
        require("objective", entropy_coef=(self.entropy_coef >= 0, self.entropy_coef, ">= 0"))
        if isinstance(self.kl_in_reward, AdaptiveKL) and not self.kl_coef > 0:
            raise ValueError("`model.objective.kl_in_reward: AdaptiveKL` needs `model.objective.kl_coef` > 0 "
                             "(its starting value)")
        if length is not None and self.aggregation != "seq-mean-token-sum-norm":
            raise ValueError(f"`model.objective.aggregation_length` has no effect under "
                             f"`model.objective.aggregation: {self.aggregation}` (only "
                             f"seq-mean-token-sum-norm reads it); leave it null, got {length}")


@dataclass(frozen=True)
class FilterOptions:
    """What leaves the rollout before advantages: DAPO's dynamic sampling, its overlong filtering, and any
    more rollout filters.

    Args:
        dynamic_sampling: keep only groups with mixed correctness, refilled from new prompts
            (``lightning_rl.step.filters.DynamicSampling``, up to ``max_gen_batches`` rounds).
        max_gen_batches: generation rounds per step with dynamic sampling, the first included.
        mask_truncated: leave completions that hit the token budget out of the loss.
        extra: more filters (``lightning_rl.step.filters.RolloutFilter`` as ``class_path``), applied after
            dynamic sampling.
    """

    dynamic_sampling: bool = False
    max_gen_batches: int = 3
    mask_truncated: bool = False
    extra: list[RolloutFilter] = field(default_factory=list)

    def __post_init__(self) -> None:
        require("filters", max_gen_batches=(self.max_gen_batches >= 1, self.max_gen_batches, ">= 1"))


@dataclass(frozen=True)
class LogProbOptions:
    """Where the behaviour log-probs come from, and the correction when the sampler is not the trained
    module (``lightning_rl.step.logprobs``, ``lightning_rl.step.correction``).

    Args:
        behaviour: ``auto``, ``recompute``, ``from_engine`` or ``on_policy``.
        correction: importance weights for an engine that is not the trained module
            (``RolloutCorrection``; ``None``: token-level, truncated at 2.0).
    """

    behaviour: BehaviourSource = "auto"
    correction: RolloutCorrection | None = None


@dataclass(frozen=True)
class UpdateOptions:
    """The updater (``lightning_rl.step.update.Updater``): passes, minibatches, micro-batches, clipping.

    Args:
        epochs: passes over each rollout (PPO's epochs).
        num_minibatches: optimiser steps per pass (each rank splits its rollout into this many).
        micro_batch_size: rows per forward / backward (``None``: a whole minibatch at once).
        max_grad_norm: gradient clipping by global norm (``None``: off).
        micro_batch_tokens: a token budget per forward / backward instead of a row count: rows of like
            lengths binned together, each micro-batch ``rows x (longest prompt + longest completion)``
            tokens at most (a longer row alone); ``micro_batch_size`` then caps the rows. ``perf/pad_frac``
            shows the padding left.
        logprob_chunk: tokens per chunk of the output layer and softmax when scoring (the log-prob of the
            sampled token and the entropy): the fp32 ``[tokens, vocabulary]`` logits are never all held at
            once, each chunk's recomputed in the backward. Where the scorer runs the head on chosen
            positions (``sampling.share_prompt_prefix`` on a Llama / Qwen / Mistral head); ``None``: all.
        packing: score each micro-batch's rows as one sequence without padding (positions restarting at
            each row, attention kept within rows by transformers' packed-sequence masks: eager / SDPA /
            flex, FlashAttention's variable-length kernels); the same log-probs and gradients. Checked
            before training: a model whose attention lets packed rows meet is refused in one line. Rows
            with holes in their masks are scored padded. Takes the place of ``share_prompt_prefix``'s
            prompt sharing in scoring.
        skip_zero_rows: rows the loss cannot reach (zero advantage on every token without a KL or entropy
            term in the loss, or no loss token) are not forwarded or backpropagated; the loss keeps its
            normalisers, so the update is the same (``perf/skipped_rows_frac``; ``policy/*`` metrics are
            then over the rows trained on).
    """

    epochs: int = 1
    num_minibatches: int = 1
    micro_batch_size: int | None = None
    max_grad_norm: float | None = 1.0
    skip_zero_rows: bool = True
    micro_batch_tokens: int | None = None
    logprob_chunk: int | None = None
    packing: bool = False

    def __post_init__(self) -> None:
        mbs, norm = self.micro_batch_size, self.max_grad_norm
        require("update", epochs=(self.epochs >= 1, self.epochs, ">= 1"),
                num_minibatches=(self.num_minibatches >= 1, self.num_minibatches, ">= 1"),
                micro_batch_size=(mbs is None or mbs >= 1, mbs, ">= 1 or null"),
                micro_batch_tokens=(self.micro_batch_tokens is None or self.micro_batch_tokens >= 1,
                                    self.micro_batch_tokens, ">= 1 or null"),
                logprob_chunk=(self.logprob_chunk is None or self.logprob_chunk >= 1, self.logprob_chunk,
                               ">= 1 or null"),
                max_grad_norm=(norm is None or norm > 0, norm, "> 0 or null"))
