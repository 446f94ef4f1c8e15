"""The log-prob stages of the RL step: the frozen models' (the reference, a preset's own) and the behaviour
log-probs of a rollout's sampled tokens, and the critic's values.

Every pass scores at the temperature the rollout was sampled at (``Rollout.temperature``: the record's, no
stage holds a copy) on the unfiltered distribution (top-k / top-p belong to sampling only), reads
``attention_mask`` for the context and runs under ``no_grad`` in micro-batches.
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

from lightning_rl.models.frozen import FrozenModels
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.rollout import Rollout, exclude_nonfinite

BehaviourSource = Literal["auto", "recompute", "from_engine", "on_policy"]
BEHAVIOUR_SOURCES = ("auto", "recompute", "from_engine", "on_policy")


@torch.no_grad()
def score_rollout(scorer: Any, rollout: Rollout, *, micro_batch_size: int | None, collectives: Collectives,
                  joiner: Any = None) -> Tensor:
    """``[N, C]`` log-probs of the rollout's completion tokens under ``scorer`` (a Policy or reference), at
    the temperature they were sampled at (``rollout.temperature``).

    ``joiner``: the trained policy when ``scorer``'s forwards run its sharded weights (the policy itself,
    or a reference sharing them): its forward count is agreed over ranks and padded with empty forwards.
    """
    size = micro_batch_size or max(len(rollout), 1)
    parts = list(rollout.minibatches(size))
    total = len(parts) if joiner is None else collectives.agreed_count(joiner.model, len(parts))
    out = [scorer.token_logprobs(p.prompt_ids, p.prompt_mask, p.completion_ids, p.attention_mask,
                                 temperature=rollout.temperature)[0] for p in parts]
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


class BehaviourLogProbs:
    """The stage that sets the rollout's behaviour log-probs (``old_logp``) from the source this step uses:
    ``(rollout, collectives) -> (rollout, {"perf/old_logprob_time": s})``.

    Args:
        behaviour: ``model.logprobs.behaviour`` (see the module docstring), resolved against ``engine`` at
            every step (the engine attached then decides what is exact).
        engine: the module's rollout engine.
        policy: the trained policy, which ``recompute`` scores the rollout with (at its temperature).
        updates_per_rollout: optimiser steps per rollout (``on_policy`` is exact only for one).
        micro_batch_size: rows per forward (``None``: all at once).
        read_later: a later stage reads the sampling policy's log-probs (a preset's advantages): an
            ``on_policy`` step then scores them when the engine did not return them.
    """

    def __init__(self, behaviour: str, *, engine: Any, policy: Any, updates_per_rollout: int,
                 micro_batch_size: int | None, read_later: bool = False) -> None:
        self.behaviour, self.engine, self.policy = behaviour, engine, policy
        self.updates_per_rollout, self.micro_batch_size = updates_per_rollout, micro_batch_size
        self.read_later = read_later

    def source(self, rollout: Rollout) -> str:
        """This step's source, ``auto`` resolved against the engine attached now."""
        behaviour = resolve_behaviour(self.behaviour, self.updates_per_rollout, self.engine)
        if behaviour == "on_policy" and self.read_later and rollout.rollout_logp is None:
            return "recompute"  # the same numbers as the current log-probs before the update
        return behaviour

    def __call__(self, rollout: Rollout, collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        start, source = time.perf_counter(), self.source(rollout)
        if source == "recompute":  # empty rollouts too: their forward counts may be collectives
            old_logp = score_rollout(self.policy, rollout, micro_batch_size=self.micro_batch_size,
                                     collectives=collectives, joiner=self.policy)
        else:
            old_logp = rollout.rollout_logp if source == "from_engine" else None
        return replace(rollout, old_logp=old_logp), {"perf/old_logprob_time": time.perf_counter() - start}


class FrozenLogProbs:
    """The stage that scores the sampled tokens under a frozen model (:class:`FrozenModels`): the reference
    into ``ref_logp``, any other into ``frozen_logp`` under its name (:meth:`Rollout.with_frozen_scores`), at
    the rollout's sampling temperature on the unfiltered distribution like every log-prob pass, unless the
    worker sampling ahead scored them where it sampled. A model that shares the trained weights (a LoRA
    reference) runs them: its forward count is agreed over ranks like the policy's.

    Args:
        models: the module's frozen models; ``name`` is looked up when the stage runs (declared later by a
            preset, or not at all: then the record stays as it is).
        name: the model's name in ``models`` (``reference``, or a preset's own).
        policy: the trained policy (the joiner of a model that shares its weights).
        micro_batch_size: rows per forward (``None``: the whole rollout at once).
        time_key: the metric of its time.
        excluded_key: where it counts the tokens it leaves out of the loss for a non-finite log-prob
            (``None``: the learner's common exclusion after the behaviour pass counts them).
    """

    def __init__(self, models: FrozenModels, name: str, *, policy: Any, micro_batch_size: int | None,
                 time_key: str, excluded_key: str | None = None) -> None:
        self.models, self.name, self.policy = models, name, policy
        self.micro_batch_size, self.time_key, self.excluded_key = micro_batch_size, time_key, excluded_key

    def __call__(self, rollout: Rollout, collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        start = time.perf_counter()
        scores = rollout.frozen_scores(self.name)
        scorer = self.models.get(self.name)
        if scores is None and scorer is not None:
            joiner = self.policy if scorer.shares_weights else None
            scores = score_rollout(scorer, rollout, micro_batch_size=self.micro_batch_size,
                                   collectives=collectives, joiner=joiner)
        rollout = rollout.with_frozen_scores(self.name, scores)
        stats = {self.time_key: time.perf_counter() - start}
        if self.excluded_key is not None:
            rollout, stats[self.excluded_key] = exclude_nonfinite(rollout)
        return rollout, stats


class ExcludeNonfinite:
    """The stage that leaves out of the loss every token whose behaviour log-prob, or a frozen model's scored
    so far, is not finite (``rollout/excluded_tokens``; ``lightning_rl.step.rollout.exclude_nonfinite``)."""

    def __call__(self, rollout: Rollout, collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        rollout, excluded = exclude_nonfinite(rollout)
        return rollout, {"rollout/excluded_tokens": excluded}


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
