"""Policy-gradient and preference losses for RL post-training of causal LMs (pure PyTorch).

Shapes: ``logp`` / ``old_logp`` / ``ref_logp`` are float ``[B, T]`` per-token log-probs of the sampled
completion tokens under the current / behaviour / reference policy; ``mask`` is ``[B, T]`` (bool or 0/1);
``advantages`` is ``[B]`` (broadcast over the row) or ``[B, T]``. Every ``*_loss`` returns
``(loss, metrics)``: a differentiable scalar to minimise and a dict of detached scalar tensors.

One implementation of every policy objective: :func:`policy_loss`, a point on four axes: the ratio level
(:data:`RATIO_LEVELS`, in :mod:`lightning_rl.maths.ratio_levels`), the trust region (a
:class:`~lightning_rl.maths.trust_regions.TrustRegion` of its options), the aggregation (:data:`AGGREGATORS`)
and a KL-to-reference term (:func:`~lightning_rl.maths.penalties.kl_penalty`). The contract losses
(``ppo_policy_loss``, ``grpo_loss``, ``gspo_loss``, ``dapo_loss``, ``sapo_loss``) are thin presets of it, in
:mod:`lightning_rl.maths.policy_presets`, and training reaches it through
:class:`lightning_rl.maths.objective.Objective`.

To add a trust region: its function and options dataclass in :mod:`lightning_rl.maths.trust_regions` (that
module's docstring). An aggregation: a function in ``AGGREGATORS`` and its name in :data:`Aggregation`.

Metrics are means over what one ratio stands for (tokens, or GSPO's sequences); ``policy/approx_kl`` is
k3 of the ratio, ``mean((r - 1) - log r)``: KL(pi_old || pi_theta), >= 0, lower variance than k1. Beside it
:func:`policy_loss` returns ``policy/ratio_mean``, the trust region's stats (``clip_frac*``,
``gate_weight_mean``, ``cov_frac``...); when ``ref_logp`` is given ``policy/kl_ref`` (the unclamped mean),
``policy/kl_ref_max`` (the largest per-token KL, 0 without valid tokens) and, with ``kl_clamp``,
``policy/kl_clamp_frac`` (the share of tokens the clamp bit); ``policy/surrogate_token_frac`` (the share the
high-entropy selection keeps) and ``policy/opsm_masked_frac`` (the share OPSM drops) when on.
``num_tokens`` / ``num_seqs`` are the whole minibatch's normalisers (micro-batching, see
:mod:`lightning_rl.maths.aggregation`). Padded log-ratios and log-probs are zeroed before any trust region
sees them, so garbage (even inf/NaN) there cannot reach the loss or its gradient. The advantages, KL
estimators, ratio levels, trust regions and DPO losses live in their own modules of ``lightning_rl.maths``;
:mod:`lightning_rl.losses` (the published contract) gathers them under one name.
"""

from __future__ import annotations

import torch

from lightning_rl.maths.aggregation import AGGREGATIONS, Count, aggregate, masked_mean
from lightning_rl.maths.checks import check_choice, check_range, check_shapes
from lightning_rl.maths.penalties import KL_ESTIMATORS, kl_penalty
from lightning_rl.maths.ratio_levels import RATIO_LEVELS
from lightning_rl.maths.token_selection import TokenSelection, off_policy_sequence_mask
from lightning_rl.maths.trust_regions import Clip, Surrogate, SurrogateInputs, TrustRegion

__all__ = ["broadcast_advantages", "entropy_from_logits", "policy_loss", "value_loss"]

Tensor = torch.Tensor
NO_SELECTION = TokenSelection()  # every token keeps its surrogate; the trust region selects on its batch


# ----------------------------------------------------------------------------------------------- helpers
def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy (nats) of ``softmax(z)`` over the last axis: ``H = logsumexp(z) - sum_v softmax(z)_v z_v``.

    Args:
        logits: ``[..., V]``, finite (mask with a large negative number, not ``-inf``). Returns ``[...]``.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def broadcast_advantages(advantages: Tensor, logp: Tensor) -> Tensor:
    """Advantages as ``[B, T]``: a ``[B]`` tensor is repeated over each row's tokens."""
    if advantages.shape == logp.shape:
        return advantages
    if advantages.dim() == 1 and advantages.shape[0] == logp.shape[0]:
        return advantages.unsqueeze(-1).expand_as(logp)
    raise ValueError(
        f"`advantages` must have shape (B,) or (B, T) = {tuple(logp.shape)}, got {tuple(advantages.shape)}"
    )


# ---------------------------------------------------------------------------------------- policy loss
def policy_loss(
    logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor, mask: Tensor, *,
    ratio_level: str = "token", trust_region: TrustRegion | None = None,
    aggregation: str = "seq-mean-token-mean",
    kl_coef: float = 0.0, kl_estimator: str = "k3", num_tokens: Count = None, num_seqs: Count = None,
    token_weights: Tensor | None = None, kl_clamp: float | None = None, aggregation_length: int | None = None,
    selection: TokenSelection = NO_SELECTION, sampler_logp: Tensor | None = None,
    off_policy_mask_threshold: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Every policy objective: ``aggregate(surrogate(logp, log r, A, mask) + kl_coef * KL(pi || pi_ref))``;
    returns ``(loss, metrics)``, the metrics as the module docstring lists them.

    Args:
        logp, old_logp, mask: ``[B, T]``. advantages: ``[B]`` or ``[B, T]``.
        ref_logp: ``[B, T]`` reference log-probs, or None (then ``kl_coef`` must be 0). Given with
            ``kl_coef == 0``, the KL is only logged.
        trust_region: a :class:`~lightning_rl.maths.trust_regions.TrustRegion` (``None``: ``Clip()``).
        ratio_level, aggregation, kl_coef, kl_estimator, kl_clamp, aggregation_length,
            off_policy_mask_threshold: the axes, as :class:`lightning_rl.maths.objective.Objective` documents
            them (``aggregation_length`` is :func:`aggregate`'s ``norm_length``).
        num_tokens, num_seqs: whole-minibatch normalisers (see :func:`aggregate`).
        token_weights: ``[B, T]`` detached per-token weights of the surrogate (off-policy correction), or
            None; the KL term is not weighted.
        selection: the minibatch's token selections (:class:`TokenSelection`; default: none): ``selected``
            goes to the trust region; only ``high_entropy`` tokens keep their surrogate, the others keep their
            KL term and stay in the normalisers (as TRL masks its per-token loss before the KL and the mean).
        sampler_logp: ``[B, T]`` the sampling policy's log-probs, for OPSM (``None``: ``old_logp``).
    """
    _check_policy_args(logp, old_logp, ref_logp, mask, ratio_level, trust_region, aggregation, kl_coef,
                       kl_estimator)
    mask = mask.bool()
    per_token, metrics = _surrogate_loss(logp, old_logp, advantages, mask, ratio_level,
                                         trust_region or Clip(), token_weights, selection.selected)
    keep = _surrogate_keep(logp, old_logp, advantages, mask, ratio_level, selection.high_entropy,
                           sampler_logp, off_policy_mask_threshold, metrics)
    per_token = per_token if keep is None else torch.where(keep, per_token, 0.0)
    if ref_logp is not None:
        per_token = _add_reference_kl(per_token, logp, ref_logp, mask, kl_coef, kl_estimator, kl_clamp,
                                      metrics)
    return aggregate(per_token, mask, aggregation, num_tokens=num_tokens, num_seqs=num_seqs,
                     norm_length=aggregation_length), metrics


def _surrogate_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, ratio_level: str,
    trust_region: TrustRegion, token_weights: Tensor | None, selected: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`policy_loss`'s surrogate before the KL term and the aggregation: the ratio at ``ratio_level``,
    the trust region's per-token loss (``[B, T]``, times the detached ``token_weights`` if given) and its
    metrics (:func:`_surrogate_metrics`); ``mask`` bool."""
    level = RATIO_LEVELS[ratio_level]
    adv = level.advantages(broadcast_advantages(advantages, logp), mask)
    log_ratio = level.log_ratio(logp, old_logp, mask)
    surrogate = trust_region.surrogate(SurrogateInputs(
        logp=torch.where(mask, logp, 0.0),  # a region that reads logp never sees padding garbage
        old_logp=torch.where(mask, old_logp, 0.0).detach(), log_ratio=log_ratio, adv=adv, mask=mask,
        selected=selected))
    per_token = surrogate.loss if token_weights is None else surrogate.loss * token_weights.detach()
    return per_token, _surrogate_metrics(surrogate, log_ratio, mask, level.metric_mode, logp.dtype)


def _surrogate_keep(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, ratio_level: str,
    surrogate_mask: Tensor | None, sampler_logp: Tensor | None, threshold: float | None,
    metrics: dict[str, Tensor],
) -> Tensor | None:
    """The tokens whose surrogate counts (``None``: all): the high-entropy selection and OPSM's keep-mask,
    each logged as a share of the valid tokens in ``metrics``; ``mask`` bool."""
    keep = None
    if surrogate_mask is not None:
        keep = surrogate_mask.bool() & mask
        metrics["policy/surrogate_token_frac"] = masked_mean(keep.to(logp.dtype), mask)
    if threshold is not None:
        adv = RATIO_LEVELS[ratio_level].advantages(broadcast_advantages(advantages, logp), mask)
        sampler = torch.where(mask, old_logp if sampler_logp is None else sampler_logp, 0.0)
        kept = off_policy_sequence_mask(torch.where(mask, logp, 0.0), sampler, adv, mask, threshold)
        metrics["policy/opsm_masked_frac"] = masked_mean((~kept).to(logp.dtype), mask)
        keep = kept if keep is None else keep & kept
    return keep


def _check_policy_args(
    logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, mask: Tensor, ratio_level: str,
    trust_region: TrustRegion | None, aggregation: str, kl_coef: float, kl_estimator: str,
) -> None:
    """:func:`policy_loss`'s shapes, choices and KL settings, each error naming its argument."""
    check_shapes("logp", logp, ndim=2, old_logp=old_logp, mask=mask, ref_logp=ref_logp)
    check_choice("ratio_level", ratio_level, tuple(RATIO_LEVELS))
    if trust_region is not None and not isinstance(trust_region, TrustRegion):
        raise TypeError(f"`trust_region` must be a TrustRegion (lightning_rl.maths.trust_regions: Clip, "
                        f"SoftGate, CISPO, DPPO, ClipCov, KLCov), got {trust_region!r}")
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    if kl_coef < 0:
        raise ValueError(f"`kl_coef` must be >= 0, got {kl_coef}")
    if ref_logp is None and kl_coef != 0:
        raise ValueError(
            f"`ref_logp` is None but the KL coefficient is {kl_coef}; pass ref_logp or set it to 0"
        )


@torch.no_grad()
def _surrogate_metrics(
    surrogate: Surrogate, log_ratio: Tensor, mask: Tensor, metric_mode: str, dtype: torch.dtype
) -> dict[str, Tensor]:
    """The trust region's stats, ``policy/ratio_mean`` and ``policy/approx_kl``, each a mean over what one
    ratio stands for (``metric_mode``), in ``dtype`` (``logp``'s); ``mask`` bool."""

    def mean(x: Tensor) -> Tensor:
        return aggregate(x.to(dtype), mask, metric_mode)

    metrics = {f"policy/{name}": mean(value) for name, value in surrogate.stats.items()}
    metrics["policy/ratio_mean"] = mean(surrogate.ratio)
    # k3 of the ratio, (r - 1) - log r: kl_penalty's k3 with d = log r
    metrics["policy/approx_kl"] = mean(kl_penalty(torch.zeros_like(log_ratio), log_ratio, "k3"))
    return metrics


def _add_reference_kl(per_token: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor, kl_coef: float,
                      kl_estimator: str, kl_clamp: float | None, metrics: dict[str, Tensor]) -> Tensor:
    """``per_token`` plus ``kl_coef`` times the KL term (:func:`_reference_kl`), whose metrics go into
    ``metrics`` whatever ``kl_coef`` (0: logged only)."""
    term, kl_metrics = _reference_kl(logp, ref_logp, mask, kl_estimator, kl_clamp)
    metrics.update(kl_metrics)
    return per_token + kl_coef * term if kl_coef != 0 else per_token


def _reference_kl(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, kl_estimator: str, kl_clamp: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token KL term of the loss (``[B, T]``, clamped to ``kl_clamp``; differentiable through
    ``logp``) and its metrics ``policy/kl_ref`` (unclamped mean), ``policy/kl_ref_max`` and, with
    ``kl_clamp``, ``policy/kl_clamp_frac``; ``mask`` bool."""
    kl = kl_penalty(torch.where(mask, logp, 0.0), torch.where(mask, ref_logp, 0.0), kl_estimator)
    term = kl if kl_clamp is None else kl.clamp(-kl_clamp, kl_clamp)
    detached = kl.detach()
    metrics = {"policy/kl_ref": masked_mean(detached, mask)}
    metrics["policy/kl_ref_max"] = torch.where(mask, detached, -torch.inf).amax() if mask.any() \
        else detached.new_zeros(())  # every metric stays finite, an all-masked batch's too
    if kl_clamp is not None:
        metrics["policy/kl_clamp_frac"] = masked_mean((detached.abs() > kl_clamp).to(logp.dtype), mask)
    return term, metrics


# ------------------------------------------------------------------------------------------ value loss
def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_eps: float = 0.2, *,
    num_tokens: Count = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ``0.5 * token-mean(max((v - R)^2, (v_old + clip(v - v_old, -eps, eps) - R)^2))``.

    Args:
        values, old_values, returns, mask: ``[B, T]``.
        clip_eps: value clip range, > 0.
        num_tokens: whole-minibatch valid-token count (micro-batching).

    Returns:
        ``(loss, metrics)`` with ``value/{clip_frac, mean, returns_mean, error}`` (``error`` = masked MSE).
    """
    check_shapes("values", values, ndim=2, old_values=old_values, returns=returns, mask=mask)
    check_range("clip_eps", clip_eps)
    mask = mask.bool()
    unclipped = (values - returns) ** 2
    clipped = (old_values + (values - old_values).clamp(-clip_eps, clip_eps) - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(unclipped, clipped), mask, "token-mean", num_tokens=num_tokens)
    with torch.no_grad():
        metrics = {
            "value/clip_frac": masked_mean((clipped > unclipped).to(values.dtype), mask),
            "value/mean": masked_mean(values.detach(), mask),
            "value/returns_mean": masked_mean(returns.detach(), mask),
            "value/error": masked_mean(unclipped.detach(), mask),
        }
    return loss, metrics
