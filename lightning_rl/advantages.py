"""Advantages, KL estimators and reward shaping for RL post-training (pure PyTorch).

Everything here turns rewards and log-probs into the per-sample or per-token numbers the policy
losses of :mod:`lightning_rl.losses` consume; ``losses`` re-exports every public name, so
``from lightning_rl.losses import group_advantages`` keeps working.

Shapes: ``[N]`` per sample (consecutive groups of ``group_size`` share a prompt), ``[B, T]`` per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch

from lightning_rl.checks import check_choice, check_shapes

Tensor = torch.Tensor
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

# delta = ref_logp - logp, on tokens sampled from the policy whose log-prob is `logp`
_KL_FROM_DELTA: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": lambda delta: -delta,
    "k2": lambda delta: 0.5 * delta**2,
    "k3": lambda delta: torch.exp(delta) - delta - 1.0,
}


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    With ``d = ref_logp - logp``: ``k1 = -d``, ``k2 = d^2 / 2``, ``k3 = exp(d) - d - 1`` (unbiased, >= 0).
    The same k3 with ``d = -log r`` is the ``approx_kl`` of an importance ratio ``r``.

    Args:
        logp, ref_logp: ``[B, T]`` log-probs under pi / pi_ref. estimator: one of :data:`KL_ESTIMATORS`.

    Returns:
        ``[B, T]`` per-token estimates.
    """
    check_shapes("logp", logp, ref_logp=ref_logp)
    check_choice("estimator", estimator, KL_ESTIMATORS)
    return _KL_FROM_DELTA[estimator](ref_logp - logp)


def _check_groups(n: int, group_size: int) -> None:
    if group_size < 2 or n % group_size != 0:
        raise ValueError(f"`group_size` must be >= 2 and divide the batch size {n}, got {group_size}")


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
    check_shapes("rewards", rewards, ndim=1)
    _check_groups(rewards.shape[0], group_size)
    grouped = rewards.reshape(-1, group_size)
    grouped = grouped if grouped.is_floating_point() else grouped.float()
    centered = grouped - grouped.mean(-1, keepdim=True)
    if scale:
        centered = centered / (grouped.std(-1, keepdim=True) + eps)
    return centered.reshape(-1)


@torch.no_grad()
def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded token sequences (no gradient).

    ``delta_t = r_t + gamma V_{t+1} - V_t`` (``V`` after the last valid token is 0);
    ``A_t = delta_t + gamma lam A_{t+1}``; ``returns = A + V``. Padding positions are 0 in both outputs.

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
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = (delta + gamma * lam * next_adv) * m[:, t]
        advantages[:, t] = next_adv
        next_value = values[:, t]
    return advantages, (advantages + values) * m


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment per response length ``L`` (with ``e = max_len - cache_len``).

    ``0`` if ``L <= e``; ``(e - L) / cache_len`` if ``e < L <= max_len``; ``-1`` if ``L > max_len``.

    Args:
        lengths: ``[N]`` response lengths. max_len: > 0. cache_len: in [0, max_len] (0: only 0 or -1).

    Returns:
        ``[N]`` float penalties in [-1, 0].
    """
    if max_len <= 0:
        raise ValueError(f"`max_len` must be > 0, got {max_len}")
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"`cache_len` must be in [0, max_len={max_len}], got {cache_len}")
    lengths = torch.as_tensor(lengths)
    lengths = lengths if lengths.is_floating_point() else lengths.to(torch.get_default_dtype())
    expected = max_len - cache_len
    ramp = (expected - lengths) / max(cache_len, 1)  # only used where cache_len > 0
    penalty = torch.where(lengths > expected, ramp, torch.zeros_like(lengths))
    return torch.where(lengths > max_len, -torch.ones_like(lengths), penalty)


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


# ---- PPO: per-token rewards, whitening, the adaptive KL controller, explained variance ----------------
def token_rewards(scores: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards for GAE: ``-kl_coef * kl_t`` on every valid token, plus the sequence score on
    the last valid token of its row (InstructGPT / verl's KL-in-reward form). Rows without a valid token
    get no reward.

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
    lengths = mask.long().sum(1)
    rows = torch.nonzero(lengths > 0).squeeze(1)
    out[rows, lengths[rows] - 1] += scores[rows].float()
    return out


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


def explained_variance(residual_moments: Tensor, returns_moments: Tensor) -> Tensor:
    """``1 - Var(returns - values) / Var(returns)`` from the moments of the residual and of the returns
    (1: the critic predicts the returns; 0: no better than their mean; negative: worse)."""
    _, var_res = moments_mean_var(residual_moments)
    _, var_ret = moments_mean_var(returns_moments)
    return 1.0 - var_res / var_ret.clamp_min(1e-12)


def adaptive_kl_coef(coef: float, kl: float, target: float, n_steps: int, horizon: int) -> float:
    """Ziegler et al. (2019)'s proportional controller, as in TRL / verl: the KL coefficient after a batch
    of ``n_steps`` samples whose mean KL (summed over tokens) was ``kl``.

    ``coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon)``.
    """
    if not target > 0 or not horizon > 0:
        raise ValueError(f"`kl_target` and `kl_horizon` must be > 0, got {target} and {horizon}")
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)
