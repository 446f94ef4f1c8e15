"""Rollout-engine correction (pure PyTorch): importance weights from the policy that sampled (the rollout
engine, whose log-probs differ from the trainer's through kernels and precision) to the trainer's, and how
far the two are apart.

:func:`rollout_is_weights` gives the per-token weights (TIS: truncated, MIS: masked) that the policy losses
of :mod:`lightning_rl.maths.losses` take as ``token_weights``; :func:`rollout_mismatch_stats` the metrics.
Part of the contract :mod:`lightning_rl.losses`.

Shapes: ``[B, T]`` per token.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch

from lightning_rl.maths.checks import check_choice, check_shapes
from lightning_rl.maths.penalties import kl_penalty

Tensor = torch.Tensor
RolloutISLevel = Literal["token", "sequence"]
ROLLOUT_IS_LEVELS: tuple[str, ...] = get_args(RolloutISLevel)
RolloutISMode = Literal["truncate", "mask"]
ROLLOUT_IS_MODES: tuple[str, ...] = get_args(RolloutISMode)
ROLLOUT_LOG_WEIGHT_MAX = 20.0  # exp(20) ~ 4.9e8: far above any sensible cap, far below float32's max


def _rollout_log_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """``log w`` per token (float32 or wider, not clamped), 0 on invalid tokens."""
    check_shapes("old_logp", old_logp, ndim=2, rollout_logp=rollout_logp, mask=mask)
    check_choice("level", level, ROLLOUT_IS_LEVELS)
    mask = mask.bool()
    dtype = torch.promote_types(old_logp.dtype, torch.float32)
    # zeroed before any sum or exp: garbage (inf/NaN) on invalid tokens cannot leak
    diff = torch.where(mask, old_logp.detach().to(dtype) - rollout_logp.detach().to(dtype), 0.0)
    if level == "sequence":
        diff = torch.where(mask, diff.sum(-1, keepdim=True), 0.0)
    return diff


@torch.no_grad()
def rollout_is_weights(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, level: str = "token", mode: str = "truncate",
    cap: float = 2.0,
) -> Tensor:
    """Importance weights from the rollout engine's policy to the trainer's, detached (TIS / MIS).

    Token level ``w_it = exp(old_logp_it - rollout_logp_it)``; sequence level
    ``w_i = exp(sum_t m_it (old_logp_it - rollout_logp_it))`` on every valid token of row ``i``.
    ``truncate``: ``min(w, cap)``; ``mask``: ``w`` where ``w <= cap``, else 0 (the token, or the whole
    row at sequence level, is dropped). The exponent is clamped at 20 before ``exp`` (no overflow); the
    result is exact for any ``cap < e^20``.

    Args:
        old_logp: ``[B, T]`` trainer log-probs of the sampled tokens (behaviour policy, recomputed).
        rollout_logp: ``[B, T]`` the sampler's log-probs of the same tokens. mask: ``[B, T]``.
        level: ``token`` or ``sequence``. mode: ``truncate`` or ``mask``. cap: >= 1 (on-policy w = 1 stays).

    Returns:
        ``[B, T]`` float32 (float64 if the inputs are), no gradient, 0 on invalid tokens.
    """
    check_choice("mode", mode, ROLLOUT_IS_MODES)
    if not cap >= 1.0:
        raise ValueError(f"`cap` must be >= 1, got {cap}")
    log_weight = _rollout_log_weights(old_logp, rollout_logp, mask, level)
    weight = torch.exp(log_weight.clamp(max=ROLLOUT_LOG_WEIGHT_MAX))
    weight = weight.clamp(max=cap) if mode == "truncate" else torch.where(weight <= cap, weight, 0.0)
    return torch.where(mask.bool(), weight, 0.0)


@torch.no_grad()
def rollout_mismatch_stats(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, weights: Tensor, cap: float, *, level: str = "token"
) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs are from the trainer's, over valid tokens (detached scalars).

    * ``rollout/logp_diff_mean``: mean ``|old_logp - rollout_logp|``.
    * ``rollout/mismatch_k3``: mean k3 estimate of KL(engine || trainer) from the engine's samples,
      ``exp(d) - d - 1`` with ``d = old_logp - rollout_logp`` (``kl_penalty(rollout_logp, old_logp)``),
      i.e. ``(w - 1) - log w`` of the token weight; >= 0, 0 when the two agree (``d`` clamped at 20).
    * ``rollout/is_weight_mean``: mean of ``weights`` (as applied, after truncation or masking).
    * ``rollout/is_clipped_frac``: fraction of tokens whose raw weight at ``level`` exceeded ``cap``.

    Args:
        old_logp, rollout_logp, mask, weights: ``[B, T]``; ``weights`` from :func:`rollout_is_weights`.
        cap: the cap the weights were computed with. level: theirs (``token`` or ``sequence``).
    """
    check_shapes("old_logp", old_logp, ndim=2, rollout_logp=rollout_logp, mask=mask, weights=weights)
    if not cap >= 1.0:
        raise ValueError(f"`cap` must be >= 1, got {cap}")
    mask = mask.bool()
    token = _rollout_log_weights(old_logp, rollout_logp, mask, "token")
    raw = token if level == "token" else _rollout_log_weights(old_logp, rollout_logp, mask, level)
    count, zero = mask.sum().clamp_min(1), torch.zeros_like(token)

    def mean(x: Tensor) -> Tensor:
        return torch.where(mask, x.to(token.dtype), 0.0).sum() / count

    return {
        "rollout/logp_diff_mean": mean(token.abs()),
        "rollout/mismatch_k3": mean(kl_penalty(zero, token.clamp(max=ROLLOUT_LOG_WEIGHT_MAX), "k3")),
        "rollout/is_weight_mean": mean(weights.detach()),
        "rollout/is_clipped_frac": mean(raw > math.log(cap)),
    }
