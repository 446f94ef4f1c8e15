"""Rollout filters: stages between rewards and advantages that drop (and may refill) groups.

A filter gets the scored rollout, a ``refill()`` closure from the module (it samples and scores a fresh
prompt batch and returns ``(rollout, statistics)``) and the step's :class:`Collectives`; it returns the
rollout to train on and its own statistics. It never reaches into the LightningModule or the DataModule.
Name filters in YAML under ``model.init_args.filters`` (``class_path`` + ``init_args``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_rl.maths.advantages import group_spread
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.rollout import Rollout, merge_stats

Refill = Callable[[], tuple[Rollout, dict[str, float]]]


def group_size(rollout: Rollout) -> int:
    """Samples per group (groups are consecutive and equally sized)."""
    return len(rollout) // max(rollout.num_groups, 1)


class RolloutFilter:
    """The filter seam: subclass and implement ``__call__``."""

    def __call__(self, rollout: Rollout, refill: Refill,
                 collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        raise NotImplementedError


class DynamicSampling(RolloutFilter):
    """DAPO's dynamic sampling: keep the groups whose samples' outcomes differ, refill from new prompts
    until as many groups as the batch had prompts are kept or ``max_gen_batches`` rounds ran.

    A group with one outcome has zero advantage everywhere: it adds nothing to the gradient but still
    counts in token-mean denominators. The outcome (``rollout.outcome``) is verifiable correctness where
    there is a correctness signal (a correctness function, the environments' ``info["correct"]``); where
    correctness is only read off the main reward function at its full score, it is that function's raw
    score (verl's ``filter_groups.metric`` on the reward): the same for a 0 / 1 function, while a shaped
    one's group that never reaches 1.0 but scores differently is kept. Never the shaped total: an overlong
    penalty cannot make an all-wrong group look informative.
    Under GDPO (``model.advantage`` ``GDPO``) without a correctness signal of its own, the outcome is the sum
    of the functions' group-normalised scores that the advantages come from: a group whose summed reward (or
    main function) is constant while the functions vary is kept (SkyRL#2104).

    The number of rounds is agreed by all ranks: before each refill a "this rank needs more" flag is
    all-reduced (max) and every rank refills while any rank needs to (a full rank's extra groups are
    trimmed): under sharded weights sampling is itself a collective, and the refill streams stay aligned.
    Logs ``rollout/filtered_group_frac`` (dropped / generated groups) and ``rollout/gen_batches``.

    Args:
        max_gen_batches: generation rounds per step, the first included (>= 1).
    """

    def __init__(self, max_gen_batches: int = 3) -> None:
        if max_gen_batches < 1:
            raise ValueError(f"`model.filters.max_gen_batches` must be >= 1, got {max_gen_batches}")
        self.max_gen_batches = max_gen_batches

    @staticmethod
    def keep(rollout: Rollout, size: int) -> Rollout:
        outcome = rollout.outcome if rollout.outcome is not None else rollout.correct
        return rollout.select(group_spread(outcome, size).repeat_interleave(size))

    def __call__(self, rollout: Rollout, refill: Refill,
                 collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        size, target = group_size(rollout), rollout.num_groups
        kept = [self.keep(rollout, size)]
        generated, rounds, stats = target, 1, {}
        while rounds < self.max_gen_batches:
            need = sum(len(k) for k in kept) < target * size
            if not collectives.any(need, rollout.rewards.device):
                break
            more, more_stats = refill()
            stats = merge_stats(stats, more_stats)
            kept.append(self.keep(more, size))
            generated += more.num_groups
            rounds += 1
        nonempty = [k for k in kept if len(k)]
        out = Rollout.cat(nonempty) if nonempty else kept[0]
        out = out.select(torch.arange(min(len(out), target * size), device=out.rewards.device))
        stats["rollout/filtered_group_frac"] = 1.0 - sum(len(k) for k in kept) / size / generated
        stats["rollout/gen_batches"] = float(rounds)
        return out, stats


class DropUniformGroups(RolloutFilter):
    """The peers' way to spend no compute on groups without signal (prime-rl, open-instruct): drop the groups
    whose rewards are all equal (their group-relative advantage is zero), with no refill.

    Unlike the updater's exact skipping (``model.update.skip_zero_rows``, the default), this **changes the
    loss**: the dropped rows leave the normalisers (``token-mean``'s token count, the sequence means' row
    count), so each remaining token weighs more, and a KL or entropy term no longer reaches the dropped
    rows. Under GDPO it reads the decoupled sums the advantages come from (``rollout.decoupled_rewards``): a
    group whose summed reward is constant while its functions vary carries signal (SkyRL#2104). Named in YAML
    under ``model.filters.extra`` (``class_path:
    lightning_rl.step.filters.DropUniformGroups``). Logs ``rollout/dropped_uniform_group_frac``; a rank left
    without rows joins the update with empty micro-batches.
    """

    def __call__(self, rollout: Rollout, refill: Refill,
                 collectives: Collectives) -> tuple[Rollout, dict[str, float]]:
        size = group_size(rollout)
        spread = rollout.rewards if rollout.decoupled_rewards is None else \
            torch.round(rollout.decoupled_rewards, decimals=6)
        keep = group_spread(spread, size)
        dropped = 1.0 - float(keep.float().mean()) if len(keep) else 0.0
        return rollout.select(keep.repeat_interleave(size)), {"rollout/dropped_uniform_group_frac": dropped}
