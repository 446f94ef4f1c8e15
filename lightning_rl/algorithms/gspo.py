"""GSPO (Zheng et al., 2025): a length-normalised sequence-level ratio with a very narrow clip."""

from __future__ import annotations

from typing import Any

from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.maths.aggregation import Aggregation
from lightning_rl.maths.ratio_levels import RatioLevel


class GSPO(OnlineRL):
    """GSPO preset: sequence ratio ``exp(mean_t log r_t)``, clip ``[1 - 3e-4, 1 + 4e-4]``, no KL.

    The clip only matters off-policy, i.e. with ``num_minibatches`` or ``ppo_epochs`` above 1.
    """

    def __init__(
        self,
        *args: Any,
        ratio_level: RatioLevel = "sequence",
        clip_low: float = 3e-4,
        clip_high: float = 4e-4,
        aggregation: Aggregation = "seq-mean-token-mean",
        kl_coef: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, ratio_level=ratio_level, clip_low=clip_low, clip_high=clip_high,
                         aggregation=aggregation, kl_coef=kl_coef, **kwargs)
