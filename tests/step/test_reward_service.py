"""The reward service (``lightning_rl.step.reward_scorer`` over ``lightning_rl.step.rewards.run_all`` and
``lightning_rl.step.workers``): a batch's reward functions run at once, ``async def`` ones are awaited, a
function past ``model.rewards.timeout`` fails by name, and an isolated one runs in a worker process that is
killed on timeout. The last test fits a real step with a stuck tool and a stuck reward."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time

import pytest
from helpers import datamodule, make, make_trainer, scalars
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_rl.step.reward_scorer import RewardError, RewardScorer

HERE = __name__  # functions below are named by import path, as in YAML
PROMPTS, COMPLETIONS = ["p1", "p2"], ["ab", "c"]
RELEASE = threading.Event()  # set at the end of a test, so a timed-out thread does not outlive it


def sleepy_one(completions, **_):
    time.sleep(0.3)
    return [1.0] * len(completions)


def sleepy_two(completions, **_):
    time.sleep(0.3)
    return [2.0] * len(completions)


async def length_judge(completions, **_):
    await asyncio.sleep(0.3)
    return [float(len(c)) for c in completions]


def stuck(completions, **_):
    RELEASE.wait(30)
    return [1.0] * len(completions)


def stuck_in_worker(completions, pid_file, **_):
    with open(pid_file[0], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
    return [1.0] * len(completions)


def asleep(completions, **_):
    time.sleep(60)
    return [1.0] * len(completions)


def failing(completions, **_):
    raise KeyError("answer")


def where_it_ran(completions, **_):
    return [float(threading.current_thread() is threading.main_thread())] * len(completions)


def gone(pid: int) -> bool:
    """The process is dead (no /proc entry, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


def test_plain_and_async_functions_run_at_once():
    """Three functions that take 0.3 s each (two plain, one async): ~0.3 s together, not 0.9 s; weighted
    totals 1*1 + 0.5*2 + 1*len(completion): [4.0, 3.0]; each function's own time is ~0.3 s."""
    scorer = RewardScorer([f"{HERE}:sleepy_one", f"{HERE}:sleepy_two", f"{HERE}:length_judge"],
                          weights=[1.0, 0.5, 1.0])
    start = time.perf_counter()
    scores = scorer.score(PROMPTS, COMPLETIONS)
    assert time.perf_counter() - start < 0.6  # one after another: 0.9 s
    assert scores.totals == [4.0, 3.0] and scores.values[2] == [2.0, 1.0]
    assert all(0.25 < s < 0.6 for s in scores.seconds)


def test_a_single_plain_function_without_timeout_runs_in_the_calling_thread():
    """Nothing to overlap or stop: it keeps the main thread (math-verify's own alarm timeout needs it)."""
    assert RewardScorer([f"{HERE}:where_it_ran"]).score(PROMPTS, COMPLETIONS).totals == [1.0, 1.0]
    timed = RewardScorer([f"{HERE}:where_it_ran"], timeout=5.0)
    assert timed.score(PROMPTS, COMPLETIONS).totals == [0.0, 0.0]  # in a thread, to be timed out


def test_a_stuck_function_times_out_by_name_or_is_counted():
    try:
        scorer = RewardScorer([f"{HERE}:stuck"], timeout=0.2)
        start = time.perf_counter()
        with pytest.raises(RewardError, match=rf"reward function `{HERE}:stuck` timed out after 0.2 s "
                                              r"\(`model.rewards.timeout`; .*`model.rewards.isolate`"):
            scorer.score(PROMPTS, COMPLETIONS)
        assert time.perf_counter() - start < 0.6
        zero = RewardScorer([f"{HERE}:length_judge", f"{HERE}:stuck"], on_error="zero", timeout=0.4)
        scores = zero.score(PROMPTS, COMPLETIONS)
        assert scores.totals == [0.0, 0.0] and scores.failed == {0, 1}
        assert scores.values == ([2.0, 1.0], [0.0, 0.0])  # the other function's values stand
        (errors,) = scores.errors
        assert errors.fn == f"{HERE}:stuck" and errors.count == 2
        assert "timed out after 0.4 s (one call for the batch: all 2 samples failed)" in str(errors)
    finally:
        RELEASE.set()


def test_an_isolated_stuck_function_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    name = f"{HERE}:stuck_in_worker"
    scorer = RewardScorer([name], on_error="zero", timeout=0.3, isolate=[name])
    start = time.perf_counter()
    scores = scorer.score(PROMPTS, COMPLETIONS, pid_file=[str(pid_file)] * 2)
    assert time.perf_counter() - start < 1.3
    pid = int(pid_file.read_text())
    assert pid != os.getpid() and gone(pid)
    assert scores.failed == {0, 1} and "timed out after 0.3 s" in str(scores.errors[0])
    with pytest.raises(RewardError, match="its worker process was killed"):
        scorer = RewardScorer([name], timeout=0.1, isolate=True)
        scorer.score(PROMPTS, COMPLETIONS, pid_file=[str(pid_file)] * 2)


def test_isolated_functions_score_and_fail_as_in_process():
    names = [f"{HERE}:length_judge", "lightning_rl.step.rewards:exact_match", f"{HERE}:failing"]
    scorer = RewardScorer(names, on_error="zero", isolate=True)
    scores = scorer.score(PROMPTS, COMPLETIONS, answer=["ab", "x"])
    assert scores.values == ([2.0, 1.0], [1.0, 0.0], [0.0, 0.0]) and scores.failed == {0, 1}
    assert "raised KeyError: 'answer'" in str(scores.errors[0])
    with pytest.raises(RewardError, match=rf"reward function `{HERE}:failing` raised KeyError: 'answer'"):
        RewardScorer([f"{HERE}:failing"], isolate=True).score(PROMPTS, COMPLETIONS)


def test_timeout_and_isolate_are_checked_naming_the_key():
    with pytest.raises(ValueError, match=re.escape("`model.rewards.timeout` must be > 0 seconds or null")):
        RewardScorer([f"{HERE}:failing"], timeout=0)
    with pytest.raises(ValueError, match=r"`model.rewards.isolate` names 'pkg.mod:fn', which "
                                         r"`model.rewards.functions` does not list"):
        RewardScorer([f"{HERE}:failing"], isolate=["pkg.mod:fn"])
    with pytest.raises(ValueError, match=r"`model.rewards.timeout`"):
        make(rewards={"timeout": -1.0})


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (here: stuck in a catastrophic regex, holding the GIL).

    Args:
        expression: The expression.
    """
    return str(re.search("(a+)+$", "a" * 64 + "b"))


@pytest.mark.slow
def test_a_step_with_a_stuck_tool_and_a_stuck_reward_finishes(tmp_path):
    """A real GRPO step: the tool model calls a `calculator` stuck in a regex (timed out, an error
    observation) and an isolated reward function never returns (killed, scored 0 and counted); the step
    finishes, and `perf/reward_time` is the timeout, not the stuck function's minute."""
    stuck_reward = f"{HERE}:asleep"
    module = make(policy={"model": "builtin:tiny-tools"},
                  sampling={"max_new_tokens": 40, "num_generations": 2},
                  episodes={"tools": [f"{HERE}:calculator"], "tool_timeout": 0.3, "max_turns": 2,
                            "max_episode_tokens": 100},
                  rewards={"functions": [stuck_reward, "lightning_rl.step.rewards:exact_match"],
                           "isolate": [stuck_reward], "timeout": 0.5, "on_error": "zero",
                           "max_error_frac": 1.0})
    trainer = make_trainer(tmp_path, logger=TensorBoardLogger(str(tmp_path), name="tb"), log_every_n_steps=1)
    start = time.perf_counter()
    trainer.fit(module, datamodule(task="multiply", batch_size=2))
    assert time.perf_counter() - start < 60
    logged = {k: v[-1][1] for k, v in scalars(tmp_path).items()}
    assert logged["rollout/tool_errors"] >= 1
    assert logged["rollout/tool_timeouts"] == logged["rollout/tool_errors"]  # each error: a stuck call
    assert logged["rollout/reward_errors"] == 4
    assert 0.5 <= logged["perf/reward_time"] < 2.0
