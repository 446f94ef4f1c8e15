"""The policy objective as independent choices along DESIGN.md's axes, validated as config.

``Objective`` holds one point on the axes (ratio level, trust region and its options, aggregation,
KL to the reference) and calls :func:`lightning_rl.maths.losses.policy_loss`, the one implementation that
the contract losses (``grpo_loss``, ``gspo_loss``, ...) are presets of too. Here only the config lives:
choices, ranges, and combinations that cannot go together fail at construction, naming the YAML key.
A new trust region's options become fields here (its maths goes in :mod:`lightning_rl.maths.trust_regions`);
an option the chosen trust region does not take must stay at its default, or construction fails. The token
selections that are statistics of a whole minibatch (high-entropy tokens, Clip-Cov, KL-Cov) are composed by
:meth:`Objective.select` from :mod:`lightning_rl.maths.token_selection`, once per minibatch.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal

import torch

from lightning_rl.maths.aggregation import AGGREGATIONS, Aggregation
from lightning_rl.maths.checks import require
from lightning_rl.maths.losses import broadcast_advantages, policy_loss
from lightning_rl.maths.penalties import KL_ESTIMATORS, KLEstimator
from lightning_rl.maths.ratio_levels import RATIO_LEVELS, RatioLevel
from lightning_rl.maths.token_selection import (
    Reduce,
    TokenSelection,
    clip_cov_mask,
    high_entropy_mask,
    kl_cov_mask,
    one_process,
    token_covariance,
)
from lightning_rl.maths.trust_regions import (
    TRUST_REGIONS,
    TrustRegion,
    clipped_surrogate,
    trust_region_options,
)

Tensor = torch.Tensor
DPPODivergence = Literal["tv", "kl"]
COVARIANCE_REGIONS = ("clip_cov", "kl_cov")  # trust regions whose selection is a minibatch statistic


@dataclass(frozen=True, kw_only=True)
class Objective:
    """One point in the space of clipped / gated policy-gradient objectives (keyword arguments only).

    Args:
        ratio_level: ``token`` (PPO, GRPO, DAPO, SAPO) or ``sequence`` (GSPO).
        trust_region: ``clip`` (PPO clip on ``[1 - clip_low, 1 + clip_high]``, dual clip with
            ``clip_ratio_c``), ``soft_gate`` (SAPO with ``tau_pos`` / ``tau_neg``), ``cispo``
            (MiniMax-M1: ``-sg(min(r, 1 + clip_high)) A logp``; with ``ratio_level: sequence`` the capped
            weight is GSPO's sequence ratio), ``dppo`` (a divergence mask instead of the clip), ``clip_cov``
            or ``kl_cov`` (covariance-selected tokens stopped or KL-penalised); see
            :mod:`lightning_rl.maths.trust_regions`.
        clip_low: lower clip range (``clip``, ``clip_cov``).
        clip_high: upper clip range (``clip``, ``clip_cov``), or the cap ``1 + clip_high`` on the weight
            (``cispo``).
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
        dppo_divergence, dppo_low, dppo_high, dppo_ratio_cap: ``dppo`` only: the divergence (``tv`` or
            ``kl``, on the sampled token), its thresholds for negative / positive advantages (> 0) and the cap
            on the gradient's ratio weight (> 0, or ``None``: uncapped).
        clip_cov_ratio, clip_cov_lb, clip_cov_ub: ``clip_cov`` only: the share of tokens in (0, 1] whose
            gradient is stopped, drawn from those with covariance in ``(clip_cov_lb, clip_cov_ub)``.
        kl_cov_ratio, kl_cov_coef: ``kl_cov`` only: the share in (0, 1] of largest-covariance tokens
            penalised, and the penalty's coefficient (>= 0).
        top_entropy_quantile: ``rho`` in [0, 1]: only the tokens whose entropy is at least the minibatch's
            ``1 - rho`` quantile keep their surrogate (1: off; 0.2 the paper's); any trust region.
        off_policy_mask_threshold: OPSM's ``delta`` >= 0 (``None``: off); any trust region.

    Batch statistics (``top_entropy_quantile`` < 1, ``clip_cov``, ``kl_cov``) are made by :meth:`select` over
    the whole minibatch and every rank, and passed to each micro-batch's call (:attr:`selects_tokens`).
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
    dppo_divergence: DPPODivergence = "tv"
    dppo_low: float = 0.2
    dppo_high: float = 0.2
    dppo_ratio_cap: float | None = None
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    kl_cov_coef: float = 1.0
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None

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
        self._check_selection_options()

    def _check_selection_options(self) -> None:
        """The ranges of the DPPO, Clip-Cov, KL-Cov, entropy and OPSM options, naming the key."""
        cap, opsm = self.dppo_ratio_cap, self.off_policy_mask_threshold
        require("model.objective",
                dppo_divergence=(self.dppo_divergence in ("tv", "kl"), self.dppo_divergence, "tv or kl"),
                dppo_low=(self.dppo_low > 0, self.dppo_low, "> 0"),
                dppo_high=(self.dppo_high > 0, self.dppo_high, "> 0"),
                dppo_ratio_cap=(cap is None or cap > 0, cap, "> 0 or null"),
                clip_cov_ratio=(0 < self.clip_cov_ratio <= 1, self.clip_cov_ratio, "in (0, 1]"),
                clip_cov_ub=(self.clip_cov_ub > self.clip_cov_lb, self.clip_cov_ub,
                             f"> clip_cov_lb ({self.clip_cov_lb})"),
                kl_cov_ratio=(0 < self.kl_cov_ratio <= 1, self.kl_cov_ratio, "in (0, 1]"),
                kl_cov_coef=(self.kl_cov_coef >= 0, self.kl_cov_coef, ">= 0"),
                top_entropy_quantile=(0 <= self.top_entropy_quantile <= 1, self.top_entropy_quantile,
                                      "in [0, 1] (1: off)"),
                off_policy_mask_threshold=(opsm is None or opsm >= 0, opsm, ">= 0 or null (off)"))

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
    def selects_tokens(self) -> bool:
        """Whether a call needs :meth:`select`'s whole-minibatch selection (entropy, Clip-Cov, KL-Cov)."""
        return self.top_entropy_quantile < 1 or self.trust_region in COVARIANCE_REGIONS

    def select(self, logp: Tensor, old_logp: Tensor | None, advantages: Tensor, mask: Tensor,
               entropy: Tensor | None, *, keys: Tensor | None = None, total: Reduce = one_process,
               gather: Reduce = one_process) -> TokenSelection:
        """The batch-statistic selections of one minibatch, from its values before the update.

        Args:
            logp, entropy: ``[B, T]`` the trained policy's log-probs and entropies of the minibatch's tokens,
                detached (``entropy`` may be None without ``top_entropy_quantile``). old_logp: ``[B, T]``
                behaviour log-probs, or None (on-policy: ``logp``). advantages: ``[B]`` or ``[B, T]``.
            keys: ``[B, T]`` Clip-Cov's random keys (:func:`token_keys`; ``None``: the global RNG's).
            total, gather: sums and concatenations over ranks (``token_selection``'s protocol).
        """
        mask = mask.bool()
        high_entropy = None
        if self.top_entropy_quantile < 1:
            if entropy is None:
                raise ValueError("`model.objective.top_entropy_quantile` < 1 needs the tokens' entropies")
            high_entropy = high_entropy_mask(entropy, mask, self.top_entropy_quantile, total=total,
                                             gather=gather)
        if self.trust_region not in COVARIANCE_REGIONS:
            return TokenSelection(high_entropy, None)
        level = RATIO_LEVELS[self.ratio_level]
        adv = level.advantages(broadcast_advantages(advantages, logp), mask)
        cov = token_covariance(logp, adv, mask, total=total)
        if self.trust_region == "kl_cov":
            return TokenSelection(high_entropy, kl_cov_mask(cov, mask, self.kl_cov_ratio, total=total,
                                                            gather=gather))
        log_ratio = level.log_ratio(logp, logp if old_logp is None else old_logp, mask)
        clipped = clipped_surrogate(log_ratio, adv, self.clip_low, self.clip_high).stats["clip_frac"]
        keys = torch.rand(logp.shape, device=logp.device) if keys is None else keys
        return TokenSelection(high_entropy, clip_cov_mask(cov, clipped, mask, self.clip_cov_ratio,
                                                          self.clip_cov_lb, self.clip_cov_ub, keys,
                                                          total=total, gather=gather))

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
        selection: TokenSelection | None = None,
        sampler_logp: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, metrics)`` of one (micro-)batch; shapes as in :mod:`lightning_rl.maths.losses`.

        ``selection``: this batch's rows of :meth:`select`'s result for the whole minibatch (required when
        :attr:`selects_tokens`). ``sampler_logp``: the sampling policy's log-probs, for OPSM (``None``:
        ``old_logp``)."""
        if ref_logp is None and self.needs_reference:
            raise ValueError(f"`ref_logp` is None but `model.objective.kl_coef`={self.kl_coef}")
        if self.selects_tokens and selection is None:
            raise ValueError("this objective selects tokens by minibatch statistics: pass "
                             "`selection=objective.select(...)` made over the whole minibatch")
        selection = selection if selection is not None else TokenSelection()
        return policy_loss(
            logp, old_logp, ref_logp, advantages, mask, ratio_level=self.ratio_level,
            trust_region=self.trust_region, trust_region_args=self.trust_region_args,
            aggregation=self.aggregation, kl_coef=self.kl_coef, kl_estimator=self.kl_estimator,
            num_tokens=num_tokens, num_seqs=num_seqs, token_weights=token_weights, kl_clamp=self.kl_clamp,
            aggregation_length=self.aggregation_length, selected=selection.selected,
            surrogate_mask=selection.high_entropy, sampler_logp=sampler_logp,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
        )
