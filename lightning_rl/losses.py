"""The published contract (DESIGN.md, "Contract: ``lightning_rl.losses``"): every loss, advantage, penalty and
importance-weight function under its contract name, importable from here whatever module of the maths layer
defines it (``lightning_rl.maths``: ``losses``, ``policy_presets``, ``advantages``, ``penalties``,
``rollout_weights``, ``aggregation``, ``trust_regions``, ``covariance_regions``, ``ratio_levels``,
``preference_losses``). Code inside the package imports from the defining module; users and the contract
tests from here.
"""

from lightning_rl.maths.advantages import (
    dapo_group_keep,
    distillation_advantages,
    explained_variance,
    gae_advantages,
    group_advantages,
    masked_moments,
    moments_mean_var,
    reinforce_baseline_advantages,
    reinforce_baseline_centered,
    rloo_advantages,
    token_rewards,
    whiten,
)
from lightning_rl.maths.aggregation import (
    AGGREGATIONS,
    AGGREGATORS,
    Aggregation,
    aggregate,
    masked_mean,
    normalizer_counts,
)
from lightning_rl.maths.covariance_regions import ClipCov, KLCov, clip_cov_surrogate, kl_cov_surrogate
from lightning_rl.maths.losses import broadcast_advantages, entropy_from_logits, policy_loss, value_loss
from lightning_rl.maths.penalties import (
    KL_ESTIMATORS,
    KLEstimator,
    adaptive_kl_coef,
    kl_penalty,
    overlong_penalty,
)
from lightning_rl.maths.policy_presets import dapo_loss, grpo_loss, gspo_loss, ppo_policy_loss, sapo_loss
from lightning_rl.maths.preference_losses import DPO_LOSS_TYPES, DPOLossType, dpo_loss, reward_model_loss
from lightning_rl.maths.ratio_levels import RATIO_LEVELS, RatioLevel, sequence_log_ratio, token_log_ratio
from lightning_rl.maths.rollout_weights import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    RolloutISLevel,
    RolloutISMode,
    rollout_is_weights,
    rollout_mismatch_stats,
)
from lightning_rl.maths.token_selection import (
    TokenSelection,
    clip_cov_mask,
    high_entropy_mask,
    kl_cov_mask,
    off_policy_sequence_mask,
    quantile_count,
    token_covariance,
    token_keys,
)
from lightning_rl.maths.trust_regions import (
    CISPO,
    DPPO,
    SAPO_LOG_RATIO_CLAMP,
    Clip,
    SoftGate,
    Surrogate,
    SurrogateInputs,
    TrustRegion,
    cispo_surrogate,
    clipped_surrogate,
    dppo_surrogate,
    soft_gate_surrogate,
)

__all__ = [
    "AGGREGATIONS", "AGGREGATORS", "DPO_LOSS_TYPES", "DPOLossType", "KL_ESTIMATORS", "RATIO_LEVELS",
    "Clip", "SoftGate", "CISPO", "DPPO", "ClipCov", "KLCov", "SurrogateInputs",
    "Aggregation", "KLEstimator", "RatioLevel", "Surrogate", "TrustRegion", "aggregate",
    "broadcast_advantages", "clipped_surrogate", "dapo_group_keep", "dapo_loss", "dpo_loss",
    "entropy_from_logits", "gae_advantages", "group_advantages", "grpo_loss", "gspo_loss", "kl_penalty",
    "masked_mean", "normalizer_counts", "overlong_penalty", "policy_loss", "ppo_policy_loss",
    "reward_model_loss", "sapo_loss", "sequence_log_ratio", "soft_gate_surrogate", "token_log_ratio",
    "value_loss", "adaptive_kl_coef", "explained_variance", "masked_moments", "moments_mean_var",
    "token_rewards", "whiten", "SAPO_LOG_RATIO_CLAMP", "cispo_surrogate",
    "reinforce_baseline_advantages", "reinforce_baseline_centered",
    "rloo_advantages", "rollout_is_weights", "rollout_mismatch_stats", "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES", "RolloutISLevel", "RolloutISMode", "distillation_advantages", "dppo_surrogate",
    "clip_cov_surrogate", "kl_cov_surrogate", "TokenSelection", "clip_cov_mask", "high_entropy_mask",
    "kl_cov_mask", "off_policy_sequence_mask", "quantile_count", "token_covariance", "token_keys",
]
