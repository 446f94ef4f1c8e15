"""Trust regions: how a policy objective turns ratios and advantages into a per-token loss (pure PyTorch).

Part of the contract :mod:`lightning_rl.losses`, whose :func:`~lightning_rl.maths.losses.policy_loss` calls
them. Each trust region is two things here: a pure function of tensors and options (``clipped_surrogate``,
``soft_gate_surrogate``, ...: the maths, tested against hand-worked numbers), and a small frozen dataclass
of its options, a subclass of :class:`TrustRegion`: the config (:class:`Clip`, :class:`SoftGate`,
:class:`CISPO`, :class:`DPPO` here; ``ClipCov`` and ``KLCov``, whose selection is a minibatch statistic, in
:mod:`lightning_rl.maths.covariance_regions`). The dataclass is what a YAML names::

    objective:
      trust_region:
        class_path: lightning_rl.maths.trust_regions.Clip   # or just Clip
        init_args: {low: 0.2, high: 0.28}

so each option is declared once, with its default and its check, and another region's option cannot be
written (jsonargparse refuses a key the chosen class does not take).

A region's :meth:`TrustRegion.surrogate` gets the common inputs (:class:`SurrogateInputs`), all ``[B, T]``:

* ``logp``: current per-token log-probs, differentiable, 0 on invalid tokens (zeroed by the caller).
* ``old_logp``: behaviour log-probs, detached, 0 on invalid tokens (DPPO's divergence is per token whatever
  the ratio level).
* ``log_ratio``: the ratio level's ``log r`` (0 on invalid tokens); under ``ratio_level: sequence`` it is
  GSPO-token's: the row's mean log-ratio as value, ``grad logp_t`` as gradient.
* ``adv``: advantages (each row's mean under ``ratio_level: sequence``).
* ``mask``: bool, the tokens that count.
* ``selected``: bool or ``None``, a batch-statistic selection (Clip-Cov, KL-Cov) made over the whole minibatch
  and every rank before the micro-batches by the region's :meth:`TrustRegion.select`
  (:mod:`lightning_rl.maths.token_selection`); ``None``: the region makes it on the batch it is given, which
  is right only when that batch is the whole batch.

To add a trust region: write its function and its dataclass here (a subclass of :class:`TrustRegion` whose
fields are its options, checked in ``__post_init__``, and whose ``surrogate`` calls the function), a test
with hand-worked numbers, and a YAML overlay in ``configs/objectives/``. Nothing else names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple

import torch

from lightning_rl.maths.checks import check_choice, check_range, require
from lightning_rl.maths.token_selection import Reduce, one_process

Tensor = torch.Tensor
SAPO_LOG_RATIO_CLAMP = 20.0
DPPO_LOG_RATIO_CLAMP = 20.0  # verl and SkyRL clamp the log-ratio there before exp
KEY = "model.objective.trust_region"  # the YAML group of the options; errors name ``KEY.<field>``


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
    clipping the ratio; the divergence is DPPO's binary approximation on the sampled token
    (``dppo_divergence``: ``tv`` or ``kl``, :func:`dppo_dropped`).

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
    dropped = dppo_dropped(logp, old_logp, adv, dppo_divergence, dppo_low, dppo_high)
    with torch.no_grad():
        capped = torch.zeros_like(dropped) if dppo_ratio_cap is None else ~dropped & (ratio > dppo_ratio_cap)
    weight = ratio if dppo_ratio_cap is None else ratio * (dppo_ratio_cap / ratio).clamp(max=1.0).detach()
    loss = torch.where(dropped, 0.0, -adv * weight)
    stats = {"clip_frac": dropped, "clip_frac_high": dropped & (adv > 0),
             "clip_frac_low": dropped & (adv < 0), "ratio_cap_frac": capped}
    return Surrogate(loss, ratio, stats)


@torch.no_grad()
def dppo_dropped(logp: Tensor, old_logp: Tensor, adv: Tensor, divergence: str, low: float,
                 high: float) -> Tensor:
    """``[B, T]`` bool: the tokens DPPO drops, whose divergence on the sampled token leaves the region;
    ``p = exp(logp)``, ``p_old = exp(old_logp)``:

    * ``tv``: ``p - p_old``; a token with ``A > 0`` is dropped where ``p - p_old > high``, any other where
      ``p - p_old < -low`` (verl ``dppo_tv``, SkyRL ``binary_tv``, prime-rl's default loss).
    * ``kl``: ``KL_bin = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))``;
      dropped where ``A > 0``, ``p > p_old`` and ``KL_bin > high``, or ``A <= 0``, ``p < p_old`` and
      ``KL_bin > low`` (verl ``dppo_kl``, SkyRL ``binary_kl``).
    """
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    if divergence == "tv":
        up, down = p - p_old > high, p - p_old < -low
    else:
        kl = p_old * (old_logp - logp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        up, down = (p > p_old) & (kl > high), (p < p_old) & (kl > low)
    return torch.where(adv > 0, up, down)


class SurrogateInputs(NamedTuple):
    """The common inputs of every trust region (module docstring), all ``[B, T]``."""

    logp: Tensor
    old_logp: Tensor
    log_ratio: Tensor
    adv: Tensor
    mask: Tensor
    selected: Tensor | None = None


class TrustRegion:
    """The trust-region seam (``model.init_args.objective.trust_region``): a frozen dataclass of the region's
    options whose :meth:`surrogate` turns the common inputs into a per-token loss.

    A region whose surrogate reads a statistic of the whole minibatch (Clip-Cov, KL-Cov) sets
    :attr:`selects_tokens` and implements :meth:`select`, which the learner calls once per minibatch over
    every rank; :attr:`random_keys`: its selection draws at random, from keys fixed by each token's content.
    """

    selects_tokens: ClassVar[bool] = False
    random_keys: ClassVar[bool] = False

    def surrogate(self, x: SurrogateInputs) -> Surrogate:
        raise NotImplementedError

    def select(self, logp: Tensor, log_ratio: Tensor, adv: Tensor, mask: Tensor, keys: Tensor | None, *,
               total: Reduce = one_process, gather: Reduce = one_process) -> Tensor:
        """``[B, T]`` bool: the tokens this region's batch statistic selects, from the minibatch's values
        before the update (``adv`` at the ratio level; ``keys``: random keys, when :attr:`random_keys`)."""
        raise NotImplementedError(f"{type(self).__name__} selects no tokens")


@dataclass(frozen=True)
class Clip(TrustRegion):
    """PPO clip on ``[1 - low, 1 + high]`` (:func:`clipped_surrogate`; DAPO's clip-higher: ``high`` >
    ``low``).

    Args:
        low: in (0, 1). high: > 0. dual_clip: the dual-clip constant ``c`` > 1 capping the loss at ``-c A``
            for ``A < 0`` (``None``: off).
    """

    low: float = 0.2
    high: float = 0.2
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        c = self.dual_clip
        require(KEY, low=(0 < self.low < 1, self.low, "in (0, 1)"), high=(self.high > 0, self.high, "> 0"),
                dual_clip=(c is None or c > 1, c, "> 1 or null (off)"))

    def surrogate(self, x: SurrogateInputs) -> Surrogate:
        return clipped_surrogate(x.log_ratio, x.adv, self.low, self.high, self.dual_clip)


@dataclass(frozen=True)
class SoftGate(TrustRegion):
    """SAPO's soft gate (:func:`soft_gate_surrogate`).

    Args:
        tau_pos, tau_neg: the gate temperatures for positive / negative advantages, > 0.
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        require(KEY, tau_pos=(self.tau_pos > 0, self.tau_pos, "> 0"),
                tau_neg=(self.tau_neg > 0, self.tau_neg, "> 0"))

    def surrogate(self, x: SurrogateInputs) -> Surrogate:
        return soft_gate_surrogate(x.log_ratio, x.adv, self.tau_pos, self.tau_neg)


@dataclass(frozen=True)
class CISPO(TrustRegion):
    """CISPO (MiniMax-M1, :func:`cispo_surrogate`): ``-sg(min(r, 1 + high)) A logp``; with ``ratio_level:
    sequence`` the capped weight is GSPO's sequence ratio.

    Args:
        high: > 0; the weight's cap is ``1 + high``.
    """

    high: float = 0.2

    def __post_init__(self) -> None:
        require(KEY, high=(self.high > 0, self.high, "> 0"))

    def surrogate(self, x: SurrogateInputs) -> Surrogate:
        return cispo_surrogate(x.log_ratio, x.adv, self.high, logp=x.logp)


@dataclass(frozen=True)
class DPPO(TrustRegion):
    """DPPO (:func:`dppo_surrogate`): a divergence mask on the sampled token instead of the clip.

    Args:
        divergence: ``tv`` or ``kl``. low, high: the thresholds for negative / positive advantages, > 0.
        ratio_cap: the cap on the gradient's ratio weight, > 0 (``None``: uncapped).
    """

    divergence: Literal["tv", "kl"] = "tv"
    low: float = 0.2
    high: float = 0.2
    ratio_cap: float | None = None

    def __post_init__(self) -> None:
        cap = self.ratio_cap
        require(KEY, divergence=(self.divergence in ("tv", "kl"), self.divergence, "tv or kl"),
                low=(self.low > 0, self.low, "> 0"), high=(self.high > 0, self.high, "> 0"),
                ratio_cap=(cap is None or cap > 0, cap, "> 0 or null"))

    def surrogate(self, x: SurrogateInputs) -> Surrogate:
        return dppo_surrogate(x.log_ratio, x.adv, self.divergence, self.low, self.high, self.ratio_cap,
                              logp=x.logp, old_logp=x.old_logp)
