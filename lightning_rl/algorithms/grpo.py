"""GRPO (Shao et al., 2024, DeepSeekMath): group-relative advantages, token-level PPO clip,
k3 KL in the loss.
"""

from __future__ import annotations

from typing import Any

from lightning_rl.algorithms.learner_options import ObjectiveOptions
from lightning_rl.algorithms.online import OnlineRL


class GRPO(OnlineRL):
    """GRPO preset: clip 0.2, ``seq-mean-token-mean``, KL to the reference (k3, coefficient 0.04).

    Every other group is :class:`~lightning_rl.algorithms.online.OnlineRL`'s.
    """

    def __init__(self, *args: Any, objective: ObjectiveOptions = ObjectiveOptions(kl_coef=0.04),
                 **kwargs: Any) -> None:
        super().__init__(*args, objective=objective, **kwargs)
