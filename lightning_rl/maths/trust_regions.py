"""Trust regions: how a policy objective turns ratios and advantages into a per-token loss (pure PyTorch).

Part of the contract :mod:`lightning_rl.losses`, whose :func:`~lightning_rl.maths.losses.policy_loss` calls
them.

Protocol. A trust region is a function registered in :data:`TRUST_REGIONS` and called with keywords only::

    TRUST_REGIONS[name](logp=logp, log_ratio=log_ratio, adv=adv, mask=mask, **options) -> Surrogate

The common inputs (:data:`TRUST_REGION_INPUTS`) are all ``[B, T]``:

* ``logp``: current per-token log-probs, differentiable, 0 on invalid tokens (zeroed by the caller).
* ``log_ratio``: the ratio level's ``log r`` (0 on invalid tokens); under ``ratio_level: sequence`` it is
  GSPO-token's: the row's mean log-ratio as value, ``grad logp_t`` as gradient.
* ``adv``: advantages (each row's mean under ``ratio_level: sequence``).
* ``mask``: bool, the tokens that count.

Every other parameter is an option (:func:`trust_region_options`); the config
(:class:`lightning_rl.maths.objective.Objective`) fills each from its field of the same name and refuses a
non-default value of an option the chosen region does not take. A region reads the inputs it needs and
accepts the others: PPO clip and the SAPO gate keep their positional ``(log_ratio, adv, options...)`` form
for direct callers, with ``logp`` and ``mask`` keyword-only and unused. A batch-statistic region (Clip-Cov,
KL-Cov style) selects valid tokens with ``mask`` and takes covariances of ``logp``; its statistics are
those of the (micro-)batch it is called on.

To add a trust region: write its function here, register it in ``TRUST_REGIONS`` and name it in
:data:`TrustRegion`; add its options as fields of ``Objective`` and keys of ``OnlineRL`` (the config).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

from lightning_rl.maths.checks import check_choice, check_range

Tensor = torch.Tensor
TrustRegion = Literal["clip", "soft_gate", "cispo"]
TRUST_REGION_INPUTS: tuple[str, ...] = ("logp", "log_ratio", "adv", "mask")
SAPO_LOG_RATIO_CLAMP = 20.0


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


TRUST_REGIONS: dict[str, Callable[..., Surrogate]] = {
    "clip": clipped_surrogate,
    "soft_gate": soft_gate_surrogate,
    "cispo": cispo_surrogate,
}


def trust_region_options(name: str) -> tuple[str, ...]:
    """The options of trust region ``name``: its parameters other than :data:`TRUST_REGION_INPUTS`."""
    check_choice("trust_region", name, tuple(TRUST_REGIONS))
    params = inspect.signature(TRUST_REGIONS[name]).parameters
    return tuple(p for p in params if p not in TRUST_REGION_INPUTS)
