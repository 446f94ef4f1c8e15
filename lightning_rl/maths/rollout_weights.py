"""Rollout-engine correction (pure PyTorch): importance weights from the policy that sampled (the rollout
engine, whose log-probs differ from the trainer's through kernels and precision) to the trainer's, and how
far the two are apart.

:func:`rollout_is_weights` gives the per-token weights (TIS: truncated, MIS: masked) that the policy losses
of :mod:`lightning_rl.maths.losses` take as ``token_weights``; :func:`rollout_mismatch_stats` the metrics.
Part of the contract :mod:`lightning_rl.losses`.

The peers' corrections as calls here (``lo``, ``hi`` the peer's bounds):

* TRL ``vllm_importance_sampling_mode``: ``token_truncate`` / ``token_mask`` / ``sequence_truncate`` /
  ``sequence_mask`` with ``clip_min``, ``clip_max``: ``level`` token / sequence (the product ratio), ``mode``
  truncate / mask, ``low=clip_min or 0``, ``high=clip_max``.
* OpenRLHF ``vllm_is_correction_type``: ``tis`` is ``level="token", mode="truncate", low=lo, high=hi``;
  ``icepop`` is ``level="token", mode="mask", low=lo, high=hi``.
* verl 0.6 ``compute_rollout_importance_weights``: ``rollout_is_level`` token / sequence / geometric
  (the per-row geometric mean), ``truncate`` clamps from above only (``low=0``); in ``mask`` mode verl
  takes the masked tokens out of the response mask (so out of the loss normaliser too) where this sets
  their weight to 0 (as TRL and OpenRLHF do): the same gradient under ``seq-mean-token-sum``, not under the
  modes that count tokens. Its later ``rollout_rs="seq_mean_k1"`` bounds ``mean(rollout_logp - old_logp)``
  in log space, i.e. keeps ``1 / hi <= g <= 1 / lo`` for the geometric weight ``g``: ``level="geometric",
  mode="mask", low=1/hi, high=1/lo``.

Shapes: ``[B, T]`` per token.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from lightning_rl.maths.checks import check_choice, check_shapes
from lightning_rl.maths.penalties import kl_penalty

Tensor = torch.Tensor
RolloutISLevel = Literal["token", "sequence", "geometric"]
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
    elif level == "geometric":
        diff = torch.where(mask, diff.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1), 0.0)
    return diff


def _bounds(cap: float, low: float, high: float | None) -> tuple[float, float]:
    """``(low, upper)``, checked: ``0 <= low <= 1 <= upper``, so an on-policy weight of 1 is never changed."""
    if high is not None and cap != 2.0 and cap != high:
        raise ValueError(f"`high` is the upper bound under the peers' name, an alias of `cap`: give one, "
                         f"got cap={cap}, high={high}")
    upper = cap if high is None else high
    if not upper >= 1.0:
        raise ValueError(f"`{'cap' if high is None else 'high'}` must be >= 1, got {upper}")
    if not 0.0 <= low <= 1.0:
        raise ValueError(f"`low` must be in [0, 1], got {low}")
    return low, upper


def _outside(weight: Tensor, low: float, upper: float) -> Tensor:
    """Where a weight falls outside ``[low, upper]`` (the bounds are kept, as every peer keeps them)."""
    return (weight > upper) | (weight < low)


@torch.no_grad()
def rollout_is_weights(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, level: str = "token", mode: str = "truncate",
    cap: float = 2.0, low: float = 0.0, high: float | None = None,
) -> Tensor:
    """Importance weights from the rollout engine's policy to the trainer's, detached (TIS / MIS).

    Token level ``w_it = exp(old_logp_it - rollout_logp_it)``; sequence level
    ``w_i = exp(sum_t m_it (old_logp_it - rollout_logp_it))`` (the product of the token ratios) and geometric
    level ``g_i = exp(sum_t m_it (old_logp_it - rollout_logp_it) / sum_t m_it)`` (their geometric mean, not
    growing with the length), on every valid token of row ``i``. With ``[low, high]`` the bounds:
    ``truncate``: ``clamp(w, low, high)``; ``mask``: ``w`` inside the bounds, else 0 (the token, or the whole
    row at sequence / geometric level, is dropped; e.g. ``level="geometric", mode="mask", low=0.99,
    high=1.01`` keeps only sequences whose geometric ratio is within 1%). The exponent is clamped at 20
    before ``exp`` (no overflow); the result is exact for any bound ``< e^20``.

    Args:
        old_logp: ``[B, T]`` trainer log-probs of the sampled tokens (behaviour policy, recomputed).
        rollout_logp: ``[B, T]`` the sampler's log-probs of the same tokens. mask: ``[B, T]``.
        level: ``token``, ``sequence`` or ``geometric``. mode: ``truncate`` or ``mask``.
        cap: the upper bound, >= 1 (on-policy w = 1 stays).
        low: the lower bound, in ``[0, 1]`` (0: none; TRL's ``clip_min``, OpenRLHF's low threshold).
        high: the upper bound under the peers' name (TRL's ``clip_max``); ``None``: ``cap``.

    Returns:
        ``[B, T]`` float32 (float64 if the inputs are), no gradient, 0 on invalid tokens.
    """
    check_choice("mode", mode, ROLLOUT_IS_MODES)
    low, upper = _bounds(cap, low, high)
    log_weight = _rollout_log_weights(old_logp, rollout_logp, mask, level)
    weight = torch.exp(log_weight.clamp(max=ROLLOUT_LOG_WEIGHT_MAX))
    if mode == "truncate":
        weight = weight.clamp(min=low, max=upper)
    else:
        weight = torch.where(_outside(weight, low, upper), 0.0, weight)
    return torch.where(mask.bool(), weight, 0.0)


@torch.no_grad()
def rollout_mismatch_stats(
    old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, weights: Tensor, cap: float, *,
    level: str = "token", mode: str = "truncate", low: float = 0.0,
) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs are from the trainer's, over valid tokens (detached scalars).

    * ``rollout/logp_diff_mean``: mean ``|old_logp - rollout_logp|``.
    * ``rollout/mismatch_k3``: mean k3 estimate of KL(engine || trainer) from the engine's samples,
      ``exp(d) - d - 1`` with ``d = old_logp - rollout_logp`` (``kl_penalty(rollout_logp, old_logp)``),
      i.e. ``(w - 1) - log w`` of the token weight; >= 0, 0 when the two agree (``d`` clamped at 20).
    * ``rollout/is_weight_mean``: mean of ``weights`` (as applied, after truncation or masking).
    * ``rollout/is_clipped_frac``: fraction of tokens whose raw weight at ``level`` is outside
      ``[low, cap]`` (truncated, or masked).
    * ``rollout/is_masked_frac``: fraction of tokens the mask set to 0 (0 unless ``mode`` is ``mask``).
    * ``rollout/seq_masked_frac``: fraction of the rows with a valid token whose every valid token was
      masked (0 unless ``mode`` is ``mask``).

    The key set is the same whatever the options (every rank logs the same keys).

    Args:
        old_logp, rollout_logp, mask, weights: ``[B, T]``; ``weights`` from :func:`rollout_is_weights`.
        cap, level, mode, low: the options the weights were computed with (``cap`` the upper bound).
    """
    check_shapes("old_logp", old_logp, ndim=2, rollout_logp=rollout_logp, mask=mask, weights=weights)
    check_choice("mode", mode, ROLLOUT_IS_MODES)
    low, cap = _bounds(cap, low, None)
    mask = mask.bool()
    token = _rollout_log_weights(old_logp, rollout_logp, mask, "token")
    raw = token if level == "token" else _rollout_log_weights(old_logp, rollout_logp, mask, level)
    outside = _outside(torch.exp(raw.clamp(max=ROLLOUT_LOG_WEIGHT_MAX)), low, cap) & mask
    masked = outside if mode == "mask" else torch.zeros_like(outside)
    k3 = kl_penalty(torch.zeros_like(token), token.clamp(max=ROLLOUT_LOG_WEIGHT_MAX), "k3")
    return {
        "rollout/logp_diff_mean": _valid_mean(token.abs(), mask, token.dtype),
        "rollout/mismatch_k3": _valid_mean(k3, mask, token.dtype),
        "rollout/is_weight_mean": _valid_mean(weights.detach(), mask, token.dtype),
        "rollout/is_clipped_frac": _valid_mean(outside, mask, token.dtype),
        "rollout/is_masked_frac": _valid_mean(masked, mask, token.dtype),
        "rollout/seq_masked_frac": _masked_rows_frac(masked, mask, token.dtype),
    }


def _valid_mean(x: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The mean of ``x`` (as ``dtype``) over the valid tokens of the bool ``mask`` (0 when there are none)."""
    return torch.where(mask, x.to(dtype), 0.0).sum() / mask.sum().clamp_min(1)


def _masked_rows_frac(masked: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The fraction (as ``dtype``) of the rows with a valid token whose every valid token is ``masked``
    (0 when no row has a valid token)."""
    rows = mask.any(-1)
    return ((masked | ~mask).all(-1) & rows).sum().to(dtype) / rows.sum().clamp_min(1)
