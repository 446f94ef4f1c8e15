"""RLOO (Ahmadian et al., 2024, "Back to Basics"): REINFORCE with a leave-one-out baseline over G samples."""

from __future__ import annotations

from typing import Any

from lightning_rl.algorithms.learner_options import ObjectiveOptions
from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.step.estimators import AdvantageEstimator, LeaveOneOut


class RLOO(OnlineRL):
    """RLOO preset: advantage ``r_i - mean of the group's other G - 1 rewards`` (unbiased, no std scaling;
    ``advantage: null`` means this estimator), token-level PPO clip 0.2 (exactly REINFORCE with one update
    per rollout), ``token-mean``, no KL term.

    Every other group is :class:`~lightning_rl.algorithms.online.OnlineRL`'s.
    """

    def __init__(
        self, *args: Any, advantage: AdvantageEstimator | None = None,
        objective: ObjectiveOptions = ObjectiveOptions(aggregation="token-mean"), **kwargs: Any,
    ) -> None:
        super().__init__(*args, advantage=advantage if advantage is not None else LeaveOneOut(),
                         objective=objective, **kwargs)
