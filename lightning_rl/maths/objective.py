"""The policy objective as independent choices along DESIGN.md's axes, validated as config.

``Objective`` holds one point on the axes (ratio level, trust region and its options, aggregation,
KL to the reference) and calls :func:`lightning_rl.maths.losses.policy_loss`, the one implementation that
the contract losses (``grpo_loss``, ``gspo_loss``, ...) are presets of too. Here only the config lives:
choices, ranges, and combinations that cannot go together fail at construction, naming the YAML key.
A new trust region's options become fields here (its maths goes in :mod:`lightning_rl.maths.trust_regions`);
an option the chosen trust region does not take must stay at its default, or construction fails.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch

from lightning_rl.maths.aggregation import AGGREGATIONS, Aggregation
from lightning_rl.maths.losses import policy_loss
from lightning_rl.maths.penalties import KL_ESTIMATORS, KLEstimator
from lightning_rl.maths.ratio_levels import RATIO_LEVELS, RatioLevel
from lightning_rl.maths.trust_regions import TRUST_REGIONS, TrustRegion, trust_region_options

Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True)
class Objective:
    """One point in the space of clipped / gated policy-gradient objectives (keyword arguments only).

    Args:
        ratio_level: ``token`` (PPO, GRPO, DAPO, SAPO) or ``sequence`` (GSPO).
        trust_region: ``clip`` (PPO clip on ``[1 - clip_low, 1 + clip_high]``, dual clip with
            ``clip_ratio_c``), ``soft_gate`` (SAPO with ``tau_pos`` / ``tau_neg``) or ``cispo``
            (MiniMax-M1: ``-sg(min(r, 1 + clip_high)) A logp``; with ``ratio_level: sequence`` the capped
            weight is GSPO's sequence ratio).
        clip_low: lower clip range (``clip`` only).
        clip_high: upper clip range (``clip``), or the cap ``1 + clip_high`` on the weight (``cispo``).
        clip_ratio_c: dual-clip constant > 1, or ``None`` (``clip`` only).
        tau_pos, tau_neg: SAPO gate temperatures for positive / negative advantages (``soft_gate`` only);
            like every option the chosen trust region does not take, they must keep their defaults
            (clip_low 0.2, clip_high 0.2, clip_ratio_c None, tau_pos 1.0, tau_neg 1.05) or construction fails.
        aggregation: one of ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm`` (Dr. GRPO: the token sum over ``N_seq * aggregation_length``).
        kl_coef: coefficient of the KL-to-reference penalty in the loss (0: off, no reference needed).
        kl_estimator: ``k1``, ``k2`` or ``k3``.
        kl_clamp: clamp of the per-token KL term in the loss to ``[-kl_clamp, kl_clamp]`` (``None``: off): one
            token's KL spike (a token the policy all but dropped) cannot dominate the update. How often it
            bites: ``policy/kl_clamp_frac``; the largest per-token KL: ``policy/kl_ref_max``.
        aggregation_length: the constant length ``L`` of ``seq-mean-token-sum-norm``, >= 1 (the other
            aggregations ignore it); ``None``: each batch's ``T``, which depends on its padding. Training
            sets the completion budget (``ObjectiveOptions.aggregation_length``).
    """

    ratio_level: RatioLevel = "token"
    trust_region: TrustRegion = "clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    aggregation: Aggregation = "seq-mean-token-mean"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_clamp: float | None = None
    aggregation_length: int | None = None

    def __post_init__(self) -> None:
        choices = {
            "ratio_level": tuple(RATIO_LEVELS),
            "trust_region": tuple(TRUST_REGIONS),
            "aggregation": AGGREGATIONS,
            "kl_estimator": KL_ESTIMATORS,
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(
                    f"`model.objective.{key}`: unknown value {getattr(self, key)!r}; expected one of "
                    f"{allowed}"
                )
        for key in ("clip_low", "clip_high", "tau_pos", "tau_neg"):
            if not getattr(self, key) > 0:
                raise ValueError(f"`model.objective.{key}` must be > 0, got {getattr(self, key)}")
        if self.clip_low >= 1:
            raise ValueError(f"`model.objective.clip_low` must be < 1, got {self.clip_low}")
        self._refuse_unused_options()
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            raise ValueError(f"`model.objective.clip_ratio_c` must be > 1, got {self.clip_ratio_c}")
        if self.kl_coef < 0:
            raise ValueError(f"`model.objective.kl_coef` must be >= 0, got {self.kl_coef}")
        if self.kl_clamp is not None and not self.kl_clamp > 0:
            raise ValueError(f"`model.objective.kl_clamp` must be > 0 or null, got {self.kl_clamp}")
        if self.aggregation_length is not None and not self.aggregation_length >= 1:
            raise ValueError(f"`model.objective.aggregation_length` must be >= 1 or null, "
                             f"got {self.aggregation_length}")

    def _refuse_unused_options(self) -> None:
        """An option of another trust region set away from its default would be ignored silently: refuse."""
        used = trust_region_options(self.trust_region)
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        for key in sorted({opt for name in TRUST_REGIONS for opt in trust_region_options(name)} - set(used)):
            if key in defaults and getattr(self, key) != defaults[key]:
                raise ValueError(
                    f"`model.objective.{key}` has no effect under `model.objective.trust_region: "
                    f"{self.trust_region}` (its "
                    f"options are {used}); leave it at its default {defaults[key]!r}, "
                    f"got {getattr(self, key)!r}"
                )

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def trust_region_args(self) -> dict[str, Any]:
        """The chosen trust region's options (its parameters after the common inputs), from the fields."""
        return {name: getattr(self, name) for name in trust_region_options(self.trust_region)}

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
        token_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, metrics)`` of one (micro-)batch; shapes as in :mod:`lightning_rl.maths.losses`."""
        if ref_logp is None and self.needs_reference:
            raise ValueError(f"`ref_logp` is None but `model.objective.kl_coef`={self.kl_coef}")
        return policy_loss(
            logp, old_logp, ref_logp, advantages, mask, ratio_level=self.ratio_level,
            trust_region=self.trust_region, trust_region_args=self.trust_region_args,
            aggregation=self.aggregation, kl_coef=self.kl_coef, kl_estimator=self.kl_estimator,
            num_tokens=num_tokens, num_seqs=num_seqs, token_weights=token_weights, kl_clamp=self.kl_clamp,
            aggregation_length=self.aggregation_length,
        )
