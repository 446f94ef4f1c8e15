"""The policy objective as independent choices along DESIGN.md's axes, validated as config.

``Objective`` holds one point on the axes (ratio level, trust region, aggregation, KL to the reference, the
token selections) and calls :func:`lightning_rl.maths.losses.policy_loss`, the one implementation that the
contract losses (``grpo_loss``, ``gspo_loss``, ...) are presets of too. Here only the config lives: choices,
ranges, and combinations that cannot go together fail at construction, naming the YAML key. The trust region
is a typed choice that holds its own options (:mod:`lightning_rl.maths.trust_regions`): a new one is written
there and nothing here changes. The token selections that are statistics of a whole minibatch (high-entropy
tokens, Clip-Cov, KL-Cov) are composed by :meth:`Objective.select` from
:mod:`lightning_rl.maths.token_selection` and the trust region's own ``select``, once per minibatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_rl.maths.aggregation import AGGREGATIONS, Aggregation
from lightning_rl.maths.checks import require
from lightning_rl.maths.losses import broadcast_advantages, policy_loss
from lightning_rl.maths.penalties import KL_ESTIMATORS, KLEstimator
from lightning_rl.maths.ratio_levels import RATIO_LEVELS, RatioLevel
from lightning_rl.maths.token_selection import Reduce, TokenSelection, high_entropy_mask, one_process
from lightning_rl.maths.trust_regions import Clip, TrustRegion

Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True)
class Objective:
    """One point in the space of clipped / gated policy-gradient objectives (keyword arguments only).

    Args:
        ratio_level: ``token`` (PPO, GRPO, DAPO, SAPO) or ``sequence`` (GSPO).
        trust_region: a :class:`~lightning_rl.maths.trust_regions.TrustRegion` holding its own options:
            ``Clip`` (PPO clip on ``[1 - low, 1 + high]``, dual clip), ``SoftGate`` (SAPO), ``CISPO``
            (MiniMax-M1; with ``ratio_level: sequence`` the capped weight is GSPO's sequence ratio), ``DPPO``
            (a divergence mask instead of the clip), ``ClipCov`` or ``KLCov`` (covariance-selected tokens
            stopped or KL-penalised). In YAML a ``class_path`` (the class name is enough) and ``init_args``.
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
        top_entropy_quantile: ``rho`` in [0, 1]: only the tokens whose entropy is at least the minibatch's
            ``1 - rho`` quantile keep their surrogate (1: off; 0.2 the paper's); any trust region.
        off_policy_mask_threshold: OPSM's ``delta`` >= 0 (``None``: off); any trust region: the surrogate
            of a token with a negative advantage in a row whose mean ``sampler_logp - logp`` exceeds it is
            dropped.

    Batch statistics (``top_entropy_quantile`` < 1, a trust region that selects tokens) are made by
    :meth:`select` over the whole minibatch and every rank, and passed to each micro-batch's call
    (:attr:`selects_tokens`).
    """

    ratio_level: RatioLevel = "token"
    trust_region: TrustRegion = field(default_factory=Clip)
    aggregation: Aggregation = "seq-mean-token-mean"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_clamp: float | None = None
    aggregation_length: int | None = None
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None

    def __post_init__(self) -> None:
        choices = {"ratio_level": tuple(RATIO_LEVELS), "aggregation": AGGREGATIONS,
                   "kl_estimator": KL_ESTIMATORS}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"`model.objective.{key}`: unknown value {getattr(self, key)!r}; "
                                 f"expected one of {allowed}")
        if not isinstance(self.trust_region, TrustRegion):
            raise ValueError(f"`model.objective.trust_region` must be a trust region (a subclass of "
                             f"lightning_rl.maths.trust_regions.TrustRegion: Clip, SoftGate, CISPO, DPPO, "
                             f"ClipCov, KLCov), got {self.trust_region!r}")
        length, clamp, opsm = self.aggregation_length, self.kl_clamp, self.off_policy_mask_threshold
        require("model.objective", kl_coef=(self.kl_coef >= 0, self.kl_coef, ">= 0"),
                kl_clamp=(clamp is None or clamp > 0, clamp, "> 0 or null"),
                aggregation_length=(length is None or length >= 1, length, ">= 1 or null"),
                top_entropy_quantile=(0 <= self.top_entropy_quantile <= 1, self.top_entropy_quantile,
                                      "in [0, 1] (1: off)"),
                off_policy_mask_threshold=(opsm is None or opsm >= 0, opsm, ">= 0 or null (off)"))

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def selects_tokens(self) -> bool:
        """Whether a call needs :meth:`select`'s whole-minibatch selection (entropy, Clip-Cov, KL-Cov)."""
        return self.top_entropy_quantile < 1 or self.trust_region.selects_tokens

    def select(self, logp: Tensor, old_logp: Tensor | None, advantages: Tensor, mask: Tensor,
               entropy: Tensor | None, *, keys: Tensor | None = None, total: Reduce = one_process,
               gather: Reduce = one_process) -> TokenSelection:
        """The batch-statistic selections of one minibatch, from its values before the update.

        Args:
            logp, entropy: ``[B, T]`` the trained policy's log-probs and entropies of the minibatch's tokens,
                detached (``entropy`` may be None without ``top_entropy_quantile``). old_logp: ``[B, T]``
                behaviour log-probs, or None (on-policy: ``logp``). advantages: ``[B]`` or ``[B, T]``.
            keys: ``[B, T]`` the trust region's random keys (:func:`token_keys`; ``None``: the global RNG's).
            total, gather: sums and concatenations over ranks (``token_selection``'s protocol).
        """
        mask = mask.bool()
        high_entropy = None
        if self.top_entropy_quantile < 1:
            if entropy is None:
                raise ValueError("`model.objective.top_entropy_quantile` < 1 needs the tokens' entropies")
            high_entropy = high_entropy_mask(entropy, mask, self.top_entropy_quantile, total=total,
                                             gather=gather)
        if not self.trust_region.selects_tokens:
            return TokenSelection(high_entropy, None)
        level = RATIO_LEVELS[self.ratio_level]
        adv = level.advantages(broadcast_advantages(advantages, logp), mask)
        log_ratio = level.log_ratio(logp, logp if old_logp is None else old_logp, mask)
        return TokenSelection(high_entropy, self.trust_region.select(logp, log_ratio, adv, mask, keys,
                                                                     total=total, gather=gather))

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
            trust_region=self.trust_region, aggregation=self.aggregation, kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            num_tokens=num_tokens, num_seqs=num_seqs, token_weights=token_weights, kl_clamp=self.kl_clamp,
            aggregation_length=self.aggregation_length, selection=selection, sampler_logp=sampler_logp,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
        )
