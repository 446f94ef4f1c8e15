"""SAPO (Gao et al., 2025, Qwen): a soft sigmoid gate instead of a hard clip."""

from __future__ import annotations

from typing import Any

from lightning_rl.algorithms.learner_options import ObjectiveOptions
from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.maths.trust_regions import SoftGate


class SAPO(OnlineRL):
    """SAPO preset: gate ``f(r) = 4 / tau * sigmoid(tau (r - 1))``, ``tau`` 1.0 for positive and 1.05 for
    negative advantages, ``seq-mean-token-mean``, no KL. Logs ``policy/gate_weight_mean``.

    Unlike verl, the aggregation setting is honoured.
    """

    def __init__(self, *args: Any, objective: ObjectiveOptions = ObjectiveOptions(trust_region=SoftGate()),
                 **kwargs: Any) -> None:
        super().__init__(*args, objective=objective, **kwargs)
