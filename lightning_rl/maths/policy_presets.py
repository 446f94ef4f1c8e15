"""The contract's policy losses as presets of :func:`~lightning_rl.maths.losses.policy_loss` (pure PyTorch).

``ppo_policy_loss`` (PPO's clip, dual clip), ``dapo_loss`` (clip-higher), ``grpo_loss`` (clip and a KL to
the reference), ``gspo_loss`` (the sequence-level ratio) and ``sapo_loss`` (the soft gate): each names a
point on the axes of ``policy_loss`` under its paper's argument names and computes nothing of its own.
Shapes and metrics as in :mod:`lightning_rl.maths.losses`. Part of the contract :mod:`lightning_rl.losses`.
"""

from __future__ import annotations

import torch

from lightning_rl.maths.aggregation import Aggregation, Count
from lightning_rl.maths.checks import check_range
from lightning_rl.maths.losses import policy_loss
from lightning_rl.maths.penalties import KLEstimator
from lightning_rl.maths.trust_regions import Clip, SoftGate

__all__ = ["dapo_loss", "grpo_loss", "gspo_loss", "ppo_policy_loss", "sapo_loss"]

Tensor = torch.Tensor


def _clip(low: tuple[str, float], high: tuple[str, float], dual_clip: float | None = None) -> Clip:
    """The clip trust region from a preset's ``(argument name, value)`` pairs, validated under those names."""
    check_range(low[0], low[1], high=1.0)
    check_range(high[0], high[1])
    if dual_clip is not None:
        check_range("clip_ratio_c", dual_clip, low=1.0)
    return Clip(low=low[1], high=high[1], dual_clip=dual_clip)


def _ppo_clip(clip_eps: float, clip_eps_high: float | None, clip_ratio_c: float | None) -> Clip:
    """The clip trust region from PPO's argument names (``clip_eps_high`` None: ``clip_eps``)."""
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    return _clip(("clip_eps", clip_eps), ("clip_eps_high", eps_high), clip_ratio_c)


def ppo_policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float = 0.2,
    aggregation: Aggregation = "token-mean", *, clip_eps_high: float | None = None,
    clip_ratio_c: float | None = None, num_tokens: Count = None, num_seqs: Count = None,
    aggregation_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate: ``aggregate(-min(r A, clip(r, 1-eps, 1+eps_high) A))``,
    ``r = exp(logp - old_logp)``; dual clip (``clip_ratio_c = c > 1``) caps the loss at ``-c A`` for A < 0.

    Args:
        clip_eps: lower (and default upper) clip range, in (0, 1).
        clip_eps_high: upper range (None: clip_eps).
        aggregation: one of :data:`AGGREGATIONS`. clip_ratio_c: dual-clip constant ``c > 1`` or None (off).
        num_tokens, num_seqs: whole-minibatch normalisers (see :func:`aggregate`).
        aggregation_length: the constant ``L`` of ``seq-mean-token-sum-norm`` (``None``: ``T``).

    Returns:
        ``(loss, metrics)`` with ``policy/{clip_frac, clip_frac_low, clip_frac_high, approx_kl, ratio_mean}``
        and ``policy/clip_frac_dual`` when dual clip is on.
    """
    clip = _ppo_clip(clip_eps, clip_eps_high, clip_ratio_c)
    return policy_loss(logp, old_logp, None, advantages, mask, trust_region=clip,
                       aggregation=aggregation, num_tokens=num_tokens, num_seqs=num_seqs,
                       aggregation_length=aggregation_length)


def dapo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 0.2,
    clip_high: float = 0.28, aggregation: Aggregation = "token-mean", *, clip_ratio_c: float | None = None,
    num_tokens: Count = None, num_seqs: Count = None, aggregation_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DAPO: PPO clip with the decoupled ("clip-higher") range ``[1 - clip_low, 1 + clip_high]``.

    Same shapes, options and metrics as :func:`ppo_policy_loss`.
    """
    clip = _clip(("clip_low", clip_low), ("clip_high", clip_high), clip_ratio_c)
    return policy_loss(logp, old_logp, None, advantages, mask, trust_region=clip,
                       aggregation=aggregation, num_tokens=num_tokens, num_seqs=num_seqs,
                       aggregation_length=aggregation_length)


def grpo_loss(
    logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor, mask: Tensor,
    clip_eps: float = 0.2, beta: float = 0.04, aggregation: Aggregation = "seq-mean-token-mean", *,
    clip_eps_high: float | None = None, clip_ratio_c: float | None = None, kl_estimator: KLEstimator = "k3",
    num_tokens: Count = None, num_seqs: Count = None, aggregation_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO: ``-aggregate(min(r A, clip(r) A) - beta * KL_t)``, ``KL_t = kl_penalty(logp, ref_logp)``.

    Args:
        ref_logp: ``[B, T]`` reference log-probs; may be ``None`` only when ``beta == 0``.
        beta: KL coefficient, >= 0.
        kl_estimator: one of :data:`KL_ESTIMATORS` (default k3, as in the GRPO paper).
        Others: as in :func:`ppo_policy_loss` (default aggregation is per-sequence token mean).

    Returns:
        ``(loss, metrics)``: the PPO metrics plus ``policy/kl_ref`` when ``ref_logp`` is given.
    """
    if beta < 0:
        raise ValueError(f"`beta` must be >= 0, got {beta}")
    if ref_logp is None and beta != 0:
        raise ValueError(f"`ref_logp` is None but beta={beta}; pass ref_logp or set beta=0")
    clip = _ppo_clip(clip_eps, clip_eps_high, clip_ratio_c)
    return policy_loss(logp, old_logp, ref_logp, advantages, mask, trust_region=clip,
                       aggregation=aggregation, kl_coef=beta,
                       kl_estimator=kl_estimator, num_tokens=num_tokens, num_seqs=num_seqs,
                       aggregation_length=aggregation_length)


def gspo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_low: float = 3e-4,
    clip_high: float = 4e-4, *, num_seqs: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: sequence-level ratio ``s_i = exp(sum_t m_it (logp - old_logp)_it / sum_t m_it)``;
    ``loss = -mean_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)`` over rows with a valid token.

    The same computation as training's ``ratio_level: sequence`` (GSPO-token, equal in value and gradient).

    Args:
        advantages: ``[B]``, or ``[B, T]`` constant per row (the row's masked mean over valid tokens is used).
        num_seqs: whole-minibatch count of non-empty rows (micro-batching).
        Others: as in :func:`ppo_policy_loss`.

    Returns:
        ``(loss, metrics)``: ``policy/{clip_frac, clip_frac_low, clip_frac_high, ratio_mean, approx_kl}`` are
        means over sequences, i.e. over what the sequence ratio clips (``ratio_mean`` = mean of ``s_i``,
        ``approx_kl`` = mean of ``(s_i - 1) - log s_i``).
    """
    clip = _clip(("clip_low", clip_low), ("clip_high", clip_high))
    return policy_loss(logp, old_logp, None, advantages, mask, ratio_level="sequence", trust_region=clip,
                       aggregation="seq-mean-token-mean", num_seqs=num_seqs)


def sapo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, tau_pos: float = 1.0,
    tau_neg: float = 1.05, aggregation: Aggregation = "seq-mean-token-mean", *, num_tokens: Count = None,
    num_seqs: Count = None, aggregation_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO soft gate: ``loss = -aggregate(f(r) A)``, ``f(r) = 4 / tau * sigmoid(tau (r - 1))``,
    ``tau = tau_pos if A > 0 else tau_neg`` (see :func:`soft_gate_surrogate`).

    Returns:
        ``(loss, metrics)`` with ``policy/{gate_weight_mean, approx_kl, ratio_mean}``.
    """
    check_range("tau_pos", tau_pos)
    check_range("tau_neg", tau_neg)
    gate = SoftGate(tau_pos, tau_neg)
    return policy_loss(logp, old_logp, None, advantages, mask, trust_region=gate,
                       aggregation=aggregation, num_tokens=num_tokens,
                       num_seqs=num_seqs, aggregation_length=aggregation_length)
