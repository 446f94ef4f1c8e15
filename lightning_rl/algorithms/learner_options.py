"""The learner's option groups (``model.init_args.objective``, ``filters``, ``logprobs``, ``update``): what
leaves the rollout, where the behaviour log-probs come from, the policy loss and the updater. Each a frozen
dataclass checking its own fields, naming the YAML key (the other groups:
:mod:`lightning_rl.algorithms.options`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_rl.algorithms.options import require
from lightning_rl.maths.covariance_regions import ClipCov, KLCov
from lightning_rl.maths.objective import Objective
from lightning_rl.maths.penalties import AdaptiveKL, KLController
from lightning_rl.step.correction import RolloutCorrection
from lightning_rl.step.filters import RolloutFilter
from lightning_rl.step.logprobs import BehaviourSource

# every shipped trust region imported, so that a YAML may name one by its class alone (`trust_region:
# ClipCov`)
TRUST_REGIONS_BY_NAME = (ClipCov, KLCov)


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
