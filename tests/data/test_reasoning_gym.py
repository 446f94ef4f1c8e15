"""reasoning-gym tasks (``lightning_rl.data.reasoning_gym``): rows generated offline, the tasks' own scores as
rewards and correctness, a single-turn environment, and one GRPO step on the embedded model.

reasoning-gym is an optional extra (``pip install 'lightning-rl[reasoning-gym]'``) outside ``dev``: it pins a
C extension without wheels (pycosat) and pulls in matplotlib, so these tests are skipped where it is absent.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
from helpers import make, make_trainer

from lightning_rl.data.reasoning_gym import (
    ReasoningGymDataModule,
    ReasoningGymEnvironment,
    reasoning_gym_correct,
    reasoning_gym_score,
)
from lightning_rl.episodes.runner import EpisodeRunner  # noqa: E402
from lightning_rl.episodes.tool_formats import PlainFormat  # noqa: E402
from lightning_rl.models.builtin import build_char_tokenizer  # noqa: E402
from lightning_rl.models.generation import SamplingParams, make_generation  # noqa: E402
from lightning_rl.text.pairs import pad_rows  # noqa: E402

TASKS = ["basic_arithmetic", "leg_counting"]
TOK = build_char_tokenizer()
SCORE = "lightning_rl.data.reasoning_gym:reasoning_gym_score"
CORRECT = "lightning_rl.data.reasoning_gym:reasoning_gym_correct"


def built(task: str, **kw) -> ReasoningGymDataModule:
    dm = ReasoningGymDataModule(task=task, **(dict(size=40, val_size=20, batch_size=2) | kw))
    dm.setup("fit")
    return dm


def columns(rows: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}


@pytest.mark.parametrize("task", TASKS)
def test_rows_are_generated_offline_deterministic_serialisable_and_held_out(task):
    dm = built(task)
    assert len(dm.train_rows) == 40 and 0 < len(dm.val_rows) <= 20
    row = dm.train_rows[3]
    assert json.loads(json.dumps(row)) == row
    assert row["rg_task"] == task and row["rg_index"] == 3 and row["rg_seed"] == 0 and row["answer"]
    assert {r["rg_seed"] for r in dm.val_rows} == {40}  # seed + size: another random stream per entry
    assert not {r["prompt"] for r in dm.val_rows} & {r["prompt"] for r in dm.train_rows}
    assert built(task).train_rows == dm.train_rows and built(task, seed=1).train_rows != dm.train_rows
    batch = next(iter(dm.train_dataloader()))
    assert len(batch["prompt"]) == 2 and set(batch) >= {"answer", "rg_task", "rg_index"}


@pytest.mark.parametrize("task", TASKS)
def test_the_tasks_own_score_is_the_reward_and_its_one_is_correct(task):
    rows = built(task).train_rows[:4]
    cols = columns(rows)
    right = [r["answer"] for r in rows]
    assert reasoning_gym_score(completions=right, prompts=[r["prompt"] for r in rows], **cols) == [1.0] * 4
    wrong = [f"{r['answer']}1" if i % 2 else "no idea" for i, r in enumerate(rows)]
    scores = reasoning_gym_score(completions=wrong, **cols)
    assert all(s < 1.0 for s in scores)
    tagged = [f"<think>so</think> <answer>{r['answer']}</answer>" for r in rows]  # the last answer tag
    assert reasoning_gym_correct(completions=tagged, **cols) == [1.0] * 4
    assert reasoning_gym_correct(completions=wrong, **cols) == [0.0] * 4


def test_errors_name_the_key_and_the_install_command(monkeypatch):
    with pytest.raises(ValueError, match=r"`data.task`='leg_cunting'.*'leg_counting'"):
        ReasoningGymDataModule(task="leg_cunting")
    with pytest.raises(ValueError, match=r"`data.config` has \['max_term'\].*'max_terms'"):
        ReasoningGymDataModule(task="basic_arithmetic", config={"max_term": 3})
    with pytest.raises(ValueError, match=r"`data.size` must be >= 1, got 0"):
        ReasoningGymDataModule(size=0)
    with pytest.raises(ValueError, match=r"`data.max_question_chars`=5"):
        built("leg_counting", max_question_chars=5)
    with pytest.raises(KeyError, match="rg_index"):
        ReasoningGymEnvironment().reset({"prompt": "p", "rg_task": "leg_counting"})
    with pytest.raises(KeyError, match="rg_seed"):
        reasoning_gym_score(completions=["1"], answer=["1"], rg_task=["leg_counting"])
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'lightning-rl\[reasoning-gym\]'"):
        ReasoningGymDataModule(task="leg_counting")


def test_options_shape_the_questions_and_prompts():
    dm = built("basic_arithmetic", config={"max_terms": 2, "max_digits": 1}, max_question_chars=18,
               system_prompt="direct")
    assert all(len(r["prompt"][-1]["content"]) <= 18 for r in dm.train_rows + dm.val_rows)
    system = dm.train_rows[0]["prompt"][0]
    assert system["role"] == "system" and "<answer>" in system["content"]
    rows = dm.train_rows[:3]
    assert reasoning_gym_score(completions=[r["answer"] for r in rows], **columns(rows)) == [1.0] * 3


class PerRow:
    """A ``generate`` that answers prompt row ``i`` with ``texts[i]`` + EOS, for every sample of the row."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.calls = texts, 0

    def __call__(self, prompt_ids, prompt_mask, *, num_samples, sampling, seed):
        self.calls += 1
        outs = [TOK(t, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id] for t in self.texts]
        completion, _ = pad_rows([o for o in outs for _ in range(num_samples)], TOK.pad_token_id, left=False)
        ids, mask = (t.repeat_interleave(num_samples, 0) for t in (prompt_ids, prompt_mask))
        return make_generation(ids, mask, completion, TOK.eos_token_id, TOK.pad_token_id)


@pytest.mark.parametrize("task", TASKS)
def test_environment_runs_an_episode_scored_by_the_task(task):
    rows = built(task).train_rows[:2]
    runner = EpisodeRunner(ReasoningGymEnvironment(), [], PlainFormat(), TOK, max_turns=3)
    gen = PerRow([rows[0]["answer"], "wrong"])
    out = runner(rows, num_samples=2, sampling=SamplingParams(max_new_tokens=40), seed=0,
                 encode=lambda prompts: pad_rows([TOK(p)["input_ids"] for p in prompts], TOK.pad_token_id,
                                                 left=True), generate=gen)
    assert gen.calls == 1  # single turn: the environment ends every episode after the answer
    assert out.texts == [rows[0]["answer"]] * 2 + ["wrong"] * 2
    assert out.returns.tolist()[:2] == [1.0, 1.0] and all(r < 1.0 for r in out.returns.tolist()[2:])
    assert out.said_correct == [True, True, False, False]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reward_fns", "environment"])
def test_one_grpo_step_on_the_embedded_model(tmp_path, mode):
    """GRPO end to end on reasoning-gym rows (learning is not the point): short arithmetic questions fit the
    tiny model's 256-token context; the rewards come from the task's scorer or from the environment."""
    dm = ReasoningGymDataModule(task="basic_arithmetic", size=32, val_size=8, max_question_chars=40,
                                batch_size=2, val_batch_size=4)
    kw = dict(rewards={"functions": [SCORE], "accuracy_fn": CORRECT}) if mode == "reward_fns" else dict(
        rewards={"functions": [], "accuracy_fn": CORRECT},
        episodes={"environment": ReasoningGymEnvironment()})
    module = make(policy={"max_prompt_length": 48}, sampling={"num_generations": 2}, **kw)
    trainer = make_trainer(tmp_path, max_steps=1, limit_val_batches=1, val_check_interval=1)
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 1
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert math.isfinite(metrics["rollout/reward_mean"]) and 0.0 <= metrics["rollout/reward_mean"] <= 1.0
    assert math.isfinite(metrics["val/accuracy"])
