"""Advantage estimators and the KL-in-reward penalty: stages of the RL step around ``advantages.py``.

An estimator is applied once per step, after filtering, on every rank (some make one all-reduce, which
every rank makes whatever its rows): ``estimator(rollout, collectives) -> (advantages, statistics)``, with
advantages ``[N]`` (per sequence) or ``[N, C]`` (per token, 0 outside ``loss_mask``). Name one in YAML
as ``model.init_args.advantage`` (``class_path`` + ``init_args``). The maths is in
:mod:`lightning_rl.maths.advantages`; here is only what the step needs around it.

Group estimators read one score per sample: ``rollout.rewards``, or the row sums of
``rollout.token_rewards`` when a KL penalty is in the reward (verl's form).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from lightning_rl.maths.advantages import (
    explained_variance,
    gae_advantages,
    group_advantages,
    masked_moments,
    moments_mean_var,
    reinforce_baseline_centered,
    rloo_advantages,
    token_rewards,
    whiten,
)
from lightning_rl.maths.multi_reward import batch_normalized, sequence_moments
from lightning_rl.maths.penalties import FixedKL, KLController, kl_penalty
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.filters import group_size
from lightning_rl.step.rollout import Rollout


def sequence_scores(rollout: Rollout) -> Tensor:
    """One score per sample: the reward, or the row sum of per-token rewards when they exist."""
    if rollout.token_rewards is not None:
        return (rollout.token_rewards * rollout.loss_mask).sum(-1)
    return rollout.rewards.float()


Estimate = tuple[dict[str, Tensor], dict[str, float]]  # the rollout fields an estimator sets, its statistics


class AdvantageEstimator:
    """The estimator seam: subclass it and implement :meth:`estimate`. ``min_group_size``: the smallest
    ``num_generations`` it can work with."""

    min_group_size: int = 2
    decouple_eps: float | None = None  # GDPO: the rewards stage normalises each function within its group

    def __call__(self, rollout: Rollout, collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        """The stage: a new rollout with the estimate's fields set (the input is left as it was)."""
        fields, stats = self.estimate(rollout, collectives)
        return replace(rollout, **fields), stats

    def estimate(self, rollout: Rollout, collectives: Collectives) -> Estimate:
        """``{"advantages": [N] or [N, C]}`` (GAE adds ``"returns"``) and statistics."""
        raise NotImplementedError


class GroupNormalized(AdvantageEstimator):
    """GRPO's group-relative advantage: ``(r - group mean) / (group std + eps)``; ``scale=False`` keeps
    ``r - group mean`` (Dr. GRPO)."""

    def __init__(self, scale: bool = True, eps: float = 1e-8) -> None:
        self.scale, self.eps = scale, eps

    def estimate(self, rollout: Rollout, collectives: Collectives) -> Estimate:
        if not len(rollout):
            return {"advantages": rollout.rewards.new_zeros(0)}, {}
        scores = sequence_scores(rollout)
        return {"advantages": group_advantages(scores, group_size(rollout), self.eps, self.scale)}, {}


class GDPO(AdvantageEstimator):
    """GDPO (Liu et al., 2026; TRL ``multi_objective_aggregation="normalize_then_sum"``, verl ``gdpo``,
    NeMo-RL ``GDPOAdvantageEstimator``): each reward function's scores are z-scored within the group, summed
    with ``model.rewards.weights`` (the rewards stage does this on whole groups:
    ``rollout.decoupled_rewards``), and the sum is normalised over the global batch of sequences after
    filtering (one all-reduce).

    Scores that GRPO's weighted sum ties keep distinct advantages: (1, 0) against (0, 2) under weights 1 and
    0.5 (sums 1 and 1: GRPO 0 and 0; GDPO +0.35 and -0.35 before the batch step), or groups (0,0)/(0,1) and
    (0,0)/(1,1), which GRPO gives the same advantages.

    As TRL: Bessel stds, ``eps`` = 1e-4 under both, the batch step over sequences and every rank (verl whitens
    over tokens, NeMo-RL's ``eps`` is 1e-6); ``batch_normalize: false`` keeps the decoupled sum as it is.
    Failed samples (``on_error: zero``) count with score 0, as in the summed reward.
    """

    def __init__(self, eps: float = 1e-4, batch_normalize: bool = True) -> None:
        if not eps > 0:
            raise ValueError(f"`model.advantage.init_args.eps` must be > 0, got {eps}")
        self.decouple_eps, self.batch_normalize = eps, batch_normalize

    def estimate(self, rollout: Rollout, collectives: Collectives) -> Estimate:
        x = rollout.decoupled_rewards
        if x is None:
            raise ValueError("GDPO advantages need the rewards stage's per-group decoupled sums "
                             "(`rollout.decoupled_rewards`): build the module with `model.advantage` GDPO")
        x = x.float()
        if self.batch_normalize:
            moments = collectives.sum(sequence_moments(x))  # every rank, whatever its rows
            x = batch_normalized(x, self.decouple_eps, moments)
        return {"advantages": x}, {}


class LeaveOneOut(AdvantageEstimator):
    """REINFORCE leave-one-out (Ahmadian et al., 2024): ``r_i - mean of the other G - 1 rewards``."""

    def estimate(self, rollout: Rollout, collectives: Collectives) -> Estimate:
        if not len(rollout):
            return {"advantages": rollout.rewards.new_zeros(0)}, {}
        return {"advantages": rloo_advantages(sequence_scores(rollout), group_size(rollout))}, {}


class ReinforceBaseline(AdvantageEstimator):
    """REINFORCE++-baseline (Hu et al., 2025): the group mean subtracted, then whitened over every valid
    token of the global batch (one all-reduce of the moments, on every rank)."""

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps

    def estimate(self, rollout: Rollout, collectives: Collectives) -> Estimate:
        mask = rollout.loss_mask
        centred = mask.new_zeros(mask.shape).float()
        if len(rollout):
            centred = reinforce_baseline_centered(sequence_scores(rollout), group_size(rollout), mask)
        moments = collectives.sum(masked_moments(centred, mask))  # every rank, whatever its rows
        # reinforce_baseline_advantages(..., moments=moments), without centring the rewards twice
        return {"advantages": whiten(centred, mask, moments, self.eps)}, {}


class GAE(AdvantageEstimator):
    """Generalised advantage estimation on the critic's values (``rollout.values``), per token.

    Rewards per token: ``rollout.token_rewards``, or the score on the last valid token. Advantages are
    whitened over all valid tokens of all ranks (``whiten``); one all-reduce of every statistic.

    Args:
        gamma, lam: discount and GAE lambda, in [0, 1].
        whiten: normalise advantages to mean 0, std 1 over the global batch.
    """

    min_group_size = 1

    def __init__(self, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True) -> None:
        for key, value in {"gamma": gamma, "lam": lam}.items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"`model.advantage.init_args.{key}` must be in [0, 1], got {value}")
        self.gamma, self.lam, self.whiten = gamma, lam, whiten

    def estimate(self, rollout: Rollout, collectives: Collectives) -> Estimate:
        if rollout.values is None:
            raise ValueError("GAE needs the critic's values (`rollout.values`): use it with a critic (PPO)")
        mask, values = rollout.loss_mask, rollout.values
        rewards = rollout.token_rewards if rollout.token_rewards is not None else token_rewards(
            rollout.rewards, mask)
        advantages, returns = gae_advantages(rewards, values, mask, self.gamma, self.lam)
        local = torch.cat([masked_moments(advantages, mask), masked_moments(values, mask),
                           masked_moments(returns, mask), masked_moments(returns - values, mask)])
        total = collectives.sum(local)
        adv_m, val_m, ret_m, res_m = total[0:3], total[3:6], total[6:9], total[9:12]
        if self.whiten:
            advantages = whiten(advantages, mask, adv_m)
        adv_mean, adv_var = moments_mean_var(adv_m)
        stats = {"critic/value_mean": float(moments_mean_var(val_m)[0]),
                 "critic/returns_mean": float(moments_mean_var(ret_m)[0]),
                 "critic/explained_variance": float(explained_variance(res_m, ret_m)),
                 "rollout/advantages_mean": float(adv_mean), "rollout/advantages_std": float(adv_var.sqrt())}
        return {"advantages": advantages.float(), "returns": returns}, stats


class KLInReward:
    """The KL to the reference as a per-token penalty in the reward (InstructGPT / verl), its coefficient
    moved after each rollout by ``controller`` (its value is saved in checkpoints).

    Args:
        coef: the KL weight (the controller's starting value).
        estimator: per-token KL estimate (``k1`` = log-ratio, InstructGPT's).
        controller: :class:`~lightning_rl.maths.penalties.FixedKL` (``None`` too) or
            :class:`~lightning_rl.maths.penalties.AdaptiveKL` (towards a target mean per-sequence KL).
    """

    def __init__(self, coef: float, estimator: str = "k1", controller: KLController | None = None) -> None:
        self.value, self.estimator, self.controller = coef, estimator, controller or FixedKL()

    def __call__(self, rollout: Rollout, collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        """The rollout with its ``[N, C]`` per-token rewards (the coefficient used is the one before this
        rollout's update), and the mean KL and coefficient."""
        mask = rollout.loss_mask
        kl = kl_penalty(rollout.old_logp, rollout.ref_logp, self.estimator) * mask
        rewards = token_rewards(rollout.rewards, mask, kl, self.value)
        sums = collectives.sum(torch.stack([kl.sum().double(), torch.tensor(float(len(rollout))).double()
                                            .to(kl.device)]))
        mean_kl = float(sums[0] / sums[1].clamp_min(1))
        stats = {"policy/kl_in_reward": mean_kl, "policy/kl_coef": self.value}
        self.value = self.controller.next_value(self.value, mean_kl, int(sums[1]))
        return replace(rollout, token_rewards=rewards), stats

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]
