"""The log-prob passes of the RL step: reference and behaviour log-probs of a rollout's sampled tokens.

Every pass scores at the sampling temperature on the unfiltered distribution (top-k / top-p belong to
sampling only), reads ``attention_mask`` for the context and runs under ``no_grad`` in micro-batches.
Forwards of sharded weights are collectives: every rank agrees on the count before the first forward and
pads with empty forwards, so no rank's all-reduce meets another rank's weight gather.

Behaviour log-probs (``old_logp``) come from one of:

- ``recompute``: the trained policy scores the rollout before the first update (decoupled: behaviour,
  trainer and engine may be three policies).
- ``from_engine``: the engine's own ``rollout_logp`` (bypass: the engine is the behaviour policy).
- ``on_policy``: none; the current log-probs, detached, stand in. Exact only for one update per rollout
  (the ratio is then 1 and its gradient the plain policy gradient): from the trained module itself, or
  from an engine that returns its log-probs (another copy of the weights: a bf16 copy, a worker sampling
  ahead), whose gap to the current log-probs the correction then weighs in the loss, with no extra pass.
- ``auto``: ``on_policy`` where that is exact with the trained module, an engine sampling ahead or one that
  ``corrects_in_loss`` (vLLM), else ``recompute`` (a bf16 ``CopyEngine`` recomputes unless ``on_policy`` is
  asked for).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_rl.step.collectives import Collectives
from lightning_rl.step.rollout import Rollout, exclude_nonfinite

BehaviourSource = Literal["auto", "recompute", "from_engine", "on_policy"]
BEHAVIOUR_SOURCES = ("auto", "recompute", "from_engine", "on_policy")


@torch.no_grad()
def score_rollout(scorer: Any, rollout: Rollout, *, temperature: float, micro_batch_size: int | None,
                  collectives: Collectives, joiner: Any = None) -> Tensor:
    """``[N, C]`` log-probs of the rollout's completion tokens under ``scorer`` (a Policy or reference).

    ``joiner``: the trained policy when ``scorer``'s forwards run its sharded weights (the policy itself,
    or a reference sharing them): its forward count is agreed over ranks and padded with empty forwards.
    """
    size = micro_batch_size or max(len(rollout), 1)
    parts = list(rollout.minibatches(size))
    total = len(parts) if joiner is None else collectives.agreed_count(joiner.model, len(parts))
    out = [scorer.token_logprobs(p.prompt_ids, p.prompt_mask, p.completion_ids, p.attention_mask,
                                 temperature=temperature)[0] for p in parts]
    for _ in range(total - len(parts)):
        collectives.empty_loss(joiner)
    if not out:
        return rollout.attention_mask.new_zeros(rollout.attention_mask.shape).float()
    return torch.cat(out, 0)


def resolve_behaviour(source: str, updates_per_rollout: int, engine: Any) -> str:
    """The behaviour source this step uses; ``auto`` resolved. Raises naming ``model.logprobs.behaviour``."""
    if source not in BEHAVIOUR_SOURCES:
        raise ValueError(f"`model.logprobs.behaviour` must be one of {BEHAVIOUR_SOURCES}, got {source!r}")
    if source == "from_engine" and not engine.returns_logprobs:
        raise ValueError(f"`model.logprobs.behaviour: from_engine` needs an engine that returns log-probs; "
                         f"{type(engine).__name__} does not")
    exact = updates_per_rollout == 1 and (engine.is_trained_module or engine.returns_logprobs)
    if source == "on_policy" and not exact:
        raise ValueError("`model.logprobs.behaviour: on_policy` is only exact with one update per rollout "
                         "(`model.update.epochs` x `model.update.num_minibatches` == 1) from an engine that "
                         "samples with the trained module or returns its log-probs; use `recompute`")
    if source == "auto":  # an engine sampling ahead: its gap weighed in the loss, with no separate pass
        cheap = engine.is_trained_module or engine.samples_ahead or engine.corrects_in_loss
        return "on_policy" if exact and cheap else "recompute"
    return source


class LogProbPasses:
    """Reference and behaviour log-probs of a rollout (the step's ``log-prob passes`` stage).

    Args:
        behaviour: where behaviour log-probs come from (see the module docstring).
        temperature: the sampling temperature the tokens were drawn at.
        micro_batch_size: rows per forward (``None``: all at once).
    """

    def __init__(self, behaviour: str, temperature: float, micro_batch_size: int | None) -> None:
        self.behaviour, self.temperature, self.micro_batch_size = behaviour, temperature, micro_batch_size

    def __call__(self, rollout: Rollout, policy: Any, reference: Any,
                 collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        """The rollout with ``ref_logp`` (when there is a reference) and ``old_logp`` set, and the passes'
        times. Empty rollouts run the passes too: their forward counts may be collectives."""
        def score(scorer: Any) -> Tensor:
            joiner = policy if scorer is policy or getattr(scorer, "shares_weights", False) else None
            return score_rollout(scorer, rollout, temperature=self.temperature,
                                 micro_batch_size=self.micro_batch_size, collectives=collectives,
                                 joiner=joiner)

        start = time.perf_counter()
        ref_logp = rollout.ref_logp  # scored where the rollout was sampled (a worker sampling ahead), or:
        if ref_logp is None and reference is not None:
            ref_logp = score(reference)
        middle = time.perf_counter()
        if self.behaviour == "recompute":
            old_logp = score(policy)
        else:
            old_logp = rollout.rollout_logp if self.behaviour == "from_engine" else None
        end = time.perf_counter()
        return replace(rollout, ref_logp=ref_logp, old_logp=old_logp), {
            "perf/reference_time": middle - start, "perf/old_logprob_time": end - middle}


@torch.no_grad()
def score_values(critic: Any, rollout: Rollout, micro_batch_size: int | None,
                 collectives: Collectives) -> Tensor:
    """``[N, C]`` the critic's values of the rollout's completion tokens (as many forwards on every rank
    when the critic is sharded)."""
    size = micro_batch_size or max(len(rollout), 1)
    out = [critic.values(p.prompt_ids, p.prompt_mask, p.completion_ids, p.attention_mask)
           for p in rollout.minibatches(size)]
    for _ in range(collectives.agreed_count(critic.model, len(out)) - len(out)):
        collectives.empty_loss(critic)
    if not out:
        return rollout.attention_mask.new_zeros(rollout.attention_mask.shape).float()
    return torch.cat(out, 0)


class CriticValues:
    """The stage that scores the critic's values of a rollout's completion tokens at rollout time (PPO's
    GAE reads them): ``(rollout, collectives) -> (rollout with values, {})``.

    Args:
        critic: the value model (``lightning_rl.models.critic.Critic``), trained beside the policy.
        micro_batch_size: rows per forward (``None``: the whole rollout at once).
    """

    def __init__(self, critic: Any, micro_batch_size: int | None) -> None:
        self.critic, self.micro_batch_size = critic, micro_batch_size

    def __call__(self, rollout: Rollout, collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        return replace(rollout, values=score_values(self.critic, rollout, self.micro_batch_size,
                                                    collectives)), {}


class TeacherLogProbs:
    """The stage that scores the sampled tokens under a frozen distillation teacher (``rollout.teacher_logp``)
    at the sampling temperature, on the unfiltered distribution like every log-prob pass.

    The teacher is whole on every rank (never sharded, like the reference): its forwards are local, so a
    rank with fewer rows makes fewer of them without meeting another rank's collective.

    Args:
        teacher: a frozen scorer with ``token_logprobs`` (``lightning_rl.models.teacher.load_teacher``).
        temperature: the sampling temperature the tokens were drawn at.
        micro_batch_size: rows per forward (``None``: the whole rollout at once).
    """

    def __init__(self, teacher: Any, temperature: float, micro_batch_size: int | None) -> None:
        self.teacher, self.temperature, self.micro_batch_size = teacher, temperature, micro_batch_size

    def __call__(self, rollout: Rollout, collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        start = time.perf_counter()
        teacher_logp = rollout.teacher_logp  # scored where the rollout was sampled (a worker ahead), or:
        if teacher_logp is None:
            teacher_logp = score_rollout(self.teacher, rollout, temperature=self.temperature,
                                         micro_batch_size=self.micro_batch_size, collectives=collectives)
        # a non-finite teacher log-prob leaves the loss, as a non-finite behaviour or reference one does
        rollout, excluded = exclude_nonfinite(replace(rollout, teacher_logp=teacher_logp))
        return rollout, {"perf/teacher_time": time.perf_counter() - start,
                         "distill/teacher_excluded_tokens": excluded}
