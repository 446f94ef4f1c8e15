"""Trust regions: how a policy objective turns ratios and advantages into a per-token loss (pure PyTorch).

Part of the contract :mod:`lightning_rl.losses`, whose :func:`~lightning_rl.maths.losses.policy_loss` calls
them.

Protocol. A trust region is a function registered in :data:`TRUST_REGIONS` and called with keywords only,
with those of the common inputs (:data:`TRUST_REGION_INPUTS`) that it names, and its options::

    TRUST_REGIONS[name](log_ratio=log_ratio, adv=adv, [logp=..., old_logp=..., mask=..., selected=...],
                        **options) -> Surrogate

The common inputs are all ``[B, T]``:

* ``logp``: current per-token log-probs, differentiable, 0 on invalid tokens (zeroed by the caller).
* ``old_logp``: behaviour log-probs, detached, 0 on invalid tokens (DPPO's divergence is per token whatever
  the ratio level).
* ``log_ratio``: the ratio level's ``log r`` (0 on invalid tokens); under ``ratio_level: sequence`` it is
  GSPO-token's: the row's mean log-ratio as value, ``grad logp_t`` as gradient.
* ``adv``: advantages (each row's mean under ``ratio_level: sequence``).
* ``mask``: bool, the tokens that count.
* ``selected``: bool or ``None``, a batch-statistic selection (Clip-Cov, KL-Cov) made over the whole minibatch
  and every rank before the micro-batches (:mod:`lightning_rl.maths.token_selection`); ``None``: the region
  makes it on the batch it is given, which is right only when that batch is the whole batch.

Every other parameter is an option (:func:`trust_region_options`); the config
(:class:`lightning_rl.maths.objective.Objective`) fills each from its field of the same name and refuses a
non-default value of an option the chosen region does not take. PPO clip and the SAPO gate keep their
positional ``(log_ratio, adv, options...)`` form for direct callers.

To add a trust region: write its function here, register it in ``TRUST_REGIONS`` and name it in
:data:`TrustRegion`; add its options as fields of ``Objective`` and keys of ``OnlineRL`` (the config).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

from lightning_rl.maths.checks import check_choice, check_range
from lightning_rl.maths.token_selection import clip_cov_mask, kl_cov_mask, token_covariance

Tensor = torch.Tensor
TrustRegion = Literal["clip", "soft_gate", "cispo", "dppo", "clip_cov", "kl_cov"]
TRUST_REGION_INPUTS: tuple[str, ...] = ("logp", "old_logp", "log_ratio", "adv", "mask", "selected")
SAPO_LOG_RATIO_CLAMP = 20.0
DPPO_LOG_RATIO_CLAMP = 20.0  # verl and SkyRL clamp the log-ratio there before exp


class Surrogate(NamedTuple):
    """Per-token result of a trust region: ``loss`` to minimise, the ``ratio``, and ``stats`` (per-token
    values logged as ``policy/<name>`` means, e.g. clip indicators)."""

    loss: Tensor
    ratio: Tensor
    stats: dict[str, Tensor]


def clipped_surrogate(
    log_ratio: Tensor,
    adv: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    *,
    logp: Tensor | None = None,
    mask: Tensor | None = None,
) -> Surrogate:
    """PPO clip ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; dual clip caps it at ``-c A``
    for A < 0.

    Args:
        log_ratio, adv: ``[B, T]``. clip_low: in (0, 1). clip_high: > 0. clip_ratio_c: > 1 or None (off).
        logp, mask: the protocol's other inputs, unused.
    """
    check_range("clip_low", clip_low, high=1.0)
    check_range("clip_high", clip_high)
    ratio = torch.exp(log_ratio)
    low = (ratio < 1.0 - clip_low) & (adv < 0)
    high = (ratio > 1.0 + clip_high) & (adv > 0)
    clipped = low | high  # exactly where the clipped term is the larger (active) loss
    loss = torch.where(clipped, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high), -adv * ratio)
    stats = {"clip_frac": clipped, "clip_frac_low": low, "clip_frac_high": high}
    if clip_ratio_c is not None:
        check_range("clip_ratio_c", clip_ratio_c, low=1.0)
        # for A < 0 cap the loss at -A c, so a huge ratio on a bad token cannot blow up the step
        dual = (adv < 0) & (loss > -adv * clip_ratio_c)
        loss = torch.where(dual, -adv * clip_ratio_c, loss)
        stats["clip_frac_dual"] = dual
    return Surrogate(loss, ratio, stats)


def soft_gate_surrogate(
    log_ratio: Tensor, adv: Tensor, tau_pos: float = 1.0, tau_neg: float = 1.05, *,
    logp: Tensor | None = None, mask: Tensor | None = None,
) -> Surrogate:
    """SAPO soft gate: ``-f(r) A`` with ``f(r) = 4 / tau * sigmoid(tau (r - 1))``, ``tau = tau_pos if A > 0
    else tau_neg``.

    ``d f / d log r = w r`` with gate weight ``w = 4 sigmoid(tau (r-1)) (1 - sigmoid(tau (r-1)))``
    (1 at r = 1, logged as ``gate_weight_mean``): the plain policy gradient on-policy, fading smoothly
    off-policy. The log-ratio is clamped to [-20, 20] before ``exp`` so an extreme token cannot overflow
    (its gradient is then 0). ``logp`` and ``mask`` (the protocol's other inputs) are unused.
    """
    check_range("tau_pos", tau_pos)
    check_range("tau_neg", tau_neg)
    ratio = torch.exp(log_ratio.clamp(-SAPO_LOG_RATIO_CLAMP, SAPO_LOG_RATIO_CLAMP))
    tau = torch.where(adv > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    return Surrogate(-4.0 / tau * gate * adv, ratio, {"gate_weight_mean": 4.0 * gate * (1.0 - gate)})


def cispo_surrogate(
    log_ratio: Tensor, adv: Tensor, clip_high: float = 0.2, *, logp: Tensor, mask: Tensor | None = None
) -> Surrogate:
    """CISPO (MiniMax-M1): ``-sg(min(r, 1 + clip_high)) A logp``, a REINFORCE term weighted by the
    importance ratio capped from above only, under a stop-gradient.

    The gradient is ``-min(r, 1 + clip_high) A grad logp`` on every token: a clipped ratio shrinks a
    token's update instead of dropping it (PPO clip's gradient there is 0). The value is built on ``logp``
    itself, so it is not PPO's ``-r A`` (on-policy the gradients agree, the values do not). As verl's
    ``compute_policy_loss_cispo`` without a lower clip, and TRL's ``loss_type="cispo"`` with
    ``epsilon_high = 1 + clip_high``. Under ``ratio_level: sequence`` the weight is GSPO's sequence ratio
    ``s_i``, capped, on each token of the row (a truncated sequence-level importance weight).

    Args:
        log_ratio, adv, logp: ``[B, T]``; ``logp`` carries the gradient, ``log_ratio`` only sets the weight.
        clip_high: > 0; the weight is capped at ``1 + clip_high``. mask: unused.

    Returns:
        The :class:`Surrogate`; ``clip_frac`` and ``clip_frac_high`` (equal) mark ``r > 1 + clip_high``.
    """
    check_range("clip_high", clip_high)
    ratio = torch.exp(log_ratio)
    weight = ratio.detach().clamp(max=1.0 + clip_high)  # an overflowing ratio (inf) becomes the cap
    high = ratio.detach() > 1.0 + clip_high
    return Surrogate(-weight * adv * logp, ratio, {"clip_frac": high, "clip_frac_high": high})


def dppo_surrogate(
    log_ratio: Tensor, adv: Tensor, dppo_divergence: str = "tv", dppo_low: float = 0.2,
    dppo_high: float = 0.2, dppo_ratio_cap: float | None = None, *, logp: Tensor, old_logp: Tensor,
    mask: Tensor | None = None,
) -> Surrogate:
    """DPPO (arXiv 2602.04879): the plain surrogate ``-A r``, dropped (no gradient) on the tokens whose
    divergence between the current and the behaviour distribution leaves the trust region, instead of
    clipping the ratio.

    The divergence is DPPO's binary approximation on the sampled token, ``p = exp(logp)``,
    ``p_old = exp(old_logp)``:

    * ``tv``: ``p - p_old``; a token with ``A > 0`` is dropped where ``p - p_old > dppo_high``, any other
      where ``p - p_old < -dppo_low`` (verl ``dppo_tv``, SkyRL ``binary_tv``, prime-rl's default loss).
    * ``kl``: ``KL_bin = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))``;
      dropped where ``A > 0``, ``p > p_old`` and ``KL_bin > dppo_high``, or ``A <= 0``, ``p < p_old`` and
      ``KL_bin > dppo_low`` (verl ``dppo_kl``, SkyRL ``binary_kl``).

    ``dppo_ratio_cap`` ``c``: the gradient weight ``r`` is truncated at ``c`` (verl's ``clip_ratio_c``, a
    truncated importance weight; ``None``: untruncated, as SkyRL and prime-rl). The value is ``-A min(r, c)``
    (SkyRL's ``-A r`` below the cap; verl writes ``-A sg(min(r, c)) logp``, the same gradient). The
    log-ratio is clamped to [-20, 20] before ``exp``. Under ``ratio_level: sequence`` ``r`` is GSPO's
    sequence ratio and the divergence stays per token.

    Returns:
        The :class:`Surrogate`; ``clip_frac`` marks the dropped tokens, ``clip_frac_high`` / ``clip_frac_low``
        those with ``A > 0`` / ``A < 0``, ``ratio_cap_frac`` the kept tokens whose weight was truncated.
    """
    check_choice("dppo_divergence", dppo_divergence, ("tv", "kl"))
    check_range("dppo_low", dppo_low)
    check_range("dppo_high", dppo_high)
    if dppo_ratio_cap is not None:
        check_range("dppo_ratio_cap", dppo_ratio_cap)
    ratio = torch.exp(log_ratio.clamp(-DPPO_LOG_RATIO_CLAMP, DPPO_LOG_RATIO_CLAMP))
    with torch.no_grad():
        p, p_old = torch.exp(logp), torch.exp(old_logp)
        if dppo_divergence == "tv":
            up, down = p - p_old > dppo_high, p - p_old < -dppo_low
        else:
            kl = p_old * (old_logp - logp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            up, down = (p > p_old) & (kl > dppo_high), (p < p_old) & (kl > dppo_low)
        dropped = torch.where(adv > 0, up, down)
        capped = torch.zeros_like(dropped) if dppo_ratio_cap is None else ~dropped & (ratio > dppo_ratio_cap)
    weight = ratio if dppo_ratio_cap is None else ratio * (dppo_ratio_cap / ratio).clamp(max=1.0).detach()
    loss = torch.where(dropped, 0.0, -adv * weight)
    stats = {"clip_frac": dropped, "clip_frac_high": dropped & (adv > 0),
             "clip_frac_low": dropped & (adv < 0), "ratio_cap_frac": capped}
    return Surrogate(loss, ratio, stats)


def clip_cov_surrogate(
    log_ratio: Tensor, adv: Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
    clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, *, logp: Tensor,
    mask: Tensor, selected: Tensor | None = None,
) -> Surrogate:
    """Clip-Cov (arXiv 2505.22617; verl ``clip_cov``, SkyRL ``CLIP_COV``): PPO clip, with the gradient of a
    few high-covariance tokens stopped (their loss set to 0).

    The tokens: ``max(1, int(clip_cov_ratio N))`` of the ``N`` valid tokens, drawn at random among those
    PPO's clip leaves unclipped with covariance ``(A - mean A)(logp - mean logp)`` in
    ``(clip_cov_lb, clip_cov_ub)`` (:func:`~lightning_rl.maths.token_selection.clip_cov_mask`). Training
    passes them as ``selected``, chosen over the whole minibatch before the micro-batches; ``None``: drawn
    here on this batch (keys from the global RNG, like verl's ``randperm``).

    Returns:
        The :class:`Surrogate`; the clip's stats and ``cov_frac``, the share of tokens selected.
    """
    _check_fraction("clip_cov_ratio", clip_cov_ratio)
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"`clip_cov_lb` must be < `clip_cov_ub`, got {clip_cov_lb} and {clip_cov_ub}")
    base = clipped_surrogate(log_ratio, adv, clip_low, clip_high)
    if selected is None:
        cov = token_covariance(logp, adv, mask)
        keys = torch.rand(logp.shape, device=logp.device)
        selected = clip_cov_mask(cov, base.stats["clip_frac"], mask, clip_cov_ratio, clip_cov_lb, clip_cov_ub,
                                 keys)
    selected = selected.bool()
    return Surrogate(torch.where(selected, 0.0, base.loss), base.ratio, {**base.stats, "cov_frac": selected})


def kl_cov_surrogate(
    log_ratio: Tensor, adv: Tensor, kl_cov_ratio: float = 2e-4, kl_cov_coef: float = 1.0, *, logp: Tensor,
    mask: Tensor, selected: Tensor | None = None,
) -> Surrogate:
    """KL-Cov (arXiv 2505.22617; verl ``kl_cov``, SkyRL ``KL_COV``): the unclipped surrogate ``-A r``, plus
    ``kl_cov_coef |log r|`` on the ``max(1, int(kl_cov_ratio N))`` valid tokens of largest covariance
    ``(A - mean A)(logp - mean logp)`` (:func:`~lightning_rl.maths.token_selection.kl_cov_mask`).

    Training passes those tokens as ``selected``, chosen over the whole minibatch before the micro-batches;
    ``None``: chosen here on this batch. The penalty reaches a token whatever its advantage.

    Returns:
        The :class:`Surrogate`; ``cov_frac``, the share of tokens penalised.
    """
    _check_fraction("kl_cov_ratio", kl_cov_ratio)
    if kl_cov_coef < 0:
        raise ValueError(f"`kl_cov_coef` must be >= 0, got {kl_cov_coef}")
    if selected is None:
        selected = kl_cov_mask(token_covariance(logp, adv, mask), mask, kl_cov_ratio)
    selected = selected.bool()
    ratio = torch.exp(log_ratio)
    loss = -adv * ratio + torch.where(selected, kl_cov_coef * log_ratio.abs(), 0.0)
    return Surrogate(loss, ratio, {"cov_frac": selected})


def _check_fraction(name: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"`{name}` must be in (0, 1], got {value}")


TRUST_REGIONS: dict[str, Callable[..., Surrogate]] = {
    "clip": clipped_surrogate,
    "soft_gate": soft_gate_surrogate,
    "cispo": cispo_surrogate,
    "dppo": dppo_surrogate,
    "clip_cov": clip_cov_surrogate,
    "kl_cov": kl_cov_surrogate,
}


def trust_region_options(name: str) -> tuple[str, ...]:
    """The options of trust region ``name``: its parameters other than :data:`TRUST_REGION_INPUTS`."""
    check_choice("trust_region", name, tuple(TRUST_REGIONS))
    params = inspect.signature(TRUST_REGIONS[name]).parameters
    return tuple(p for p in params if p not in TRUST_REGION_INPUTS)
