"""Advantages and their statistics for RL post-training (pure PyTorch).

Everything here turns rewards (and a critic's values) into the per-sample or per-token advantages the policy
losses of :mod:`lightning_rl.maths.losses` consume: group-relative (GRPO, RLOO, REINFORCE++-baseline), GAE
with PPO's per-token rewards and whitening, and DAPO's group filter. The KL estimators and reward penalties
live in :mod:`lightning_rl.maths.penalties`, the rollout-engine importance weights in
:mod:`lightning_rl.maths.rollout_weights`. The contract functions are also importable from
:mod:`lightning_rl.losses`.

Shapes: ``[N]`` per sample (consecutive groups of ``group_size`` share a prompt), ``[B, T]`` per token.
"""

from __future__ import annotations

import torch

from lightning_rl.maths.checks import check_shapes

Tensor = torch.Tensor


def _check_groups(n: int, group_size: int) -> None:
    if group_size < 2 or n % group_size != 0:
        raise ValueError(f"`group_size` must be >= 2 and divide the batch size {n}, got {group_size}")


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """``[N / G, G]`` float view of 1-D rewards in consecutive groups (checked)."""
    check_shapes("rewards", rewards, ndim=1)
    _check_groups(rewards.shape[0], group_size)
    grouped = rewards.reshape(-1, group_size)
    return grouped if grouped.is_floating_point() else grouped.float()


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-8, scale: bool = True) -> Tensor:
    """GRPO group-relative advantages: ``(r - mean_g) / (std_g + eps)`` per consecutive group of
    ``group_size``.

    ``std_g`` is Bessel-corrected (as ``torch.std``). ``scale=False`` gives ``r - mean_g`` (Dr. GRPO).
    A group of equal rewards gets advantage 0.

    Args:
        rewards: ``[N]``, ``N`` a multiple of ``group_size``; groups are consecutive.

    Returns:
        ``[N]`` advantages (floating point).
    """
    grouped = _grouped(rewards, group_size)
    centered = grouped - grouped.mean(-1, keepdim=True)
    if scale:
        centered = centered / (grouped.std(-1, keepdim=True) + eps)
    return centered.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO (leave-one-out) advantages: ``A_i = r_i - (sum_g - r_i) / (G - 1)`` per consecutive group.

    Each sample's baseline is the mean of the other ``G - 1`` rewards of its group, so it is independent of
    the sample itself; ``A_i = G / (G - 1) * (r_i - mean_g)``. A group of equal rewards gets 0.

    Args:
        rewards: ``[N]``, ``N`` a multiple of ``group_size`` (>= 2); groups are consecutive.

    Returns:
        ``[N]`` advantages (floating point).
    """
    grouped = _grouped(rewards, group_size)
    others = grouped.sum(-1, keepdim=True) - grouped
    return (grouped - others / (group_size - 1)).reshape(-1)


@torch.no_grad()
def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded token sequences (no gradient).

    ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V`` after the last valid token is 0);
    ``A_t = delta_t + gamma lam A_{t+1}``; ``returns = A + V``. Padding positions are 0 in both outputs.
    ``t+1`` is the next *valid* token: positions outside ``mask`` inside a row (an episode's observation
    tokens, which the model did not sample) are skipped, as if the valid tokens were contiguous.

    Args:
        rewards, values, mask: ``[B, T]`` (per-token rewards).
        gamma, lam: in [0, 1].

    Returns:
        ``(advantages, returns)``, each ``[B, T]``.
    """
    check_shapes("rewards", rewards, ndim=2, values=values, mask=mask)
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"`{name}` must be in [0, 1], got {value}")
    m = mask.to(values.dtype)
    values, rewards = values * m, rewards * m
    advantages = torch.zeros_like(values)
    next_value = next_adv = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        valid = m[:, t] > 0  # invalid tokens are skipped, not ends: an episode's observations are transparent
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = torch.where(valid, delta + gamma * lam * next_adv, next_adv)
        advantages[:, t] = next_adv * m[:, t]
        next_value = torch.where(valid, values[:, t], next_value)
    return advantages, (advantages + values) * m


@torch.no_grad()
def distillation_advantages(
    teacher_logp: Tensor, student_logp: Tensor, mask: Tensor, coef: float = 1.0, discount: float = 0.0
) -> Tensor:
    """On-policy distillation's per-token advantages: the negative reverse KL to the teacher on the
    student's own samples, ``r_t = coef * (teacher_logp_t - student_logp_t)``, summed over later tokens
    with ``discount``: ``A_t = sum_{k >= t} discount^(k - t) r_k`` (``discount`` 0: ``A_t = r_t``, the
    Tinker cookbook's default; 1: the reverse KL of the rest of the sequence).

    ``k - t`` counts valid tokens only: positions outside ``mask`` inside a row (an episode's observation
    tokens) are skipped, as GAE skips them (this is :func:`gae_advantages` with ``V = 0``, ``lam = 1``).
    ``-sum_t r_t / coef`` of a row is the sampled estimate of KL(student || teacher) of that sequence.

    Args:
        teacher_logp, student_logp: ``[B, T]`` log-probs of the sampled tokens under the teacher and under
            the policy that sampled them, at the sampling temperature.
        mask: ``[B, T]`` 1 on the tokens that count. coef: > 0. discount: in [0, 1].

    Returns:
        ``[B, T]`` float, 0 outside ``mask``, no gradient.
    """
    check_shapes("teacher_logp", teacher_logp, ndim=2, student_logp=student_logp, mask=mask)
    if not coef > 0 or not 0.0 <= discount <= 1.0:
        raise ValueError(f"`coef` must be > 0 and `discount` in [0, 1], got {coef} and {discount}")
    m = mask.bool()
    per_token = torch.where(m, coef * (teacher_logp.float() - student_logp.float()), 0.0)
    if discount == 0.0:
        return per_token
    return gae_advantages(per_token, torch.zeros_like(per_token), m, gamma=discount, lam=1.0)[0]


def dapo_group_keep(correct: Tensor, group_size: int) -> Tensor:
    """DAPO dynamic sampling: keep groups that are neither all-correct nor all-wrong.

    Args:
        correct: ``[N]`` bool or 0/1, consecutive groups of ``group_size``.

    Returns:
        ``[N // group_size]`` bool, True where ``0 < #correct < group_size``.
    """
    check_shapes("correct", correct, ndim=1)
    _check_groups(correct.shape[0], group_size)
    n_correct = correct.bool().reshape(-1, group_size).sum(-1)
    return (n_correct > 0) & (n_correct < group_size)


def group_spread(values: Tensor, group_size: int) -> Tensor:
    """The groups whose values are not all equal (DAPO's filter on a general outcome: for 0 / 1 values
    exactly :func:`dapo_group_keep`).

    Args:
        values: ``[N]`` float, bool or 0/1, consecutive groups of ``group_size``.

    Returns:
        ``[N // group_size]`` bool, True where the group's largest value exceeds its smallest.
    """
    check_shapes("values", values, ndim=1)
    _check_groups(values.shape[0], group_size)
    grouped = values.float().reshape(-1, group_size)
    return grouped.amax(-1) > grouped.amin(-1)


# ---- PPO: per-token rewards, whitening, explained variance -------------------------------------------
def token_rewards(scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards for GAE: ``-kl_coef * kl_t`` on every valid token, plus the sequence score on
    the last valid token of its row (InstructGPT / verl's KL-in-reward form; with holes in ``mask``, the
    last one inside it). Rows without a valid token get no reward.

    Args:
        scores: ``[B]`` sequence rewards. mask: ``[B, T]`` valid completion tokens (right-padded).
        kl: ``[B, T]`` per-token KL to the reference (e.g. ``kl_penalty(..., "k1")``), or None.
        kl_coef: its weight (>= 0).

    Returns:
        ``[B, T]`` float rewards, 0 on padding.
    """
    check_shapes("mask", mask, ndim=2, kl=kl)
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"`scores` has shape {tuple(scores.shape)}, expected ({mask.shape[0]},)")
    m = mask.to(torch.float32)
    out = torch.zeros_like(m)
    if kl is not None and kl_coef:
        out = out - kl_coef * kl.float() * m
    last = last_valid_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] += scores[rows].float()
    return out


def last_valid_index(mask: Tensor) -> Tensor:
    """``[B]`` long: each row's last position inside ``mask`` (-1 for a row without one; holes allowed)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).amax(1)


def masked_moments(x: Tensor, mask: Tensor) -> Tensor:
    """``[sum, sum of squares, count]`` of ``x`` over ``mask`` (float64, to be summed over ranks)."""
    check_shapes("x", x, mask=mask)
    m = mask.bool()
    v = x.detach().double()[m]
    return torch.stack([v.sum(), (v * v).sum(), v.new_tensor(float(v.numel()))])


def moments_mean_var(moments: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and unbiased variance from :func:`masked_moments` (summed over any number of ranks)."""
    total, total_sq, count = moments.unbind()
    mean = total / count.clamp_min(1)
    var = (total_sq - count * mean * mean) / (count - 1).clamp_min(1)
    return mean, var.clamp_min(0)


def whiten(x: Tensor, mask: Tensor, moments: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` on valid tokens, 0 on padding.

    ``moments`` (from :func:`masked_moments`, summed over ranks) makes the statistics those of the whole
    global batch; ``None`` uses ``x``'s own.
    """
    mean, var = moments_mean_var(masked_moments(x, mask) if moments is None else moments)
    out = (x - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def reinforce_baseline_centered(rewards: Tensor, group_size: int, mask: Tensor) -> Tensor:
    """REINFORCE++-baseline before whitening: ``x_it = r_i - mean_g`` on each valid token of row ``i``.

    A distributed caller sums ``masked_moments(x, mask)`` over ranks and passes it to
    :func:`reinforce_baseline_advantages` as ``moments``.

    Args:
        rewards: ``[B]`` sequence rewards in consecutive groups of ``group_size`` (>= 2, divides ``B``).
        mask: ``[B, T]`` valid completion tokens (bool or 0/1).

    Returns:
        ``[B, T]`` float, 0 on invalid tokens.
    """
    check_shapes("mask", mask, ndim=2)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(f"`rewards` has shape {tuple(rewards.shape)}, expected ({mask.shape[0]},)")
    centered = group_advantages(rewards, group_size, scale=False)
    return torch.where(mask.bool(), centered.unsqueeze(-1), 0.0)


def reinforce_baseline_advantages(
    rewards: Tensor, group_size: int, mask: Tensor, eps: float = 1e-8, *, moments: Tensor | None = None
) -> Tensor:
    """REINFORCE++-baseline advantages: ``(x - mean) / sqrt(var + eps)`` on valid tokens, 0 elsewhere.

    ``x = r_i - mean_g`` broadcast over row ``i``'s valid tokens (:func:`reinforce_baseline_centered`);
    ``mean`` and the Bessel-corrected ``var = (sum x^2 - n mean^2) / (n - 1)`` are over all ``n`` valid
    tokens of the batch (so longer rows weigh more), as verl's ``masked_whiten``.

    Args:
        rewards: ``[B]``, consecutive groups of ``group_size``. mask: ``[B, T]``. eps: added to ``var``.
        moments: ``[sum, sum of squares, count]`` of ``x`` over the global batch, i.e.
            ``masked_moments(reinforce_baseline_centered(...), mask)`` summed over ranks; None uses this
            batch's own.

    Returns:
        ``[B, T]`` float advantages.
    """
    return whiten(reinforce_baseline_centered(rewards, group_size, mask), mask, moments, eps)


def explained_variance(residual_moments: Tensor, returns_moments: Tensor) -> Tensor:
    """``1 - Var(returns - values) / Var(returns)`` from the moments of the residual and of the returns
    (1: the critic predicts the returns; 0: no better than their mean; negative: worse)."""
    _, var_res = moments_mean_var(residual_moments)
    _, var_ret = moments_mean_var(returns_moments)
    return 1.0 - var_res / var_ret.clamp_min(1e-12)
