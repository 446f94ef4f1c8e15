"""Off-policy correction: when the rollout engine is not the trained module (a bf16 copy, a server), its
log-probs of the sampled tokens (``rollout_logp``) differ from the trainer's behaviour log-probs
(``old_logp``), and the samples are off-policy for the trainer. Truncated (TIS) or masked (MIS) importance
weights ``w = f(exp(old_logp - rollout_logp))``, detached, multiply the policy loss per token (verl's
rollout correction, TRL's vLLM importance sampling, OpenRLHF's TIS / ICEPOP); the gap is logged every step
(``rollout/mismatch_*``, ``rollout/is_*``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from torch import Tensor

from lightning_rl.maths.checks import require as require_in
from lightning_rl.maths.rollout_weights import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    rollout_is_weights,
    rollout_mismatch_stats,
)
from lightning_rl.step.rollout import Rollout


class RolloutCorrection:
    """The correction-weights stage (``model.init_args.logprobs.correction``).

    Applied when a rollout carries the engine's ``rollout_logp`` and the trainer recomputed ``old_logp``
    (decoupled: engine, behaviour and current policy are three); with ``logprobs.behaviour: from_engine``
    (bypass) the engine is the behaviour policy and nothing needs correcting.

    Args:
        level: ``token`` (per-token ratios), ``sequence`` (the row's summed log-ratio, the product ratio, on
            each token) or ``geometric`` (the row's mean log-ratio: the geometric mean of its token ratios).
        mode: ``truncate`` (``clamp(w, low, cap)``, TIS), ``mask`` (0 where ``w`` is outside ``[low, cap]``,
            MIS / ICEPOP; at sequence or geometric level the whole row), or ``off`` (weights 1; the mismatch
            is still measured and logged).
        cap: the upper bound, >= 1 (verl's TIS default 2.0).
        low: the lower bound, in ``[0, 1]`` (0: none). E.g. ``level: geometric, mode: mask, low: 0.99,
            cap: 1.01`` trains only on sequences whose geometric ratio is within 1%; ``level: token, mode:
            mask, low: 0.5, cap: 2`` is OpenRLHF's ICEPOP.
    """

    def __init__(self, level: Literal["token", "sequence", "geometric"] = "token",
                 mode: Literal["truncate", "mask", "off"] = "truncate", cap: float = 2.0,
                 low: float = 0.0) -> None:
        modes = (*ROLLOUT_IS_MODES, "off")
        require_in("model.logprobs.correction",
                   level=(level in ROLLOUT_IS_LEVELS, level, f"one of {', '.join(ROLLOUT_IS_LEVELS)}"),
                   mode=(mode in modes, mode, f"one of {', '.join(modes)}"),
                   cap=(cap >= 1, cap, ">= 1 (an on-policy weight of 1 must survive)"),
                   low=(0 <= low <= 1, low, "in [0, 1] (an on-policy weight of 1 must survive)"))
        self.level, self.mode, self.cap, self.low = level, mode, cap, low

    def __call__(self, rollout: Rollout, collectives: object = None) -> tuple[Rollout, dict[str, float]]:
        """The rollout with ``is_weights`` (when correcting; the input is left as it was) and the mismatch
        statistics: a learner stage (``collectives`` unused: its statistics are this rank's)."""
        engine, behaviour = rollout.rollout_logp, rollout.old_logp
        if engine is None or behaviour is None or behaviour is engine or not len(rollout):
            return rollout, {}
        weights, stats = self.weights(behaviour, engine, rollout.loss_mask)
        if weights is not None:
            rollout = replace(rollout, is_weights=weights)
        return rollout, {name: float(value) for name, value in stats.items()}

    def weights(self, behaviour: Tensor, engine: Tensor, mask: Tensor) -> tuple[Tensor | None, dict]:
        """``[B, T]`` correction weights of ``behaviour`` (the trainer's log-probs) against the engine's
        (``None`` with ``mode: off``) and the mismatch statistics (tensors). The step applies them before
        the update, or in the loss when the current log-probs are the behaviour's (one update per rollout:
        no separate pass)."""
        mode = "truncate" if self.mode == "off" else self.mode
        weights = rollout_is_weights(behaviour, engine, mask, self.level, mode, self.cap, self.low)
        stats = rollout_mismatch_stats(behaviour, engine, mask, weights, self.cap, level=self.level,
                                       mode=mode, low=self.low)
        return (None if self.mode == "off" else weights), stats
