"""GSPO (Zheng et al., 2025): a length-normalised sequence-level ratio with a very narrow clip."""

from __future__ import annotations

from typing import Any

from lightning_rl.algorithms.learner_options import ObjectiveOptions
from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.maths.trust_regions import Clip


class GSPO(OnlineRL):
    """GSPO preset: sequence ratio ``exp(mean_t log r_t)``, clip ``[1 - 3e-4, 1 + 4e-4]``, no KL.

    The clip only matters off-policy, i.e. with ``update.num_minibatches`` or ``update.epochs`` above 1.
    """

    def __init__(
        self, *args: Any,
        objective: ObjectiveOptions = ObjectiveOptions(ratio_level="sequence", trust_region=Clip(3e-4, 4e-4)),
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, objective=objective, **kwargs)
