"""Preference losses (pure PyTorch): DPO and its variants on summed sequence log-probs, and the
Bradley-Terry loss of a scalar reward model (:func:`reward_model_loss`).

Part of the contract :mod:`lightning_rl.losses`. A new DPO variant is a function of ``(h, beta,
label_smoothing)``,
``h = (c - rc) - (r - rr)``, registered in ``_DPO_LOSSES`` with its name in :data:`DPO_LOSS_TYPES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from lightning_rl.maths.checks import check_choice, check_range, check_shapes

Tensor = torch.Tensor
DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]
DPO_LOSS_TYPES: tuple[str, ...] = get_args(DPOLossType)


def _dpo_sigmoid(h: Tensor, beta: float, ls: float) -> Tensor:
    # conservative DPO (cDPO): labels flipped with probability ls
    return -(1 - ls) * F.logsigmoid(beta * h) - ls * F.logsigmoid(-beta * h)


def _dpo_robust(h: Tensor, beta: float, ls: float) -> Tensor:
    # rDPO (Chowdhury et al. 2024): unbiased under label noise ls -> note the + on the flipped term
    return (-(1 - ls) * F.logsigmoid(beta * h) + ls * F.logsigmoid(-beta * h)) / (1 - 2 * ls)


_DPO_LOSSES: dict[str, Callable[[Tensor, float, float], Tensor]] = {
    "sigmoid": _dpo_sigmoid,
    "robust": _dpo_robust,
    "ipo": lambda h, beta, ls: (h - 1 / (2 * beta)) ** 2,
    "hinge": lambda h, beta, ls: torch.relu(1 - beta * h),
}


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    *,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO and variants on ``h = (c - rc) - (r - rr)``, averaged over the batch.

    * ``sigmoid``: ``-(1-ls) logsigmoid(beta h) - ls logsigmoid(-beta h)`` (ls = 0: DPO; else cDPO).
    * ``robust``: ``(-(1-ls) logsigmoid(beta h) + ls logsigmoid(-beta h)) / (1 - 2 ls)`` (rDPO).
    * ``ipo``: ``(h - 1 / (2 beta))^2``.  * ``hinge``: ``relu(1 - beta h)``.

    Args:
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps: ``[B]`` summed sequence log-probs.
        beta: > 0. loss_type: one of :data:`DPO_LOSS_TYPES`. label_smoothing: in [0, 0.5).

    Returns:
        ``(loss, metrics)`` with ``rewards/{chosen, rejected, accuracy, margin}``; rewards are
        ``beta * (logp - ref_logp)`` batch means, accuracy is the fraction with chosen > rejected (strict).
    """
    check_shapes("chosen_logps", chosen_logps, ndim=1, rejected_logps=rejected_logps,
                 ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    check_range("beta", beta)
    check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"`label_smoothing` must be in [0, 0.5), got {label_smoothing}")
    chosen = chosen_logps - ref_chosen_logps
    rejected = rejected_logps - ref_rejected_logps
    loss = _DPO_LOSSES[loss_type](chosen - rejected, beta, label_smoothing).mean()
    return loss, _dpo_reward_metrics(chosen, rejected, beta)


@torch.no_grad()
def _dpo_reward_metrics(chosen: Tensor, rejected: Tensor, beta: float) -> dict[str, Tensor]:
    """:func:`dpo_loss`'s metrics from the ``[B]`` log-ratios to the reference of the chosen / rejected
    completions: the implicit rewards ``beta * log-ratio`` (batch means), their margin and the fraction of
    pairs whose chosen reward is strictly higher."""
    r_c, r_r = beta * chosen.detach(), beta * rejected.detach()
    return {
        "rewards/chosen": r_c.mean(),
        "rewards/rejected": r_r.mean(),
        "rewards/accuracy": (r_c > r_r).to(r_c.dtype).mean(),
        "rewards/margin": (r_c - r_r).mean(),
    }


def reward_model_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    margin: Tensor | None = None,
    center_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley-Terry loss of a scalar reward model on preference pairs, averaged over the batch.

    ``loss = -mean(logsigmoid(r_c - r_r - m)) + center_coef * mean((r_c + r_r)^2)``: the margin ``m``
    (Llama 2; TRL's ``margin`` column) asks the chosen reward to win by at least that much, and the
    centering term (TRL's ``center_rewards_coefficient``) pulls each pair's mean reward towards 0.

    Args:
        chosen_rewards, rejected_rewards: ``[B]`` scalar rewards of the chosen / rejected completions.
        margin: ``[B]`` per-pair margins, or ``None`` (0).
        center_coef: weight of the centering penalty, >= 0.

    Returns:
        ``(loss, metrics)`` with ``rm/accuracy`` (fraction with ``r_c > r_r``, strict: ties count as
        wrong), ``rm/margin`` (mean ``r_c - r_r``, without ``m``) and ``rm/chosen`` / ``rm/rejected``
        (mean rewards).
    """
    check_shapes("chosen_rewards", chosen_rewards, ndim=1, rejected_rewards=rejected_rewards, margin=margin)
    if not center_coef >= 0:
        raise ValueError(f"`center_coef` must be >= 0, got {center_coef}")
    diff = chosen_rewards - rejected_rewards
    loss = -F.logsigmoid(diff if margin is None else diff - margin).mean()
    if center_coef > 0:
        loss = loss + center_coef * ((chosen_rewards + rejected_rewards) ** 2).mean()
    with torch.no_grad():
        metrics = {
            "rm/accuracy": (diff > 0).to(diff.dtype).mean(),
            "rm/margin": diff.mean(),
            "rm/chosen": chosen_rewards.mean(),
            "rm/rejected": rejected_rewards.mean(),
        }
    return loss, metrics
