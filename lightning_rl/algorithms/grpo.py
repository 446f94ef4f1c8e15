"""GRPO (Shao et al., 2024, DeepSeekMath): group-relative advantages, token-level PPO clip,
k3 KL in the loss.
"""

from __future__ import annotations

from typing import Any

from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.maths.advantages import KLEstimator
from lightning_rl.maths.aggregation import Aggregation


class GRPO(OnlineRL):
    """GRPO preset: clip 0.2, ``seq-mean-token-mean``, KL to the reference (k3, coefficient 0.04).

    Every other axis is open: see :class:`~lightning_rl.algorithms.online.OnlineRL`.
    """

    def __init__(
        self,
        *args: Any,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        aggregation: Aggregation = "seq-mean-token-mean",
        kl_coef: float = 0.04,
        kl_estimator: KLEstimator = "k3",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, clip_low=clip_low, clip_high=clip_high, aggregation=aggregation,
                         kl_coef=kl_coef, kl_estimator=kl_estimator, **kwargs)
