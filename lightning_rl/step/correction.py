"""Off-policy correction: when the rollout engine is not the trained module (a bf16 copy, a server), its
log-probs of the sampled tokens (``rollout_logp``) differ from the trainer's behaviour log-probs
(``old_logp``), and the samples are off-policy for the trainer. Truncated (TIS) or masked (MIS) importance
weights ``w = f(exp(old_logp - rollout_logp))``, detached, multiply the policy loss per token (verl's
rollout correction, TRL's vLLM importance sampling); the gap is logged every step (``rollout/mismatch_*``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from torch import Tensor

from lightning_rl.maths.rollout_weights import rollout_is_weights, rollout_mismatch_stats
from lightning_rl.step.rollout import Rollout


class RolloutCorrection:
    """The correction-weights stage (``model.init_args.logprobs.correction``).

    Applied when a rollout carries the engine's ``rollout_logp`` and the trainer recomputed ``old_logp``
    (decoupled: engine, behaviour and current policy are three); with ``behaviour_logp: from_engine``
    (bypass) the engine is the behaviour policy and nothing needs correcting.

    Args:
        level: ``token`` (per-token ratios) or ``sequence`` (the row's summed log-ratio on each token).
        mode: ``truncate`` (``min(w, cap)``, TIS), ``mask`` (0 where ``w > cap``, MIS), or ``off``
            (weights 1; the mismatch is still measured and logged).
        cap: the threshold, >= 1 (verl's TIS default 2.0).
    """

    def __init__(self, level: Literal["token", "sequence"] = "token",
                 mode: Literal["truncate", "mask", "off"] = "truncate", cap: float = 2.0) -> None:
        if level not in ("token", "sequence") or mode not in ("truncate", "mask", "off") or not cap >= 1:
            raise ValueError("`model.logprobs.correction`: `level` must be token or sequence, `mode` "
                             "truncate, "
                             f"mask or off, `cap` >= 1; got {level!r}, {mode!r}, {cap}")
        self.level, self.mode, self.cap = level, mode, cap

    def __call__(self, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
        """The rollout with ``is_weights`` (when correcting; the input is left as it was) and the mismatch
        statistics."""
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
        weights = rollout_is_weights(behaviour, engine, mask, self.level, mode, self.cap)
        stats = rollout_mismatch_stats(behaviour, engine, mask, weights, self.cap, level=self.level)
        return (None if self.mode == "off" else weights), stats
