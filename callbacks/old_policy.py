"""Behaviour-policy log-probs for the importance ratio."""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_rl.callbacks.base import RLCallback
from lightning_rl.rollout import Rollout


class OldPolicySnapshot(RLCallback):
    """Record the behaviour policy's log-probs of each rollout before its first update.

    With exactly one update per rollout (``ppo_epochs * num_minibatches == 1``) the policy being
    updated *is* the behaviour policy, so the ratio is exactly 1 and its gradient is the plain
    policy gradient: the extra forward pass is skipped and the current log-probs (detached) stand
    in. Otherwise the log-probs are computed once, with no gradient, right after generation.
    """

    def __init__(self) -> None:
        self.forward_passes = 0  # how many snapshots were computed (tests and logs read it)

    def on_rollout_end(self, trainer: L.Trainer, pl_module: Any, rollout: Rollout) -> None:
        if pl_module.updates_per_rollout == 1:
            rollout.old_logp = None
            return
        # an empty rollout still calls logprobs: under FSDP2 its forwards are collective on every rank
        rollout.old_logp = pl_module.logprobs(rollout)
        self.forward_passes += 1
