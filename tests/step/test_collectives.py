"""Collectives are symmetric by construction (DESIGN.md, "Scaling out"): every rank makes the same
collective calls every step whatever its data. Multi-process runs are tests/ddp_collectives.py on 2 gloo
ranks, each under a hard timeout (a hung gloo rank ignores SIGTERM: its session is killed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_rl.data import PromptDataModule
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.filters import DynamicSampling
from lightning_rl.step.metrics import StepMetrics
from lightning_rl.step.rollout import Rollout

CPU = torch.device("cpu")


def _ranks(out: Path) -> list[dict]:
    """What each rank of a tests/ddp_collectives.py run wrote (``OUT.rank{r}.json``)."""
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]


# ------------------------------------------------------------------------------ unit: one process
def fake_rollout(correct: list[list[int]], tag: int) -> Rollout:
    """Groups of ``len(correct[0])`` rows, reward = correctness; ``lengths`` = 100 * tag + row, so kept rows
    can be traced (completions of ``2 + tag`` tokens, so rounds have different widths)."""
    G, n = len(correct[0]), len(correct) * len(correct[0])
    flat = torch.tensor([c for group in correct for c in group], dtype=torch.bool)
    ones = torch.ones(n, 2 + tag, dtype=torch.long)
    return Rollout(
        prompt_ids=torch.ones(n, 3, dtype=torch.long), prompt_mask=torch.ones(n, 3, dtype=torch.long),
        completion_ids=ones.clone(), attention_mask=ones.clone(), loss_mask=ones.clone(),
        truncated=torch.zeros(n, dtype=torch.bool), lengths=torch.arange(n) + 100 * tag,
        group_ids=torch.arange(len(correct)).repeat_interleave(G), rewards=flat.float(), correct=flat,
    )


class FakeStrategy:
    """Stands in for a 2-rank ``reduce(max)``: the other rank needs more for its first ``other`` rounds."""

    root_device = CPU

    def __init__(self, other: int) -> None:
        self.other, self.calls = other, 0

    def reduce(self, tensor, reduce_op):
        assert reduce_op == "max"
        self.calls += 1
        return torch.maximum(tensor, torch.tensor(float(self.calls <= self.other)))


def fake_collectives(strategy: FakeStrategy) -> Collectives:
    """The step's Collectives over a fake 2-rank trainer whose strategy is ``strategy``."""
    return Collectives(SimpleNamespace(strategy=strategy, world_size=2, global_rank=0))


class Refill:
    """The module's ``refill()`` closure: the next prepared round, sampled and scored."""

    def __init__(self, rounds) -> None:
        self.rounds, self.draws = list(rounds), 0

    def __call__(self):
        self.draws += 1
        return self.rounds.pop(0), {}


def test_filter_generates_while_any_rank_needs_more():
    first = fake_rollout([[1, 0], [0, 1]], tag=0)  # this rank is full after one round
    more = [fake_rollout([[1, 0], [0, 0]], tag=t) for t in (1, 2, 3)]
    strategy = FakeStrategy(other=2)
    refill = Refill(more)
    out, stats = DynamicSampling(max_gen_batches=4)(first, refill, fake_collectives(strategy))
    # the other rank needed 2 more rounds: this one generated them too (a collective under FSDP2), and
    # asked a third time, when nobody needed more
    assert refill.draws == 2 and strategy.calls == 3 and stats["rollout/gen_batches"] == 3.0
    assert out.lengths.tolist() == [0, 1, 2, 3]  # its own full first round; the extra groups trimmed
    # at max_gen_batches nobody asks again: the same number of reduces on every rank
    strategy, refill = FakeStrategy(other=10), Refill(more)
    DynamicSampling(max_gen_batches=3)(first, refill, fake_collectives(strategy))
    assert refill.draws == 2 and strategy.calls == 2


def test_metrics_compute_every_known_name_every_step():
    metrics, logged = StepMetrics(), {}

    def log(name, value):
        logged[name] = float(value)

    metrics.add(CPU, {"policy/loss": 2.0, "policy/entropy": 1.0}, 1.0)
    metrics.add_stats(CPU, {"rollout/gen_batches": 1.0})
    out = metrics.log(CPU, log)
    assert logged == out == {"policy/loss": 2.0, "policy/entropy": 1.0, "rollout/gen_batches": 1.0}
    computed = []
    for name, metric in metrics.metrics.items():
        metric.compute = (lambda m, n: lambda: computed.append(n) or m())(metric.compute, name)
    # a step where this rank had no data: every known name still joins the reduction, in one order
    logged.clear()
    metrics.add(CPU, {"policy/entropy": float("nan")}, 1.0)  # NaN inputs are ignored
    metrics.add_stats(CPU, {"rollout/gen_batches": 3.0})
    metrics.log(CPU, log)
    assert computed == ["policy/entropy", "policy/loss", "rollout/gen_batches"]
    # nobody had data: nothing logged for those names (never a NaN), the rest as usual
    assert logged == {"rollout/gen_batches": 3.0}
    assert all(not math.isnan(v) for v in logged.values())


def test_a_stages_own_metric_group_is_logged_and_the_steps_own_counts_are_not():
    """Any ``group/name`` statistic is a metric (a preset stage's ``distill/``, ``critic_lm/``: no table lists
    the groups); the counts the step keeps for its own sums and names without a group are not logged."""
    metrics, logged = StepMetrics(), {}
    metrics.add_stats(CPU, {"critic_lm/excluded_tokens": 2.0, "perf/generated_tokens": 64.0, "tokens": 1.0,
                            "/x": 1.0, "x/": 1.0, "rollout/excluded_tokens": 0.0})
    metrics.log(CPU, lambda n, v: logged.__setitem__(n, float(v)))
    assert logged == {"critic_lm/excluded_tokens": 2.0, "rollout/excluded_tokens": 0.0}


def test_max_metrics_take_the_maximum_over_micro_batches_whatever_their_weight():
    metrics, logged = StepMetrics(), {}
    metrics.add(CPU, {"policy/kl_ref_max": 3.0, "policy/kl_ref": 1.0}, 0.75)
    metrics.add(CPU, {"policy/kl_ref_max": 7.0, "policy/kl_ref": 2.0}, 0.25)
    metrics.add(CPU, {"policy/kl_ref_max": 99.0}, 0.0)  # an empty micro-batch's placeholder: left out
    metrics.log(CPU, lambda n, v: logged.__setitem__(n, float(v)))
    assert logged == {"policy/kl_ref_max": 7.0, "policy/kl_ref": 1.25}
    logged.clear()
    metrics.log(CPU, lambda n, v: logged.__setitem__(n, float(v)))  # no data this step: not logged
    assert logged == {}


def test_state_dict_keeps_every_ranks_refill_position():
    def fake_trainer(rank, positions):
        strategy = SimpleNamespace(root_device=torch.device("cpu"),
                                   all_gather=lambda t: torch.tensor(positions).view(-1, 1))
        progress = SimpleNamespace(total=SimpleNamespace(processed=4))
        return SimpleNamespace(world_size=len(positions), global_rank=rank, strategy=strategy,
                               fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))

    dm = PromptDataModule(batch_size=2)
    dm.trainer, dm.refills_consumed = fake_trainer(0, [3, 5]), 3
    state = dm.state_dict()
    assert state == {"batches_consumed": 4, "refills_consumed": 3, "refills_consumed_by_rank": [3, 5]}
    for rank, expected in ((0, 3), (1, 5)):
        restored = PromptDataModule(batch_size=2)
        restored.trainer = fake_trainer(rank, [0, 0])
        restored.load_state_dict(state)
        assert restored.refills_consumed == expected
    restored = PromptDataModule(batch_size=2)  # resumed on 1 rank: after the furthest position
    restored.load_state_dict(state)
    assert restored.refills_consumed == 5


# ------------------------------------------------------------------------------ 2 gloo ranks
@pytest.mark.distributed
@pytest.mark.ranks("ddp/starve")
def test_dapo_rank_whose_filter_keeps_nothing_finishes(rank_jobs):
    # rank 1 keeps no group in any round, rank 0 keeps all in the first; generation is synced (FSDP2)
    ranks = _ranks(rank_jobs.out("ddp/starve") / "run")
    assert ranks[0]["names"] == ranks[1]["names"]
    assert {"rollout/reward_mean", "policy/loss", "policy/entropy"} <= set(ranks[0]["names"])
    for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
        assert s1["kept"] == 0 and s0["kept"] == 8
        # both ranks generated max_gen_batches = 3 rounds: rank 0 too, although it was full
        assert s0["refills_consumed"] == s1["refills_consumed"] == 2 * s0["step"]
        assert s0["logged"]["rollout/gen_batches"] == 3.0
        # the mean over the ranks that had data: rank 0's samples only
        assert s0["logged"]["rollout/reward_mean"] == pytest.approx(s0["reward_sum"] / 8, abs=1e-6)
        assert set(s0["logged"]) == set(s1["logged"])


@pytest.mark.distributed
@pytest.mark.ranks("ddp/partial-resume")
def test_dapo_resume_on_two_ranks_is_exact(rank_jobs):
    # 4 steps with a checkpoint every 2, then 2 more from the step-2 checkpoint
    out = rank_jobs.out("ddp/partial-resume")
    assert len(list((out / "full.ckpt").glob("*step=2.ckpt"))) == 1
    full, resumed = _ranks(out / "full"), _ranks(out / "resumed")
    # a run where rank 1 needs refills, and trains on what its refill prompts give
    assert full[1]["steps"][-1]["refills_consumed"] > 0
    for rank in (0, 1):
        tail = [s for s in full[rank]["steps"] if s["step"] > 2]
        assert [s["step"] for s in tail] == [s["step"] for s in resumed[rank]["steps"]] == [3, 4]
        for a, b in zip(tail, resumed[rank]["steps"], strict=True):
            assert a["refills_consumed"] == b["refills_consumed"] and a["kept"] == b["kept"]
            assert a["reward_sum"] == b["reward_sum"]
            # everything but timings (and Lightning's own `step`, which the checkpoint callback logs)
            exact = [{k: v for k, v in s["logged"].items() if not k.startswith("perf/") and k != "step"}
                     for s in (a, b)]
            assert len(exact[0]) > 15 and exact[0] == exact[1]


@pytest.mark.distributed
@pytest.mark.ranks("ddp/dpo-metrics")
def test_dpo_train_metrics_are_means_over_ranks(rank_jobs):
    ranks = _ranks(rank_jobs.out("ddp/dpo-metrics") / "run")
    for s0, s1 in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
        local = (s0["local_loss"], s1["local_loss"])
        assert abs(local[0] - local[1]) > 1e-4  # the ranks' pairs really differ
        for s in (s0, s1):
            assert s["logged"]["train/loss"] == pytest.approx(sum(local) / 2, abs=1e-6)
