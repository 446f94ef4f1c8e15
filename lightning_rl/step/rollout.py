"""``Rollout``: the typed record of one batch of sampled completions and everything scored on them.

Rows are samples; the G samples of prompt ``i`` are rows ``i*G .. i*G+G-1`` (``group_ids`` says so
explicitly). ``N`` = prompts x G, ``P`` = padded prompt length, ``C`` = padded completion length.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, replace

import torch

from lightning_rl.models.frozen import REFERENCE
from lightning_rl.models.generation import Generation

Tensor = torch.Tensor


@dataclass
class Rollout:
    """One RL batch.

    Attributes:
        prompt_ids: ``[N, P]`` long, left-padded.
        prompt_mask: ``[N, P]`` 0/1, 1 on real prompt tokens.
        completion_ids: ``[N, C]`` long, right-padded.
        attention_mask: ``[N, C]`` 0/1, 1 on the completion tokens present in the context: the sampled
            tokens up to and including the first EOS (and, in episodes, environment tokens). Every scoring
            forward reads this mask, and only this one.
        loss_mask: ``[N, C]`` 0/1, 1 on the tokens the loss counts: a subset of ``attention_mask``
            (truncated rows under ``mask_truncated``, tokens with a non-finite behaviour or frozen model's
            log-prob and environment tokens are 0 here but stay in the context). Aggregation, counts and
            advantages read this mask, and only this one.
        truncated: ``[N]`` bool, no EOS within the token budget.
        lengths: ``[N]`` long, sampled completion lengths (EOS included), whatever the loss mask says.
        group_ids: ``[N]`` long, index of the prompt each row answers (consecutive groups of G).
        rewards: ``[N]`` float, total (weighted, shaped) reward.
        correct: ``[N]`` bool, verifiable correctness (what DAPO's filter and ``val/accuracy`` use).
        advantages: ``[N]`` (per sequence) or ``[N, C]`` (per token) float, set once by the advantage
            estimator after filtering.
        old_logp: ``[N, C]`` behaviour-policy log-probs, or ``None`` on-policy (one update per rollout from
            the trained module: the ratio is 1 and the current log-probs, detached, stand in).
        ref_logp: ``[N, C]`` reference log-probs, or ``None`` when no KL term is on.
        frozen_logp: ``{name: [N, C]}`` the log-probs of the sampled tokens under each other frozen model a
            preset scores (``lightning_rl.models.frozen.FrozenModels``), by its name; reshaped, moved,
            concatenated and checked for non-finite values like the tensor fields. Empty: none scored.
        rollout_logp: ``[N, C]`` the engine's log-probs of the sampled tokens, when it returns them.
        is_weights: ``[N, C]`` off-policy correction weights (``lightning_rl.step.correction``), or ``None``.
        token_rewards: ``[N, C]`` per-token rewards (the score on the last token minus a KL-in-reward
            penalty), when a KL penalty is in the reward; else ``None`` (``rewards`` alone).
        model_mask: ``[N, C]`` 1 on the tokens the model sampled, for episodes (observation tokens are 0:
            context, never loss); ``None`` for single-turn rollouts (every ``attention_mask`` token).
        values: ``[N, C]`` critic values at rollout time (PPO), else ``None``.
        returns: ``[N, C]`` value targets (PPO), else ``None``.
        versions: ``[N]`` long, the weight version (trainer step) whose weights sampled each row, when the
            sampler runs ahead of the learner (``sampling.max_staleness``); weights never change within a
            rollout, so one version per row is exact. ``None``: sampled by this step's weights.
        outcome: ``[N]`` float, what DAPO's dynamic sampling compares within a group
            (``RewardPipeline.outcome``: correctness, or the main reward function's raw score when
            correctness is read off it). ``None``: ``correct``.
        decoupled_rewards: ``[N]`` float, GDPO's sum of the reward functions' scores each normalised within
            its group (``RewardPipeline.decoupled``), what ``estimators.GDPO`` reads; ``None`` otherwise.
        temperature: the sampling temperature the completions were drawn at (the sampler's, from the
            sampling parameters the engine was called with), one for the whole record: every learner-side
            log-prob pass scores the tokens at it. Rows are only ever concatenated with rows drawn at the
            same temperature (:meth:`cat`). 1.0 in a record built without one (by hand, in tests).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    truncated: Tensor
    lengths: Tensor
    group_ids: Tensor
    rewards: Tensor
    correct: Tensor
    advantages: Tensor | None = None
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    frozen_logp: dict[str, Tensor] = field(default_factory=dict)
    rollout_logp: Tensor | None = None
    token_rewards: Tensor | None = None
    is_weights: Tensor | None = None
    model_mask: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None
    versions: Tensor | None = None
    outcome: Tensor | None = None
    decoupled_rewards: Tensor | None = None
    temperature: float = 1.0

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return int(self.group_ids.unique().numel())

    def select(self, index: Tensor) -> Rollout:
        """The rows ``index`` (a long index or bool mask over ``N``) of every tensor field, each frozen
        model's log-probs included (the temperature kept)."""
        return replace(self, **{f.name: _take(getattr(self, f.name), index) for f in fields(self)})

    def frozen_scores(self, name: str) -> Tensor | None:
        """Frozen model ``name``'s log-probs of the sampled tokens: ``ref_logp`` for the reference, else
        ``frozen_logp[name]``; ``None`` when not scored."""
        return self.ref_logp if name == REFERENCE else self.frozen_logp.get(name)

    def with_frozen_scores(self, name: str, scores: Tensor | None) -> Rollout:
        """A new record with frozen model ``name``'s log-probs ``scores`` (into ``ref_logp`` for the
        reference, else ``frozen_logp``; ``None`` leaves another model's unscored)."""
        if name == REFERENCE:
            return replace(self, ref_logp=scores)
        if scores is None:
            return replace(self, frozen_logp={k: v for k, v in self.frozen_logp.items() if k != name})
        return replace(self, frozen_logp={**self.frozen_logp, name: scores})

    def minibatches(self, size: int, generator: torch.Generator | None = None) -> Iterator[Rollout]:
        """Disjoint minibatches of ``size`` rows covering the rollout, shuffled when ``generator``
        is given.
        """
        n = len(self)
        order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
        for start in range(0, n, size):
            yield self.select(order[start : start + size].to(self.completion_ids.device))

    def trimmed(self) -> Rollout:
        """The same rows without the padding columns they all share: leading prompt columns no row uses
        and completion columns after the last one any row attends. Positions come from the masks, so every
        kept token is scored in the same context, at the same position, to the same numbers."""
        if len(self) == 0:
            return self
        used = self.prompt_mask.bool().any(0).nonzero()
        first = int(used[0]) if len(used) else self.prompt_mask.shape[1]
        used = self.attention_mask.bool().any(0).nonzero()
        last = int(used[-1]) + 1 if len(used) else 0
        if first == 0 and last == self.attention_mask.shape[1]:
            return self
        cut: dict[str, Tensor | dict[str, Tensor]] = {
            "frozen_logp": {name: t[:, :last] for name, t in self.frozen_logp.items()}}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.dim() == 2:
                cut[f.name] = value[:, first:] if f.name.startswith("prompt_") else value[:, :last]
        return replace(self, **cut)

    def empty(self) -> Rollout:
        """No rows, every field's shape otherwise kept (a rank's share that ran out)."""
        return self.select(torch.arange(0, device=self.completion_ids.device))

    @classmethod
    def from_generation(cls, gen: Generation, group_ids: Tensor, rewards: Tensor, correct: Tensor, *,
                        temperature: float, mask_truncated: bool = False, outcome: Tensor | None = None,
                        decoupled_rewards: Tensor | None = None) -> Rollout:
        """A rollout of ``gen``, drawn at ``temperature`` (the sampling parameters' the engine was called
        with): the loss counts every sampled token (not observation tokens of episodes, not truncated rows'
        when ``mask_truncated``)."""
        loss_mask = gen.completion_mask if gen.model_mask is None else gen.model_mask
        if mask_truncated:
            loss_mask = loss_mask * (~gen.truncated).long()[:, None]
        return cls(gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask, loss_mask,
                   gen.truncated, gen.lengths, group_ids, rewards, correct, rollout_logp=gen.rollout_logp,
                   model_mask=gen.model_mask, outcome=outcome, decoupled_rewards=decoupled_rewards,
                   temperature=temperature)

    @staticmethod
    def cat(parts: list[Rollout]) -> Rollout:
        """Concatenate rollouts row-wise, padding prompts on the left and completions on the right. Rows drawn
        at different temperatures have no one temperature to be scored at: a ``ValueError`` naming them."""
        if len(parts) == 1:
            return parts[0]
        out: dict[str, Tensor | dict[str, Tensor] | float | None] = {
            "temperature": same_temperature(parts), "frozen_logp": cat_frozen(parts)}
        for f in fields(Rollout):
            if f.name in out:
                continue
            values = [getattr(p, f.name) for p in parts]
            if values[0] is None:
                out[f.name] = None
            elif f.name.startswith("prompt_"):
                out[f.name] = torch.cat(_pad(values, left=True), 0)
            else:
                out[f.name] = torch.cat(_pad(values, left=False), 0)
        offsets = torch.cumsum(torch.tensor([0] + [int(p.group_ids.max()) + 1 for p in parts[:-1]]), 0)
        out["group_ids"] = torch.cat([p.group_ids + int(o) for p, o in zip(parts, offsets, strict=True)])
        return Rollout(**out)


def same_temperature(parts: list[Rollout]) -> float:
    """The one temperature ``parts`` were drawn at; a ``ValueError`` naming each when they differ."""
    temperatures = sorted({p.temperature for p in parts})
    if len(temperatures) > 1:
        raise ValueError(f"cannot concatenate rollouts sampled at different temperatures {temperatures}: "
                         "their tokens would be scored at one temperature, which is not every row's")
    return temperatures[0]


def cat_frozen(parts: list[Rollout]) -> dict[str, Tensor]:
    """Each frozen model's log-probs of ``parts``, concatenated row-wise; a ``ValueError`` naming the models
    when the parts were not scored by the same ones."""
    names = sorted({tuple(sorted(p.frozen_logp)) for p in parts})
    if len(names) > 1:
        raise ValueError(f"cannot concatenate rollouts scored by different frozen models {names}: some rows "
                         "would have no log-probs of a model the others have")
    return {name: torch.cat(_pad([p.frozen_logp[name] for p in parts], left=False), 0) for name in names[0]}


def _take(value: Tensor | dict[str, Tensor] | float | None,
          index: Tensor) -> Tensor | dict[str, Tensor] | float | None:
    """``value``'s rows ``index`` (each model's, for the frozen models' log-probs); a field that is no tensor
    (``None``, the temperature) is the record's."""
    if isinstance(value, dict):
        return {name: t[index] for name, t in value.items()}
    return value[index] if isinstance(value, Tensor) else value


def _pad(values: list[Tensor], left: bool) -> list[Tensor]:
    """Pad 2-D tensors to one width with zeros (ids pad with 0 too: the mask says what is real)."""
    if values[0].dim() < 2:
        return values
    width = max(v.shape[1] for v in values)
    padded = []
    for v in values:
        extra = width - v.shape[1]
        pad = (extra, 0) if left else (0, extra)
        padded.append(torch.nn.functional.pad(v, pad))
    return padded


def merge_stats(stats: Mapping[str, float], extra: Mapping[str, float]) -> dict[str, float]:
    """A new dict: ``stats`` plus ``extra``, summing the values of names in both (e.g. generation time)."""
    out = dict(stats)
    for name, value in extra.items():
        out[name] = out.get(name, 0.0) + value
    return out


def exclude_nonfinite(rollout: Rollout) -> tuple[Rollout, float]:
    """Leave out of the loss any token whose behaviour log-prob or a frozen model's (the reference's and every
    one in ``frozen_logp``) is not finite.

    Only ``loss_mask`` changes: the token stays in the context (``attention_mask``), so the other tokens
    of its row are scored against the same context as their behaviour and frozen log-probs were.
    Returns the rollout (a new record when anything was excluded) and the number of excluded tokens.
    """
    valid = rollout.loss_mask.bool()
    keep = valid
    scored = [t for t in (rollout.old_logp, rollout.ref_logp, *rollout.frozen_logp.values()) if t is not None]
    for logp in scored:
        keep = keep & torch.isfinite(logp)
    excluded = float((valid & ~keep).sum())
    if not excluded:
        return rollout, 0.0
    old, ref = (None if t is None else torch.where(keep, t, 0.0)
                for t in (rollout.old_logp, rollout.ref_logp))
    frozen = {name: torch.where(keep, t, 0.0) for name, t in rollout.frozen_logp.items()}
    return replace(rollout, loss_mask=keep.to(rollout.loss_mask.dtype), old_logp=old, ref_logp=ref,
                   frozen_logp=frozen), excluded


def rollout_stats(rollout: Rollout) -> dict[str, tuple[Tensor, float]]:
    """``rollout/*`` statistics of one (non-empty) rollout as ``{name: (value, weight)}``."""
    n = float(len(rollout))
    rewards = rollout.rewards.float()
    _, inverse = torch.unique_consecutive(rollout.group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    high = rewards.new_full((n_groups,), -torch.inf).scatter_reduce(0, inverse, rewards, "amax")
    low = rewards.new_full((n_groups,), torch.inf).scatter_reduce(0, inverse, rewards, "amin")
    zero_std = (high == low).float()
    return {
        "rollout/reward_mean": (rewards.mean(), n),
        "rollout/reward_std": (rewards.std() if len(rewards) > 1 else rewards.new_zeros(()), n),
        "rollout/correct_frac": (rollout.correct.float().mean(), n),
        "rollout/response_length_mean": (rollout.lengths.float().mean(), n),
        "rollout/truncated_frac": (rollout.truncated.float().mean(), n),
        "rollout/zero_std_group_frac": (zero_std.mean(), float(n_groups)),
    }
