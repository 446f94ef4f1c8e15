"""SAPO (Gao et al., 2025, Qwen): a soft sigmoid gate instead of a hard clip."""

from __future__ import annotations

from typing import Any

from lightning_rl.algorithms.online import OnlineRL
from lightning_rl.maths.aggregation import Aggregation
from lightning_rl.maths.trust_regions import TrustRegion


class SAPO(OnlineRL):
    """SAPO preset: gate ``f(r) = 4 / tau * sigmoid(tau (r - 1))``, ``tau`` 1.0 for positive and 1.05 for
    negative advantages, ``seq-mean-token-mean``, no KL. Logs ``policy/gate_weight_mean``.

    Unlike verl, the aggregation setting is honoured.
    """

    def __init__(
        self,
        *args: Any,
        trust_region: TrustRegion = "soft_gate",
        tau_pos: float = 1.0,
        tau_neg: float = 1.05,
        aggregation: Aggregation = "seq-mean-token-mean",
        kl_coef: float = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, trust_region=trust_region, tau_pos=tau_pos, tau_neg=tau_neg,
                         aggregation=aggregation, kl_coef=kl_coef, **kwargs)
