"""Tests for group rewards (lightning_rl.step.reward_calls) through RewardScorer, and GDPO through the rewards
stage, the GDPO estimator and DAPO's filter: a group whose summed reward is constant while its functions vary
is kept (SkyRL#2104)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from lightning_rl.step.collectives import Collectives
from lightning_rl.step.estimators import GDPO
from lightning_rl.step.filters import DropUniformGroups, DynamicSampling
from lightning_rl.step.reward_calls import RewardFunction, group_reward
from lightning_rl.step.reward_pipeline import RewardPipeline
from lightning_rl.step.reward_scorer import RewardError, RewardScorer
from lightning_rl.step.rewards import FullScore
from lightning_rl.step.rollout import Rollout

HERE = __name__
CALLS: list[list[str]] = []


@group_reward
def rank_by_length(prompts, completions, **_):
    """Scores a group by rank of length: the longest 1.0, the shortest 0.0 (one call per group)."""
    assert len(set(prompts)) == 1
    CALLS.append(list(completions))
    order = sorted(range(len(completions)), key=lambda i: len(completions[i]))
    return [order.index(i) / (len(completions) - 1) for i in range(len(completions))]


@group_reward
def one_short(completions, **_):
    return [1.0] * (len(completions) - 1)


@group_reward
def fails_on_b(prompts, completions, **_):
    if prompts[0] == "b":
        raise ValueError("cannot rank b")
    return [1.0] * len(completions)


@group_reward
async def slow_group(completions, **_):
    await asyncio.sleep(0.2)
    return [float(os.getpid())] * len(completions)


@group_reward
def pid_group(completions, **_):
    return [float(os.getpid())] * len(completions)


class Counted(RewardFunction):
    name = "counted"
    group_reward = True

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, prompts, completions, **_):
        self.calls += 1
        return [1.0] * len(completions)

    def pop_metrics(self):
        return {"rollout/counted_calls": float(self.calls)}


PROMPTS = ["a", "a", "a", "b", "b", "b"]
TEXTS = ["x", "xxx", "xx", "yy", "y", "yyy"]


def test_group_reward_is_called_once_per_group():
    CALLS.clear()
    scores = RewardScorer([f"{HERE}:rank_by_length"]).score(PROMPTS, TEXTS, group_size=3)
    assert CALLS == [["x", "xxx", "xx"], ["yy", "y", "yyy"]]
    assert scores.totals == [0.0, 1.0, 0.5, 0.5, 0.0, 1.0]
    CALLS.clear()  # without a group size (validation, predictions): runs of one prompt
    RewardScorer([f"{HERE}:rank_by_length"]).score(PROMPTS[:5], TEXTS[:5])
    assert CALLS == [["x", "xxx", "xx"], ["yy", "y"]]
    # as the main function's correctness (validation): per run of one prompt, at its full score
    correct = FullScore("rank", rank_by_length)(prompts=PROMPTS, completions=TEXTS)
    assert correct == [False, True, False, False, False, True]


def test_wrong_number_of_scores_names_the_function_and_the_group():
    with pytest.raises(RewardError, match=r"`.*:one_short` returned 2 scores for the 3 completions of "
                                          r"group 0 \(samples 0..2, prompt 'a'\)"):
        RewardScorer([f"{HERE}:one_short"], on_error="zero").score(PROMPTS, TEXTS, group_size=3)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        RewardScorer([f"{HERE}:one_short"]).score(PROMPTS, TEXTS, group_size=4)


def test_a_failing_group_fails_alone():
    scores = RewardScorer([f"{HERE}:fails_on_b"], on_error="zero").score(PROMPTS, TEXTS, group_size=3)
    assert scores.totals == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0] and scores.failed == {3, 4, 5}
    assert "cannot rank b" in str(scores.errors[0]) and "group 1" in str(scores.errors[0])
    with pytest.raises(RewardError, match="fails_on_b.*cannot rank b on group 1"):
        RewardScorer([f"{HERE}:fails_on_b"]).score(PROMPTS, TEXTS, group_size=3)


def test_async_group_reward_scores_groups_concurrently_and_times_out():
    start = time.perf_counter()
    scores = RewardScorer([f"{HERE}:slow_group"], timeout=5.0).score(PROMPTS * 2, TEXTS * 2, group_size=3)
    assert time.perf_counter() - start < 0.6  # four groups of 0.2 s at once
    assert len(scores.totals) == 12 and not scores.failed
    timed = RewardScorer([f"{HERE}:slow_group"], timeout=0.05, on_error="zero").score(PROMPTS, TEXTS,
                                                                                       group_size=3)
    assert timed.failed == set(range(6)) and "timed out" in str(timed.errors[0])


def test_isolated_group_reward_runs_in_a_worker_and_reports_metrics():
    scorer = RewardScorer([f"{HERE}:pid_group", Counted()], isolate=True)
    scores = scorer.score(PROMPTS, TEXTS, group_size=3)
    assert set(scores.values[0]) != {float(os.getpid())}  # scored in a worker process
    assert scores.metrics == {"rollout/counted_calls": 2.0}  # popped in the worker, sent back


def gdpo_scores_fn(completions, **_):  # f1: 1 where the completion has an "x"
    return [float("x" in c) for c in completions]


def gdpo_second_fn(completions, **_):  # f2: 2 where it has no "x": with weights 1, .5 the sum is constant
    return [2.0 * ("x" not in c) for c in completions]


def pipeline() -> RewardPipeline:
    scorer = RewardScorer([f"{HERE}:gdpo_scores_fn", f"{HERE}:gdpo_second_fn"], [1.0, 0.5])
    return RewardPipeline(scorer, FullScore(scorer.names[0], scorer.fns[0]), decouple_eps=GDPO().decouple_eps)


def rollout_of(result, n: int) -> Rollout:
    ones = torch.ones(n, 2, dtype=torch.long)
    return Rollout(ones, ones, ones, ones, ones.clone(), torch.zeros(n, dtype=torch.bool),
                   torch.full((n,), 2), torch.arange(n // 2).repeat_interleave(2), result.rewards,
                   result.correct, outcome=result.outcome, decoupled_rewards=result.decoupled)


def test_gdpo_group_with_constant_sum_is_kept_and_trained():
    # group 0: "x" / "y": (1, 0) and (0, 2), weighted sums 1 and 1 (constant), functions vary
    # group 1: "y" / "y": every function constant: no signal under any estimator
    texts = ["x", "y", "y", "y"]
    result = pipeline()(["p", "p", "q", "q"], texts, [1] * 4, {}, group_size=2)
    assert result.rewards.tolist() == [1.0, 1.0, 1.0, 1.0]  # GRPO's view: nothing to learn anywhere
    rollout = rollout_of(result, 4)
    kept, stats = DynamicSampling(max_gen_batches=1)(rollout, lambda: None, Collectives.local())
    assert kept.group_ids.tolist() == [0, 0] and stats["rollout/filtered_group_frac"] == 0.5
    dropped, _ = DropUniformGroups()(rollout, lambda: None, Collectives.local())
    assert dropped.group_ids.tolist() == [0, 0]
    # the advantages: 1 * z1 + .5 * z2 = [.354, -.354] in group 0, batch-normalised over the 2 kept rows
    advantages = GDPO()(kept, Collectives.local())[0].advantages
    assert advantages[0] > 0.7 and advantages[1] < -0.7


def test_gdpo_batch_step_is_over_every_ranks_rows():
    from types import SimpleNamespace

    from lightning_rl.maths.multi_reward import batch_normalized, sequence_moments

    # this rank holds 2 groups, the other rank 2 more: the batch step must use all 8 rows' moments
    x = torch.tensor([0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.25, -0.25])
    other = sequence_moments(x[4:])
    strategy = SimpleNamespace(root_device=torch.device("cpu"),
                               reduce=lambda value, reduce_op: value + other.to(value))
    collectives = Collectives(SimpleNamespace(strategy=strategy, world_size=2, global_rank=0))
    result = pipeline()(["p", "p", "q", "q"], ["x", "y", "x", "y"], [1] * 4, {}, group_size=2)
    result.decoupled = x[:4]
    mine = GDPO()(rollout_of(result, 4), collectives)[0].advantages
    assert torch.allclose(mine, batch_normalized(x)[:4], atol=1e-6)
    assert not torch.allclose(mine, batch_normalized(x[:4]))  # not this rank's own moments


def test_gdpo_estimator_needs_the_decoupled_sums():
    result = pipeline()(["p", "p"], ["x", "y"], [1, 1], {}, group_size=2)
    result.decoupled = None  # the rewards stage built without GDPO
    with pytest.raises(ValueError, match="rollout.decoupled_rewards"):
        GDPO()(rollout_of(result, 2), Collectives.local())
    with pytest.raises(ValueError, match="model.advantage.init_args.eps"):
        GDPO(eps=0.0)


@pytest.mark.slow  # imports the algorithms layer (~5 s)
def test_gdpo_refuses_rewards_it_would_leave_out():
    from lightning_rl.algorithms.assembly import reward_stages
    from lightning_rl.algorithms.sampler_options import RewardOptions

    with pytest.raises(ValueError, match="`model.rewards.overlong_buffer` would be left out"):
        reward_stages(RewardOptions(overlong_buffer=2), environment_only=False, budget=8, render=None,
                      trust_remote_code=False, decouple_eps=1e-4)


def same_digits(prompts, completions, **_):
    """1.0 where the completion holds the prompt's digits, in any order (a second objective for GDPO)."""
    pairs = zip(prompts, completions, strict=True)
    return [float(sorted(c.strip()) == sorted(p.rstrip("="))) for p, c in pairs]


@pytest.mark.slow
def test_gdpo_trains_end_to_end_with_dynamic_sampling(tmp_path):
    from helpers import datamodule, make, make_trainer

    from lightning_rl.maths.advantages import group_spread

    seen = []

    class Spy(GDPO):
        def estimate(self, rollout, collectives):
            fields, stats = super().estimate(rollout, collectives)
            seen.append((rollout, fields["advantages"]))
            return fields, stats

    module = make(advantage=Spy(), filters={"dynamic_sampling": True, "max_gen_batches": 2},
                  rewards={"functions": ["lightning_rl.step.rewards:exact_match", f"{HERE}:same_digits"],
                           "weights": [1.0, 0.5]}, objective={"kl_coef": 0.0})
    assert "GDPO" in module.reward_pipeline.outcome_name()
    before = [p.detach().clone() for p in module.policy.parameters()]
    make_trainer(tmp_path, max_steps=2).fit(module, datamodule(batch_size=4))
    assert len(seen) == 2
    for rollout, advantages in seen:
        size = len(rollout) // rollout.num_groups
        assert rollout.decoupled_rewards is not None and len(rollout.decoupled_rewards) == len(rollout)
        assert group_spread(torch.round(rollout.decoupled_rewards, decimals=6), size).all()  # the filter's
        assert abs(float(advantages.mean())) < 1e-4 and abs(float(advantages.std()) - 1.0) < 1e-2
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters(), strict=True))


@pytest.mark.slow
def test_the_gdpo_example_builds_gdpo_over_grpo_through_the_cli(tmp_path):
    from helpers import CONFIGS

    from lightning_rl.cli.main import LightningRLCLI

    cli = LightningRLCLI(args=["--config", str(CONFIGS / "grpo.yaml"), "--config",
                               str(CONFIGS / "examples" / "gdpo.yaml"),
                               "--trainer.logger.init_args.save_dir", str(tmp_path)], run=False)
    assert isinstance(cli.model.online.advantage, GDPO) and cli.model.online.advantage.decouple_eps == 1e-4
    assert "GDPO" in cli.model.reward_pipeline.outcome_name()
    assert cli.model.objective.kl_coef == 0.04  # configs/grpo.yaml's, kept
