"""The difficulty curriculum (lightning_rl.data.curriculum): the weighted draw worked by hand, the pools, the
feedback rule (the draw of step t reads the outcomes of steps <= t-2, exactly), readers that agree, state
round trips through the DataModule, and (slow) the CLI overlay and an exact resume under max_staleness 1."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from helpers import CONFIGS, run_cli, scalars

from lightning_rl.data import Curriculum, PromptDataModule
from lightning_rl.data.curriculum import CurriculumTracker, PassRates, weighted_draw
from lightning_rl.data.prompts import collate
from lightning_rl.episodes.source import pass_rates
from lightning_rl.step.rollout import Rollout

NAN = math.nan
ROWS = [{"prompt": f"p{i}", "answer": str(i)} for i in range(6)]


def test_weighted_draw_by_hand():
    # keys log(u) / w: row 0: log(.5)/1 = -0.693; row 1: log(.9)/.2 = -0.527; row 2: log(.25)/1 = -1.386;
    # row 3 has weight 0: after every positive row (log(.99) - 1e9). Largest key first: 1, 0, 2, then 3.
    weights = torch.tensor([1.0, 0.2, 1.0, 0.0], dtype=torch.float64)
    u = torch.tensor([0.5, 0.9, 0.25, 0.99], dtype=torch.float64)
    assert weighted_draw(weights, u, 2).tolist() == [1, 0]
    assert weighted_draw(weights, u, 4).tolist() == [1, 0, 2, 3]
    # the same u with row 1 weighted 1: log(.9) = -0.105 still first; row 2 at weight 4: log(.25)/4 = -0.347
    assert weighted_draw(torch.tensor([1.0, 1.0, 4.0, 0.0], dtype=torch.float64), u, 3).tolist() == [1, 2, 0]


def test_weighted_draw_frequencies_follow_the_weights():
    # one draw of four rows weighted 1, 0.2, 1, 0: probabilities 1/2.2, 0.2/2.2, 1/2.2, 0
    g = torch.Generator().manual_seed(0)
    u = torch.rand(20_000, 4, generator=g, dtype=torch.float64)
    picked = weighted_draw(torch.tensor([1.0, 0.2, 1.0, 0.0], dtype=torch.float64), u, 1).flatten()
    freq = torch.bincount(picked, minlength=4).double() / len(picked)
    assert freq.tolist() == pytest.approx([1 / 2.2, 0.2 / 2.2, 1 / 2.2, 0.0], abs=0.012)


def test_pools_and_weights():
    rates = torch.tensor([NAN, 1.0, 0.0, 0.5, 0.875], dtype=torch.float64)
    assert Curriculum().weights(rates).tolist() == [1.0, 0.2, 0.2, 1.0, 1.0]
    c = Curriculum(easy_threshold=0.75, hard_threshold=0.25, easy_weight=0.0, hard_weight=0.5,
                   unseen_weight=2.0)
    assert c.weights(rates).tolist() == [2.0, 0.0, 0.5, 1.0, 0.0]
    pools = c.pools(rates)
    assert [k for k in ("easy", "hard", "normal", "unseen") if pools[k][3]] == ["normal"]
    assert pools["easy"].tolist() == [False, True, False, False, True]


@pytest.mark.parametrize(("key", "kw"), [("easy_threshold", {"easy_threshold": 0.0}),
                                         ("hard_threshold", {"hard_threshold": -0.1}),
                                         ("easy_weight", {"easy_weight": -1.0}),
                                         ("momentum", {"momentum": 1.0})])
def test_invalid_options_name_the_key(key, kw):
    with pytest.raises(ValueError, match=f"data.curriculum.{key}"):
        Curriculum(**kw)


def test_pass_rates_momentum_and_fold_order():
    rates = PassRates(4, momentum=0.5)
    rates.record(1, [2], [0.0])
    rates.record(0, [2, 3], [1.0, 0.25])
    rates.record(0, [2, 3], [0.0, 0.0])  # recorded again: ignored
    rates.fold(2)
    # step 0: row 2 -> 1.0, row 3 -> 0.25 (first visits); step 1: row 2 -> .5 * 1.0 + .5 * 0.0 = 0.5
    assert rates.estimates[2:].tolist() == [0.5, 0.25] and rates.estimates[:2].isnan().all()
    assert rates.applied == 2 and not rates.pending


def test_pass_rates_of_a_rollout():
    correct = torch.tensor([1, 1, 0, 0, 0, 0, 1, 0, 1], dtype=torch.bool)
    rollout = Rollout(*[torch.zeros(9, 1)] * 7, group_ids=torch.arange(3).repeat_interleave(3),
                      rewards=torch.zeros(9), correct=correct)
    assert pass_rates(rollout) == pytest.approx([2 / 3, 0.0, 2 / 3])


SKIP_BOTH = Curriculum(easy_weight=0.0, hard_weight=0.0)


def tracker(curriculum=SKIP_BOTH, rows=ROWS, start=0, state=None):
    t = CurriculumTracker(curriculum, len(rows), seed=5)
    if state is not None:
        t.load_state_dict(state, 0, 1, start)
    return t


def outcome(rows: list[int]) -> list[float]:
    """A fixed outcome per row: row % 3 == 0 easy (1.0), == 1 hard (0.0), else 0.5."""
    return [[1.0, 0.0, 0.5][r % 3] for r in rows]


def test_the_draw_of_step_t_reads_the_outcomes_of_steps_up_to_t_minus_2():
    t = tracker()
    draws = iter(t.stream(ROWS, 2, 0, 1, 0, collate))
    next(draws), next(draws)
    first, second = draws.drawn[0], draws.drawn[1]
    draws.record(0, [1.0, 1.0])  # step 0's prompts all right: easy, weight 0
    other = iter(t.stream(ROWS, 2, 0, 1, 0, collate))  # the same stream, but step 1 will read differently
    next(other), next(other)
    other.record(0, [1.0, 1.0])
    draws.record(1, [1.0, 1.0])
    other.record(1, [0.5, 0.5])
    assert next(draws)["prompt"] == next(other)["prompt"]  # step 2: step 1's outcome not read yet
    assert not set(draws.drawn[2]) & set(first)  # ... and step 0's easy prompts skipped
    next(draws), next(other)  # step 3 reads step 1: `draws` skips its prompts too (>= 2 rows are left)
    assert len(set(first + second)) <= 4 and not set(draws.drawn[3]) & set(first + second)


def test_a_missing_outcome_stops_the_draw_naming_the_step():
    draws = iter(tracker().stream(ROWS, 2, 0, 1, 0, collate))
    next(draws), next(draws)
    with pytest.raises(RuntimeError, match="draw of step 2 needs the pass rates of step 0"):
        next(draws)


def run_stream(draws, steps: range, lag: int = 0) -> list[list[int]]:
    """Draw ``steps``; each step's outcome reported ``lag`` draws later (a prefetching loader: 1)."""
    order = []
    for step in steps:
        next(draws)
        order.append(draws.drawn[step])
        if step - lag >= steps.start:
            draws.record(step - lag, outcome(draws.drawn[step - lag]))
    return order


def test_readers_at_different_lags_draw_the_same_prompts():
    """The learner's loader (outcomes one draw late) and a worker reading ahead (its own outcomes at once)."""
    rows = [{"prompt": f"p{i}"} for i in range(40)]
    c = Curriculum(easy_weight=0.1, hard_weight=0.0)
    loader = run_stream(iter(tracker(c, rows).stream(rows, 4, 0, 1, 0, collate)), range(12), lag=1)
    worker = run_stream(iter(tracker(c, rows).stream(rows, 4, 0, 1, 0, collate)), range(12), lag=0)
    assert loader == worker
    plain = run_stream(iter(tracker(Curriculum(easy_weight=1, hard_weight=1), rows).stream(
        rows, 4, 0, 1, 0, collate)), range(12))
    assert plain != loader  # the outcomes changed what was drawn


def dm_with(rows_path, **kw) -> PromptDataModule:
    dm = PromptDataModule(path=str(rows_path), batch_size=2, curriculum=Curriculum(easy_weight=0.0), **kw)
    dm.setup("fit")
    return dm


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) + "\n" for i in range(10)))
    return path


def test_a_checkpoint_resumes_the_draws_exactly(rows_file):
    """Steps 0-7 through the DataModule's loader; a checkpoint after step 3 (the loader has prefetched
    step 4); a new DataModule restored from it draws steps 4-7 as the uninterrupted one did."""
    def train(dm, steps, stop=None):
        loader, prompts, state = iter(dm.train_dataloader()), [], None
        batch = next(loader)
        for step in steps:
            following = next(loader) if step + 1 < steps.stop else None  # Lightning's prefetch
            prompts.append(batch["prompt"])
            stats = dm.record_outcomes(step, outcome([int(p[:-1]) for p in batch["prompt"]]))
            if step == stop:
                dm.batches_consumed = step + 1
                state = dm.state_dict()
            batch = following
        return prompts, stats, state

    full, full_stats, state = train(dm_with(rows_file), range(8), stop=3)
    (saved,) = state["curriculum_by_rank"]
    assert saved["applied"] == 3 and list(saved["pending"]) == [3]  # after steps <= 2; step 3 apart
    resumed = dm_with(rows_file)
    resumed.load_state_dict(state)
    again, again_stats, _ = train(resumed, range(4, 8))
    assert again == full[4:] and again_stats == full_stats
    assert full_stats["curriculum/easy"] > 0 and full_stats["curriculum/batch_easy_frac"] == 0.0
    assert {"curriculum/easy_frac", "curriculum/hard_frac", "curriculum/mean_pass_rate"} <= set(full_stats)


def test_ranks_draw_from_disjoint_shards_and_a_checkpoint_merges_on_another_world_size():
    rows = [{"prompt": str(i)} for i in range(10)]
    trackers = [tracker(Curriculum(), rows) for _ in range(2)]
    for rank, t in enumerate(trackers):
        t.loader = t.stream(rows, 2, rank, 2, 0, collate)
        drawn = [int(p) for p in next(iter(t.loader))["prompt"]]
        assert len(drawn) == 2 and all(i % 2 == rank for i in drawn)  # rank r's shard: rows r, r + 2, ...
        t.record(0, [0.25, 1.0], rank, 2)
    states = [t.state_dict(1) for t in trackers]  # step 0 pending in each
    merged = tracker(Curriculum(), rows, start=1, state=states).trained  # resumed on one rank
    assert int((~merged.estimates.isnan()).sum()) == 4 and merged.applied == 1 and not merged.pending
    for state in states:
        (step_rows, rates), = state["pending"].values()
        assert merged.estimates[step_rows].tolist() == rates == [0.25, 1.0]


def test_without_a_curriculum_nothing_changes():
    dm = PromptDataModule(batch_size=2)
    assert dm.record_outcomes(0, [1.0, 0.0]) == {}
    assert "curriculum_by_rank" not in dm.state_dict()


# ---- through the CLI -----------------------------------------------------------------------------------
PROMPT_LOG = "LRL_TEST_CURRICULUM_PROMPTS"


def logged_reward(prompts, completions, **_):
    """0 for every sample; appends each prompt (once per group member) to the file named by PROMPT_LOG."""
    with open(os.environ[PROMPT_LOG], "a") as f:
        f.writelines(f"{p}\n" for p in prompts)
    return [0.0] * len(prompts)


TINY = """
seed_everything: 3
trainer:
  max_steps: 8
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: "{ckpt}", save_last: true, every_n_train_steps: 4, save_top_k: -1}}
model:
  init_args:
    sampling:
      num_generations: 4
      max_new_tokens: 8
      max_staleness: {lag}
      worker: {worker}
    rewards:
      functions: [lightning_rl.step.rewards:exact_match, test_curriculum:logged_reward]
data:
  init_args:
    path: {rows}
    batch_size: 4
    curriculum:
      easy_weight: 0.0
      hard_weight: 0.0
"""


@pytest.mark.slow
@pytest.mark.parametrize(("lag", "worker"), [(1, "process"), (1, "thread"), (0, "auto")],
                         ids=["max_staleness_1", "max_staleness_1_thread", "sync"])
def test_a_resumed_run_draws_and_trains_exactly_what_the_uninterrupted_run_does(tmp_path, monkeypatch, lag,
                                                                                worker):
    """GRPO with the curriculum on 12 sort prompts (4 a step: they come back, and easy / hard ones are
    skipped), stopped after step 4 and resumed with `--ckpt_path last`: the same prompts scored, in the same
    order, and the same metrics, curriculum ones included."""
    from lightning_rl.data.sort_task import SortTask

    rows = tmp_path / "rows.jsonl"
    task = SortTask()
    rows.write_text("".join(json.dumps(task.train_row(i)) + "\n" for i in range(12)))

    def run(name, steps, resume=False):
        monkeypatch.setenv(PROMPT_LOG, str(tmp_path / f"{name}.txt"))
        overlay = tmp_path / f"{name}.yaml"
        overlay.write_text(TINY.format(ckpt=tmp_path / f"ckpt_{name.split('_')[0]}", lag=lag, rows=rows,
                                       worker=worker))
        overlays = [CONFIGS / "async.yaml", overlay] if lag else [overlay]
        args = ["fit", "--config", CONFIGS / "grpo.yaml", *[a for o in overlays for a in ("--config", o)],
                "--trainer.max_steps", str(steps), "--trainer.logger.init_args.save_dir", tmp_path / name]
        run_cli(*(args + (["--ckpt_path", "last"] if resume else [])))
        return scalars(tmp_path / name), (tmp_path / f"{name}.txt").read_text().splitlines()

    full, full_prompts = run("full", 8)
    _, first = run("cut_first", 4)
    resumed, second = run("cut_second", 8, resume=True)
    assert first + second == full_prompts  # each prompt scored once, in the uninterrupted order
    keys = ["policy/loss", "rollout/reward_mean", "curriculum/easy_frac", "curriculum/hard_frac",
            "curriculum/mean_pass_rate", "curriculum/seen", "curriculum/batch_unseen_frac"]
    for key in keys:
        assert [v for s, v in full[key] if s > 4] == pytest.approx([v for s, v in resumed[key] if s > 4],
                                                                   rel=1e-6, abs=1e-7), key
    assert max(v for _, v in full["curriculum/easy"]) + max(v for _, v in full["curriculum/hard"]) > 0
    assert min(v for _, v in full["curriculum/batch_unseen_frac"]) < 1  # prompts came back


@pytest.mark.slow
def test_the_overlay_parses_through_the_cli(tmp_path):
    from lightning_rl.cli.main import LightningRLCLI

    cli = LightningRLCLI(args=[str(a) for a in ["--config", CONFIGS / "grpo.yaml", "--config",
                                                 CONFIGS / "curriculum.yaml",
                                                 "--trainer.logger.init_args.save_dir", tmp_path]], run=False)
    assert cli.datamodule.curriculum == Curriculum(easy_threshold=1.0, hard_threshold=0.0, easy_weight=0.2,
                                                   hard_weight=0.2, unseen_weight=1.0, momentum=0.0)
