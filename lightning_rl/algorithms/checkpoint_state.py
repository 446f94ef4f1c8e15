"""What a checkpoint holds beside the weights, optimisers and loop position: :class:`CheckpointState`.

Every module saves its RNG states (every rank's, gathered into the checkpoint rank 0 writes) and whether the
policy had PEFT adapters (a resume that does not match is refused before the weights load); the online step
adds the adaptive KL controller's value and the rollouts sampled ahead by a worker (every rank's). The
LightningModule's ``on_save_checkpoint`` / ``on_load_checkpoint`` hand the checkpoint to one of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_rl.errors import InputError
from lightning_rl.models.adapters import is_peft_model
from lightning_rl.step.rng import collect_rng_states


@dataclass
class CheckpointState:
    """The state a checkpoint carries for a module (see the module docstring).

    Args:
        policy_model: the trained transformers module (whether it is a PEFT model is saved and checked).
        kl_reward: the KL-in-reward stage, whose ``value`` (the adaptive coefficient) is saved; or ``None``.
        rollouts: the rollout source (``max_staleness``, ``state_dict(next_step)``, ``load_state_dict``):
            what it sampled ahead is saved when ``max_staleness`` > 0; ``None`` for offline modules.
    """

    policy_model: Any
    kl_reward: Any = None
    rollouts: Any = None

    def save(self, checkpoint: dict[str, Any], trainer: Any) -> None:
        """Write into ``checkpoint``. Every rank builds the checkpoint, so every rank joins the gathers (the
        same calls in the same order on every rank)."""
        checkpoint["rng_states"] = collect_rng_states()
        checkpoint["policy_peft"] = is_peft_model(self.policy_model)  # what `load` checks
        by_rank = gathered(trainer, checkpoint["rng_states"])
        if by_rank is not None:
            checkpoint["rng_states_by_rank"] = by_rank
        if self.kl_reward is not None:
            checkpoint["kl_coef_value"] = self.kl_reward.value  # the adaptive controller's state
        if self.rollouts is not None and self.rollouts.max_staleness:  # trained on after a resume
            next_step = trainer.fit_loop.epoch_loop.batch_progress.total.processed
            checkpoint["rollouts_ahead"] = mine = self.rollouts.state_dict(next_step)
            by_rank = gathered(trainer, mine)
            if by_rank is not None:
                checkpoint["rollouts_ahead_by_rank"] = by_rank

    def load(self, checkpoint: dict[str, Any], trainer: Any) -> Any:
        """Check the adapters, restore the KL controller and the rollouts sampled ahead (this rank's when
        resumed on the same world size), and return the RNG states to restore when training starts (this
        rank's on the same world size; otherwise the saved rank's, rank 0's)."""
        saved = checkpoint.get("policy_peft", saved_with_adapters(checkpoint.get("state_dict")))
        mismatch = adapters_mismatch(saved, is_peft_model(self.policy_model))
        if mismatch is not None:
            path = getattr(trainer, "ckpt_path", None) if trainer is not None else None
            raise InputError(f"the checkpoint{f' {path}' if path else ''} {mismatch}")
        by_rank = checkpoint.get("rng_states_by_rank")
        same_world = trainer is not None and bool(by_rank) and len(by_rank) == trainer.world_size
        rng_states = by_rank[trainer.global_rank] if same_world else checkpoint.get("rng_states")
        if self.kl_reward is not None and "kl_coef_value" in checkpoint:
            self.kl_reward.value = checkpoint["kl_coef_value"]
        if self.rollouts is not None:
            ahead = checkpoint.get("rollouts_ahead_by_rank")
            if ahead and len(ahead) == trainer.world_size:
                self.rollouts.load_state_dict(ahead[trainer.global_rank])
            elif "rollouts_ahead" in checkpoint and not ahead:
                self.rollouts.load_state_dict(checkpoint["rollouts_ahead"])
        return rng_states


def gathered(trainer: Any, value: Any) -> list[Any] | None:
    """``value`` of every rank, by rank (``None`` on one process)."""
    if trainer is None or trainer.world_size <= 1 or not torch.distributed.is_initialized():
        return None
    by_rank: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(by_rank, value)
    return by_rank


def saved_with_adapters(state_dict: dict[str, Any] | None) -> bool | None:
    """Whether a checkpoint's weights are a PEFT policy's (named ``policy.model.base_model...``), for
    checkpoints older than its ``policy_peft`` entry; None when it holds no policy weights (a sharded
    folder's, which the strategy loads itself)."""
    names = [k for k in state_dict or () if k.startswith("policy.model.")]
    return any(k.startswith("policy.model.base_model.") for k in names) if names else None


def adapters_mismatch(saved_peft: bool | None, peft_now: bool) -> str | None:
    """Why a checkpoint saved with (``saved_peft``) or without PEFT adapters does not fit this policy, with
    (``peft_now``) or without them; None when it fits or is not known."""
    if saved_peft is None or saved_peft == peft_now:
        return None
    if saved_peft:
        return ("holds PEFT (LoRA) adapters, saved by a run with `model.policy.peft`, but this config has no "
                "`model.policy.peft`: resume it with the `model.policy.peft` of the run that saved it")
    return ("holds a full model's weights, saved by a run without `model.policy.peft`, but this config sets "
            "`model.policy.peft`: resume it without `model.policy.peft` (to train adapters on these "
            "weights, start a new run from its exported policy folder)")
