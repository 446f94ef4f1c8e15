"""The policy objective as independent choices along DESIGN.md's axes.

``Objective`` composes the pure pieces of :mod:`lightning_rl.losses`: a ratio level (token, or GSPO's
length-normalised sequence ratio), a trust region (PPO clip with optional dual clip, or SAPO's soft
gate), an aggregation mode and a KL-to-reference term. The named algorithms are presets of it, and
each preset equals its contract loss in ``losses.py`` (tests check value and gradient). Any other
combination is allowed; options that cannot go together fail at construction, naming the YAML key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_rl.losses import (
    _KL_FROM_DELTA,
    AGGREGATIONS,
    KL_ESTIMATORS,
    SAPO_LOG_RATIO_CLAMP,
    _broadcast_advantages,
    _clipped_surrogate,
    _masked_log_ratio,
    _policy_metrics,
    aggregate,
    masked_mean,
)

Tensor = torch.Tensor


def token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """``log r_t = logp_t - old_logp_t`` on valid tokens, 0 on padding. ``[B, T]``."""
    return _masked_log_ratio(logp, old_logp, mask)


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token ratio ``log s_it = sg[log s_i] + logp_t - sg[logp_t]``, ``log s_i`` the row's mean log-ratio.

    Its value is the sequence ratio on every token of the row; its gradient is ``s_i * grad logp_t``, so
    with ``seq-mean-token-mean`` it equals GSPO's sequence objective exactly, and with other aggregations
    it weights tokens the way those aggregations say.
    """
    log_ratio = _masked_log_ratio(logp, old_logp, mask)
    seq = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)
    per_token = seq.detach() + logp - logp.detach()
    return torch.where(mask, per_token, 0.0)


RATIO_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
}


@dataclass(frozen=True)
class Objective:
    """One point in the space of clipped / gated policy-gradient objectives.

    Args:
        ratio_level: ``token`` (PPO, GRPO, DAPO, SAPO) or ``sequence`` (GSPO).
        trust_region: ``clip`` (PPO clip on ``[1 - clip_low, 1 + clip_high]``, dual clip with
            ``clip_ratio_c``) or ``soft_gate`` (SAPO with ``tau_pos`` / ``tau_neg``).
        clip_low, clip_high: clip range (``clip`` only).
        clip_ratio_c: dual-clip constant > 1, or ``None`` (``clip`` only).
        tau_pos, tau_neg: SAPO gate temperatures for positive / negative advantages (``soft_gate`` only).
        aggregation: one of ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``.
        kl_coef: coefficient of the KL-to-reference penalty in the loss (0: off, no reference needed).
        kl_estimator: ``k1``, ``k2`` or ``k3``.
    """

    ratio_level: str = "token"
    trust_region: str = "clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    aggregation: str = "seq-mean-token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"

    def __post_init__(self) -> None:
        choices = {
            "ratio_level": tuple(RATIO_LEVELS),
            "trust_region": ("clip", "soft_gate"),
            "aggregation": AGGREGATIONS,
            "kl_estimator": KL_ESTIMATORS,
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"`model.{key}`: unknown value {getattr(self, key)!r}; expected one of {allowed}")
        positive = {"clip_low": self.clip_low, "clip_high": self.clip_high, "tau_pos": self.tau_pos, "tau_neg": self.tau_neg}
        for key, value in positive.items():
            if not value > 0:
                raise ValueError(f"`model.{key}` must be > 0, got {value}")
        if self.clip_low >= 1:
            raise ValueError(f"`model.clip_low` must be < 1, got {self.clip_low}")
        if self.clip_ratio_c is not None:
            if self.trust_region != "clip":
                raise ValueError("`model.clip_ratio_c` (dual clip) needs `model.trust_region: clip`")
            if self.clip_ratio_c <= 1:
                raise ValueError(f"`model.clip_ratio_c` must be > 1, got {self.clip_ratio_c}")
        if self.kl_coef < 0:
            raise ValueError(f"`model.kl_coef` must be >= 0, got {self.kl_coef}")

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def per_token(self, log_ratio: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-token loss ``[B, T]`` (to minimise) and metrics, before the KL term."""
        if self.trust_region == "soft_gate":
            return self._soft_gate(log_ratio, adv, mask)
        loss, ratio, flags = _clipped_surrogate(log_ratio, adv, self.clip_low, self.clip_high, self.clip_ratio_c)
        return loss, _policy_metrics(log_ratio, mask, ratio, flags, mask)

    def _soft_gate(self, log_ratio: Tensor, adv: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        # the straight-through part of a sequence log-ratio has value 0, so clamping keeps its gradient
        clamped = log_ratio.clamp(-SAPO_LOG_RATIO_CLAMP, SAPO_LOG_RATIO_CLAMP)
        ratio = torch.exp(clamped)
        tau = torch.where(adv > 0, ratio.new_tensor(self.tau_pos), ratio.new_tensor(self.tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1.0))
        metrics = _policy_metrics(clamped, mask, ratio, {}, mask)
        metrics["policy/gate_weight_mean"] = masked_mean((4.0 * gate * (1.0 - gate)).detach(), mask)
        return -4.0 / tau * gate * adv, metrics

    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        ref_logp: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        *,
        num_tokens: float | Tensor | None = None,
        num_seqs: float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, metrics)`` for one (micro-)batch; shapes as in :mod:`lightning_rl.losses`."""
        mask = mask.bool()
        adv = _broadcast_advantages(advantages, logp)
        log_ratio = RATIO_LEVELS[self.ratio_level](logp, old_logp, mask)
        loss, metrics = self.per_token(log_ratio, adv, mask)
        if ref_logp is not None:
            kl = _KL_FROM_DELTA[self.kl_estimator](_masked_log_ratio(ref_logp, logp, mask))
            loss = loss + self.kl_coef * kl
            metrics["policy/kl_ref"] = masked_mean(kl.detach(), mask)
        elif self.needs_reference:
            raise ValueError(f"`ref_logp` is None but `model.kl_coef`={self.kl_coef}")
        return aggregate(loss, mask, self.aggregation, num_tokens=num_tokens, num_seqs=num_seqs), metrics
