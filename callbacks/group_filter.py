"""DAPO dynamic sampling: train only on groups whose samples disagree."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_rl.callbacks.base import RLCallback
from lightning_rl.losses import dapo_group_keep
from lightning_rl.rollout import Rollout


class DAPOGroupFilter(RLCallback):
    """Drop groups whose samples are all correct or all wrong, and refill from new prompts.

    A group with one outcome has zero advantage everywhere: it adds nothing to the gradient but
    still counts in token-mean denominators, shrinking the effective step. The filter keeps
    generating from fresh prompts until the batch holds as many informative groups as it had
    prompts, or ``max_gen_batches`` rounds are spent; then it trains on what it has. It filters on
    verifiable correctness (``rollout.correct``), never on a shaped reward, so an overlong penalty
    cannot make an all-wrong group look informative.

    The number of rounds is agreed by all ranks: before each refill, a "this rank needs more groups"
    flag is all-reduced (max), and every rank generates another round while *any* rank needs one. A
    rank that is already full generates too (its extra groups are trimmed off): under sharded
    strategies ``generate`` is itself a collective, and every rank draws the same refill batches, so
    the refill stream stays aligned across ranks and the ranks' refill prompts never overlap. Every
    rank thus makes one all-reduce per refill decision (at most ``max_gen_batches - 1``) and the same
    number of generation rounds.

    Logs ``rollout/filtered_group_frac`` (dropped / generated groups) and ``rollout/gen_batches``.

    Args:
        max_gen_batches: generation rounds per step, the first included (>= 1).
    """

    def __init__(self, max_gen_batches: int = 3) -> None:
        if max_gen_batches < 1:
            raise ValueError(f"`max_gen_batches` must be >= 1, got {max_gen_batches}")
        self.max_gen_batches = max_gen_batches

    def keep(self, rollout: Rollout, group_size: int) -> Rollout:
        groups = dapo_group_keep(rollout.correct, group_size)
        return rollout.select(groups.repeat_interleave(group_size))

    @staticmethod
    def any_rank_needs_more(trainer: L.Trainer | None, need: bool, device: torch.device) -> bool:
        """Whether any rank still lacks groups: an all-reduce (max) of ``need`` on every rank."""
        if trainer is None:  # unit tests drive the filter without a trainer: one process
            return need
        flag = torch.tensor(float(need), device=device)
        return bool(trainer.strategy.reduce(flag, reduce_op="max") > 0)

    def on_rollout_scored(
        self, trainer: L.Trainer, pl_module: Any, rollout: Rollout
    ) -> tuple[Rollout, dict[str, float]]:
        G = pl_module.num_generations
        target = rollout.num_groups
        kept = [self.keep(rollout, G)]
        generated, rounds, stats = target, 1, {}
        device = rollout.rewards.device
        while rounds < self.max_gen_batches:
            need = sum(len(k) for k in kept) < target * G
            if not self.any_rank_needs_more(trainer, need, device):
                break
            more, more_stats = pl_module.generate_and_score(pl_module.draw_prompts())
            stats = {k: stats.get(k, 0.0) + v for k, v in more_stats.items()}
            kept.append(self.keep(more, G))
            generated += more.num_groups
            rounds += 1
        out = Rollout.cat([k for k in kept if len(k)]) if any(len(k) for k in kept) else kept[0]
        out = out.select(torch.arange(min(len(out), target * G), device=out.rewards.device))
        stats["rollout/filtered_group_frac"] = 1.0 - sum(len(k) for k in kept) / G / generated
        stats["rollout/gen_batches"] = float(rounds)
        return out, stats
