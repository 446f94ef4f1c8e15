"""Stage-level tests of the online RL step, without a model or a trainer: DAPO's dynamic sampling
(lightning_rl.step.filters.DynamicSampling) with a refill closure, on one process and under a fake multi-rank
strategy (the rounds are agreed over ranks)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_rl.step.collectives import Collectives
from lightning_rl.step.filters import DynamicSampling
from lightning_rl.step.rollout import Rollout, merge_stats


def fake_rollout(correct: list[list[int]], tag: int, rewards: list[list[float]] | None = None) -> Rollout:
    """Groups of ``len(correct[0])`` rows; ``lengths`` = 100 * tag + row, so kept rows can be traced."""
    G, n = len(correct[0]), len(correct) * len(correct[0])
    flat = torch.tensor([c for group in correct for c in group], dtype=torch.bool)
    r = torch.tensor([x for group in rewards for x in group]) if rewards else flat.float()
    mask = torch.ones(n, 2 + tag, dtype=torch.long)
    return Rollout(
        prompt_ids=torch.ones(n, 3, dtype=torch.long), prompt_mask=torch.ones(n, 3, dtype=torch.long),
        completion_ids=torch.ones(n, 2 + tag, dtype=torch.long), attention_mask=mask, loss_mask=mask.clone(),
        truncated=torch.zeros(n, dtype=torch.bool), lengths=torch.arange(n) + 100 * tag,
        group_ids=torch.arange(len(correct)).repeat_interleave(G), rewards=r, correct=flat,
    )


class Refill:
    """The module's refill closure: each call samples and scores a fresh prompt batch (here: the next of
    ``rounds``), reporting 1 s of generation."""

    def __init__(self, rounds):
        self.rounds, self.draws = list(rounds), 0

    def __call__(self):
        self.draws += 1
        return self.rounds.pop(0), {"perf/generation_time": 1.0}


def run_filter(first, more, max_gen_batches, collectives=None):
    refill = Refill(more)
    dynamic_sampling = DynamicSampling(max_gen_batches=max_gen_batches)
    out, stats = dynamic_sampling(first, refill, collectives or Collectives.local())
    # the step merges the filter's statistics into its own (first round: 1 s of generation)
    refill.stats = merge_stats({"perf/generation_time": 1.0}, stats)
    return out, refill


def test_dynamic_sampling_refills_until_full_and_trims():
    first = fake_rollout([[1, 1], [0, 1], [0, 0], [1, 0]], tag=0)  # keeps groups 1 and 3
    second = fake_rollout([[0, 0], [1, 1], [0, 0], [0, 0]], tag=1)  # keeps nothing
    third = fake_rollout([[1, 0], [0, 1], [1, 0], [1, 1]], tag=2)  # keeps 3 groups; only 2 fit
    out, refill = run_filter(first, [second, third], max_gen_batches=3)
    assert refill.draws == 2 and refill.rounds == []
    assert out.lengths.tolist() == [2, 3, 6, 7, 200, 201, 202, 203]  # target 4 groups, in order
    assert (out.num_groups == 4
            and out.correct.tolist() == [False, True, True, False, True, False, False, True])
    assert out.completion_ids.shape[1] == 4  # padded to the widest part
    assert out.attention_mask.shape == out.loss_mask.shape == (8, 4)
    assert out.attention_mask.sum(-1).tolist() == [2, 2, 2, 2, 4, 4, 4, 4]  # padding is out of the context
    assert torch.equal(out.loss_mask, out.attention_mask)
    assert out.advantages is None  # advantages come later, from the estimator, once
    # 12 groups generated, 5 kept by the filter: 7 / 12 dropped; 3 rounds; generation time summed
    assert refill.stats["rollout/filtered_group_frac"] == pytest.approx(7 / 12)
    assert refill.stats["rollout/gen_batches"] == 3.0
    assert refill.stats["perf/generation_time"] == 3.0


def test_dynamic_sampling_stops_when_full():
    first = fake_rollout([[1, 0, 0], [0, 1, 1]], tag=0)
    out, refill = run_filter(first, [], max_gen_batches=3)
    assert refill.draws == 0 and out.lengths.tolist() == list(range(6))
    assert refill.stats["rollout/filtered_group_frac"] == 0.0 and refill.stats["rollout/gen_batches"] == 1.0


def test_dynamic_sampling_gives_up_after_max_gen_batches():
    first = fake_rollout([[1, 1], [1, 0], [0, 0], [1, 1]], tag=0)
    second = fake_rollout([[0, 0], [0, 0], [0, 1], [1, 1]], tag=1)
    third = fake_rollout([[1, 0]] * 4, tag=2)  # never drawn
    out, refill = run_filter(first, [second, third], max_gen_batches=2)
    assert refill.draws == 1 and len(refill.rounds) == 1
    assert out.lengths.tolist() == [2, 3, 104, 105]
    assert refill.stats["rollout/filtered_group_frac"] == pytest.approx(1 - 2 / 8)
    assert refill.stats["rollout/gen_batches"] == 2.0


def test_dynamic_sampling_uses_correctness_not_rewards():
    # group 0: rewards differ (shaped) but all wrong -> dropped;
    # group 1: equal rewards, mixed correctness -> kept
    first = fake_rollout([[0, 0], [1, 0]], tag=0, rewards=[[-0.5, 0.0], [0.3, 0.3]])
    out, refill = run_filter(first, [], max_gen_batches=1)
    assert out.lengths.tolist() == [2, 3]
    assert refill.stats["rollout/filtered_group_frac"] == 0.5


def test_dynamic_sampling_compares_the_outcome_when_the_rollout_has_one():
    # correctness read off a shaped main reward: no sample is correct, but group 0's scores differ -> kept;
    # group 1 scores 0.3 throughout -> dropped (zero advantage everywhere)
    first = fake_rollout([[0, 0], [0, 0]], tag=0, rewards=[[0.2, 0.5], [0.3, 0.3]])
    first.outcome = first.rewards.clone()
    out, refill = run_filter(first, [], max_gen_batches=1)
    assert out.lengths.tolist() == [0, 1]
    assert refill.stats["rollout/filtered_group_frac"] == 0.5


def test_dynamic_sampling_everything_dropped():
    out, refill = run_filter(fake_rollout([[1, 1], [0, 0]], tag=0), [], max_gen_batches=1)
    assert len(out) == 0
    assert refill.stats["rollout/filtered_group_frac"] == 1.0 and refill.stats["rollout/gen_batches"] == 1.0


def test_dynamic_sampling_validates_max_gen_batches():
    with pytest.raises(ValueError, match="max_gen_batches"):
        DynamicSampling(max_gen_batches=0)


# ------------------------------------------------------------------ the rounds are agreed over ranks
def fake_ranks(other_rank_needs: list[bool]) -> tuple[Collectives, list[float]]:
    """Collectives of a fake 2-rank strategy whose other rank reports, at its k-th max-reduce, whether it
    still needs groups (``other_rank_needs[k]``). Returns them and this rank's reported flags."""
    mine, theirs = [], list(other_rank_needs)

    def reduce(value, reduce_op):
        assert reduce_op == "max" and value.numel() == 1
        mine.append(float(value))
        return torch.maximum(value, torch.tensor(float(theirs.pop(0)), dtype=value.dtype))

    strategy = SimpleNamespace(reduce=reduce, root_device=torch.device("cpu"))
    trainer = SimpleNamespace(strategy=strategy, world_size=2, global_rank=0)
    return Collectives(trainer), mine


def test_dynamic_sampling_refills_while_any_rank_needs_groups_and_trims_a_full_rank():
    first = fake_rollout([[1, 0], [0, 1]], tag=0)  # full already: both groups mixed
    second = fake_rollout([[0, 1], [1, 1]], tag=1)  # drawn only because the other rank needs it
    third = fake_rollout([[1, 0], [1, 0]], tag=2)  # never drawn: no rank needs more
    collectives, mine = fake_ranks([True, False])
    out, refill = run_filter(first, [second, third], max_gen_batches=3, collectives=collectives)
    assert mine == [0.0, 0.0]  # this rank never needed more, yet joined both agreements
    assert refill.draws == 1 and len(refill.rounds) == 1  # one refill, as on the other rank
    assert out.lengths.tolist() == [0, 1, 2, 3]  # the refilled group is trimmed: the target is 2 groups
    assert refill.stats["rollout/gen_batches"] == 2.0
    assert refill.stats["rollout/filtered_group_frac"] == pytest.approx(1 - 3 / 4)


def test_dynamic_sampling_stops_when_no_rank_needs_groups():
    first = fake_rollout([[1, 1], [0, 1]], tag=0)  # one group short
    second = fake_rollout([[1, 0], [1, 1]], tag=1)  # fills it
    collectives, mine = fake_ranks([False, False])
    out, refill = run_filter(first, [second], max_gen_batches=5, collectives=collectives)
    assert mine == [1.0, 0.0]  # needed one refill, then was full: the agreement stops every rank
    assert refill.draws == 1 and out.lengths.tolist() == [2, 3, 100, 101]
    assert refill.stats["rollout/gen_batches"] == 2.0
