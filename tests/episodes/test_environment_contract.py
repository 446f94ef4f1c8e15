"""The environment contract (``lightning_rl.episodes.environments``): every return of ``reset``, ``step`` and
``final_reward`` is checked, and a violation names the class, the method, the episode and what was expected;
failed episodes score 0 and are limited by ``model.episodes.max_error_frac``; a prompt from ``reset`` that is
too long is the environment's error; observations are cut before they are tokenised.

Runner tests drive :class:`EpisodeRunner` with the scripted ``generate`` of ``test_episodes``; the module
tests sample (or fit) through the real sampler.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from helpers import datamodule, make, make_trainer, sample_round
from test_episodes import TOK, Scripted, run, runner

from lightning_rl.episodes.environments import (
    ContractError,
    Environment,
    EpisodeError,
    StepResult,
    checked_final_reward,
    checked_reset,
    checked_step,
)
from lightning_rl.episodes.observations import observation_ids
from lightning_rl.episodes.runner import EpisodeRunner
from lightning_rl.episodes.tool_formats import PlainFormat
from lightning_rl.episodes.tools import Tool

STEP = (r"a StepResult\(observation: str \| list of messages \| None, reward: finite float, done: bool, "
        r"info: dict\)")
PROMPT = r"a prompt: a non-empty str, a non-empty list of messages"


class Returns(Environment):
    """Returns what it was given from ``reset``, ``step`` and ``final_reward``."""

    def __init__(self, reset=None, step=None, final=0.0) -> None:
        self.first, self.answer, self.final = reset, step, final

    def reset(self, row):
        return self.first

    def step(self, turn):
        return self.answer if self.answer is not None else StepResult(done=True)

    def final_reward(self, episode):
        return self.final


BROKEN = {
    "gym tuple": ("step", {"step": ("obs", 1.0, True, {})}, r"tuple \('obs', 1.0, True, \{\}\)", STEP),
    "number observation": ("step", {"step": StepResult(observation=3)},
                           r"a StepResult whose observation is 3 \(int\)", STEP),
    "string reward": ("step", {"step": StepResult(reward="high", done=True)},
                      r"a StepResult whose reward is 'high' \(str\)", STEP),
    "nan reward": ("step", {"step": StepResult(reward=math.nan, done=True)},
                   r"a StepResult whose reward is nan \(float\)", STEP),
    "inf reward": ("step", {"step": StepResult(reward=-math.inf, done=True)},
                   r"a StepResult whose reward is -inf \(float\)", STEP),
    "string done": ("step", {"step": StepResult(done="yes")}, r"a StepResult whose done is 'yes' \(str\)",
                    STEP),
    "number prompt": ("reset", {"reset": 42}, r"42 \(int\)", PROMPT),
    "one message": ("reset", {"reset": {"role": "user", "content": "hi"}},
                    r"\{'role': 'user', 'content': 'hi'\} \(dict\)", PROMPT),
    "string final": ("final_reward", {"final": "high"}, r"'high' \(str\)", "a finite float"),
    "nan final": ("final_reward", {"final": math.nan}, r"nan \(float\)", "a finite float"),
    "none final": ("final_reward", {"final": None}, r"None \(NoneType\)", "a finite float"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_return_names_the_environment_method_episode_and_what_was_expected(case):
    """Each violation stops a ``raise`` run with one message (today: TypeError / AttributeError /
    ValueError from inside the runner, or a NaN that trains); under ``zero`` it fails the episode like an
    exception: counted, return 0."""
    method, returns, got, expected = BROKEN[case]
    env = Returns(**returns)
    pattern = (rf"environment `Returns\.{method}` returned {got} for episode 0 \(prompt 'p'\): "
               rf"expected {expected}")
    with pytest.raises(EpisodeError, match=pattern):
        run(runner(env), Scripted(["a"]), [{"prompt": "p"}])
    out = run(runner(env, on_env_error="zero"), Scripted(["a"]), [{"prompt": "p"}])
    assert out.stats["rollout/env_errors"] == 2 and out.returns.tolist() == [0.0, 0.0]
    assert out.failed.tolist() == [True, True]


def test_the_checks_accept_what_the_signatures_allow_and_convert_it():
    """numpy and 0-d torch numbers are rewards, 0/1 and numpy booleans are ``done``, messages are prompts and
    observations; a tensor of several values is not a reward."""
    result = checked_step(StepResult(observation=[{"role": "user", "content": "x"}], reward=np.float32(0.5),
                                     done=np.bool_(True)))
    assert result.reward == 0.5 and type(result.reward) is float and result.done is True
    assert checked_step(StepResult(reward=torch.tensor(2), done=0)).reward == 2.0
    assert checked_final_reward(np.float64(1.5)) == 1.5 and checked_final_reward(3) == 3.0
    assert checked_reset(None) is None and checked_reset([{"role": "user", "content": "q"}])
    with pytest.raises(ContractError, match=r"reward is tensor\(\[1., 2.\]\)"):
        checked_step(StepResult(reward=torch.tensor([1.0, 2.0])))
    with pytest.raises(ContractError, match="expected a prompt"):
        checked_reset("")


class FailsOnBad(Environment):
    """Raises in ``step`` for rows marked ``bad``; rewards 1 otherwise."""

    def reset(self, row):
        self.bad = row.get("bad", False)

    def step(self, turn):
        if self.bad:
            raise KeyError("board")
        return StepResult(reward=1.0, done=True)


def test_max_error_frac_stops_a_step_with_more_failed_episodes_and_warns_once_below_it():
    """2 of 4 episodes fail: at a limit of 0.25 the step stops naming the environment, the count and the
    last failure; at 0.5 (not more than it) the run goes on with one warning for the whole run; a refill
    round (``decide=False``) never stops."""
    rows = [{"prompt": "p", "bad": True}, {"prompt": "q"}]
    strict = runner(FailsOnBad(), on_env_error="zero", max_error_frac=0.25)
    out = run(strict, Scripted(["a"]), rows)
    assert out.failed.tolist() == [True, True, False, False] and out.returns.tolist() == [0, 0, 1, 1]
    stop = (r"environment `FailsOnBad` failed in 2 of 4 episodes, more than `model.episodes.max_error_frac`"
            r"=0.25. Last failure: environment `FailsOnBad` raised KeyError in step of episode 1 "
            r"\(prompt 'p'\)")
    with pytest.raises(EpisodeError, match=stop):
        strict.check_failures(out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strict.check_failures(out, decide=False)
        lenient = runner(FailsOnBad(), on_env_error="zero", max_error_frac=0.5)
        lenient.check_failures(out)
        lenient.check_failures(out)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2  # once per runner (a run)
    assert all(m.startswith("environment `FailsOnBad` failed in 2 of 4 episodes; they train with reward 0")
               for m in messages)
    with pytest.raises(ValueError, match=r"`model.episodes.max_error_frac` must be in \[0, 1\], got 1.5"):
        runner(FailsOnBad(), max_error_frac=1.5)


class FailsAtTheEnd(Environment):
    """Every episode's ``final_reward`` raises."""

    def final_reward(self, episode):
        raise RuntimeError("scoreboard down")


def always_one(completions, **_):
    return [1.0] * len(completions)


def test_failed_episodes_train_on_reward_zero_whatever_the_reward_functions_say(tmp_path):
    """A GRPO step where every environment fails and the reward function gives 1.0 to everything: under
    ``max_error_frac: 1.0`` it trains on rewards 0 (``rollout/reward_mean`` 0, not 1) and warns once, naming
    the environment; with the default limit of 0.5 the step stops, naming it."""
    rewards = {"functions": [f"{__name__}:always_one"]}
    batch = {"prompt": ["50318=", "92741="], "answer": ["01358", "12479"]}
    sampling = {"num_generations": 2}
    module = make(episodes={"environment": FailsAtTheEnd(), "on_error": "zero", "max_error_frac": 1.0,
                            "max_turns": 1}, sampling=sampling, rewards=rewards)
    trainer = make_trainer(tmp_path)
    with pytest.warns(UserWarning, match=r"environment `FailsAtTheEnd` failed in 4 of 4 episodes") as caught:
        trainer.fit(module, datamodule(batch_size=2))
    assert sum("FailsAtTheEnd" in str(w.message) for w in caught) == 1
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert metrics["rollout/env_errors"] == 4 and metrics["rollout/reward_mean"] == 0.0
    module = make(episodes={"environment": FailsAtTheEnd(), "on_error": "zero", "max_turns": 1},
                  sampling=sampling, rewards=rewards)
    module.trainer = make_trainer(tmp_path)
    stop = (r"environment `FailsAtTheEnd` failed in 4 of 4 episodes, more than "
            r"`model.episodes.max_error_frac`=0.5")
    with pytest.raises(EpisodeError, match=stop + ".*scoreboard down"):
        sample_round(module, batch)


def test_validation_scores_failed_episodes_zero_too(tmp_path):
    """Validation and predict follow training: a failed episode's reward is 0 and it is not correct,
    whatever the reward functions (1.0 here) say."""
    module = make(episodes={"environment": FailsAtTheEnd(), "on_error": "zero", "max_error_frac": 1.0,
                            "max_turns": 1}, rewards={"functions": [f"{__name__}:always_one"],
                                                      "accuracy_fn": f"{__name__}:always_one"})
    (result,) = make_trainer(tmp_path, limit_val_batches=1).validate(module, datamodule(max_val_rows=4),
                                                                    verbose=False)
    assert result["val/reward_mean"] == 0.0 and result["val/accuracy"] == 0.0


class LongPrompt(Environment):
    """Starts rows whose prompt begins with 5 from a 40-character prompt, the others from their own."""

    def reset(self, row):
        return "1234567890" * 4 if row["prompt"].startswith("5") else None


def test_a_long_prompt_from_reset_is_the_environments_error_not_a_data_rows(tmp_path):
    """``policy.max_prompt_length`` is 16: the 40-token prompt ``reset`` returned is reported as the
    environment's (class, method, episode, length, the key), not as "prompt 0 has 40 tokens"; under
    ``zero`` those episodes fail and keep their row's prompt, and the others sample as usual."""
    batch = {"prompt": ["50318=", "92741="], "answer": ["01358", "12479"]}
    module = make(episodes={"environment": LongPrompt(), "max_turns": 1}, sampling={"num_generations": 2})
    module.trainer = make_trainer(tmp_path)
    refused = (r"environment `LongPrompt\.reset` returned a prompt of 40 tokens for episode 0 "
               r"\(prompt '50318='\): expected at most `model.policy.max_prompt_length`=16 tokens")
    with pytest.raises(EpisodeError, match=refused):
        sample_round(module, batch)
    module = make(episodes={"environment": LongPrompt(), "max_turns": 1, "on_error": "zero",
                            "max_error_frac": 1.0}, sampling={"num_generations": 2})
    module.trainer = make_trainer(tmp_path)
    with pytest.warns(UserWarning, match="LongPrompt.reset"):
        rollout, stats = sample_round(module, batch)
    assert stats["rollout/env_errors"] == 2 and rollout.rewards[:2].tolist() == [0.0, 0.0]
    assert rollout.attention_mask[2:].any()


class Spy:
    """The test tokenizer, recording the length of every text it tokenises."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, text, **kw):
        self.seen.append(len(text))
        return TOK(text, **kw)

    def __getattr__(self, name):
        return getattr(TOK, name)


def flood() -> str:
    """Return 10 MB of text."""
    return "x" * 10_000_000


@pytest.mark.parametrize("source", ["tool", "environment"])
def test_a_10_mb_observation_is_cut_before_it_is_tokenised(source):
    """A tool result or an observation of 10 MB with 200 tokens of room: the tokenizer sees at most
    200 * 16 characters (today: all 10 MB, seconds and gigabytes), and the episode ends truncated without
    it, as before."""
    spy = Spy()
    tools = [Tool.from_function(flood)] if source == "tool" else []
    env = Returns(step=StepResult(observation="y" * 10_000_000)) if source == "environment" else None
    turn = "<tool>flood()</tool>" if source == "tool" else "a"
    r = EpisodeRunner(env, tools, PlainFormat(), spy, max_episode_tokens=200)
    out = run(r, Scripted([turn, "b"]), [{"prompt": "p"}], n=1)
    (ep,) = out.episodes
    assert max(spy.seen) <= 200 * 16
    assert ep.truncated and [t.role for t in ep.turns] == ["assistant"] and ep.num_tokens <= 200


class Wide:
    """A tokenizer whose every token covers 100 characters."""

    def __call__(self, text, **kw):
        return {"input_ids": list(range(math.ceil(len(text) / 100)))}


def test_the_cut_grows_while_it_holds_fewer_tokens_than_the_room():
    """Tokens longer than the first bound (100 characters each): 5000 characters are 50 tokens and fit in a
    room of 100, so the observation is kept whole, not mistaken for one that passes the budget."""
    assert observation_ids(Wide(), "z" * 5000, room=100) == list(range(50))
    assert observation_ids(Wide(), "z" * 20_000, room=100) is None
