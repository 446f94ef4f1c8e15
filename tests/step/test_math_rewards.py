"""Tests for lightning_rl.step.math_rewards: final-answer extraction, math-verify answer checking (equivalent
forms score 1, wrong or missing answers 0, never an exception), the <think>/<answer> format reward, the
missing-extra message, timeouts off the main thread, and the reward through RewardScorer by import path."""

from __future__ import annotations

import builtins
import signal
import threading

import pytest

from lightning_rl.step import math_rewards
from lightning_rl.step.math_rewards import extract_answer, format_reward, math_verify_reward
from lightning_rl.step.reward_scorer import RewardError, RewardScorer


# ------------------------------------------------------------------------------------------- extraction
@pytest.mark.parametrize(("text", "expected"), [
    # 1. <answer> tags: the last closed pair; a box inside it wins; blank -> None; unclosed -> ignored
    ("<think>2+2</think><answer> 4 </answer>", "4"),
    ("<answer>1</answer> then <answer>2</answer>", "2"),
    ("<think>maybe \\boxed{3}</think><answer>The total is \\boxed{5}.</answer>", "5"),
    ("<think>\\boxed{3}</think>\n<answer>5</answer>", "5"),  # the tag beats a box outside it
    ("<answer>  </answer> so 7", None),
    ("<answer>42", "42"),  # truncated: falls through to the last number
    # 2. boxes: last complete one, nested braces balanced, \fbox, \boxed without braces
    ("so \\boxed{\\frac{1}{2}} it is", "\\frac{1}{2}"),
    ("\\boxed{1} \\boxed{\\sqrt{\\frac{1}{\\left(2\\right)}}} ok", "\\sqrt{\\frac{1}{\\left(2\\right)}}"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces do not count
    ("\\fbox{12}", "12"),
    ("\\boxed 5", "5"),
    ("\\boxed{7} and then \\boxed{\\frac{1}{2", "7"),  # cut-off box skipped
    ("$\\boxed{-3}$.", "-3"),
    # 3. GSM8K
    ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "72"),
    ("#### 1,000\n", "1,000"),
    # 4. "answer is" / "answer:"
    ("So the answer is 3.5.", "3.5"),
    ("The final answer is $\\frac{1}{2}$. I hope it is correct.", "\\frac{1}{2}"),
    ("**Final Answer:** 42", "42"),
    ("The answer is 42 apples. (6 boxes of 7)", "42 apples"),
    # 5. last number
    ("first 3, then 5", "5"),
    ("The total is 1,234 dollars.", "1,234"),
    ("5 - 3 = 2", "2"),
    ("it drops to -4 degrees", "-4"),
    ("three quarters, i.e. 3/4 of it", "3/4"),
    ("we get \\dfrac{3}{4}", "\\dfrac{3}{4}"),
    ("it costs $.50", ".50"),
    # nothing
    ("I do not know", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# ------------------------------------------------------------------------------------------- math-verify
@pytest.mark.parametrize(("completion", "gold"), [
    ("The answer is \\boxed{2/4}", "1/2"),  # equivalent fractions
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),  # LaTeX fraction vs decimal, both ways
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\tfrac12}", "0.5"),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),
    ("\\boxed{\\sqrt{\\frac{1}{4}}}", "\\frac{1}{2}"),  # nested braces, simplified
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}"),  # symbolic equality
    ("\\boxed{5\\text{ cm}}", "5"),  # units
    ("<answer>5 cm</answer>", "5"),
    ("<answer>18 dollars</answer>", "18"),
    ("The answer is 42 apples.", "42"),
    ("So it costs $18.", "#### 18"),
    ("\\boxed{1,000}", "1000"),  # thousands separators
    ("The answer is 1,234,567.", "1234567"),
    ("\\boxed{50\\%}", "50"),  # percentages: math-verify accepts the number and the fraction
    ("\\boxed{50\\%}", "0.5"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{0.333333}", "\\frac{1}{3}"),  # floats compare after rounding to 6 decimals
    ("48 + 24 = 72, so she sold 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72"),  # GSM8K gold
    ("<answer>72</answer>", "Some working.\n#### 72"),
    ("we get 3 and then 5", "5"),  # no box: the last number
    ("<think>\\boxed{3}?</think><answer>5</answer>", "5"),  # <answer> preferred over a box
    ("\\boxed{\\frac{1}{2}}", "The answer is $\\boxed{\\frac{1}{2}}$"),  # MATH-style gold solution
])
def test_math_verify_equivalent(completion, gold):
    assert math_verify_reward(completions=[completion], answer=[gold]) == [1.0]


@pytest.mark.parametrize(("completion", "gold"), [
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}"),  # wrong
    ("\\boxed{0.333}", "\\frac{1}{3}"),  # too coarse
    ("\\boxed{-3}", "3"),
    ("\\boxed{(1, 2)}", "(2, 1)"),
    ("\\boxed{72}", "#### 73"),
    ("the answer is 6", "Some working.\n#### 72"),
    ("<think>\\boxed{72}</think><answer>70</answer>", "72"),  # the tagged answer counts, not the box
    ("I have no idea.", "42"),  # no answer at all
    ("", "42"),
    ("\\boxed{\\frac{1}{}", "\\frac{1}{2}"),  # malformed LaTeX
    ("\\boxed{)(}", "1"),
    ("<answer>   </answer>", "0"),
    ("\\boxed{42}", ""),  # blank gold: nothing can equal it
])
def test_math_verify_not_equivalent(completion, gold):
    assert math_verify_reward(completions=[completion], answer=[gold]) == [0.0]


def test_math_verify_batch_with_non_string_gold():
    completions = ["\\boxed{72}", "\\boxed{71}", "#### 72", "72.0", "garbage {{{"]
    assert math_verify_reward(completions=completions, answer=[72] * 5) == [1.0, 0.0, 1.0, 1.0, 0.0]


def test_math_verify_length_mismatch_raises():
    with pytest.raises(ValueError):
        math_verify_reward(completions=["1", "2"], answer=["1"])


def test_math_verify_off_the_main_thread():
    # math-verify's signal.alarm timeouts raise ValueError outside the main thread: they are switched off
    assert math_rewards._usable_timeout(5) == 5  # pytest runs tests in the main thread
    result = {}

    def work():
        result["timeout"] = math_rewards._usable_timeout(5)
        completions = ["\\boxed{\\frac{2}{4}}", "\\boxed{3}"]
        result["v"] = math_verify_reward(completions=completions, answer=["0.5", "4"])

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(30)
    assert result == {"timeout": None, "v": [1.0, 0.0]}


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="POSIX interval timers")
def test_math_verify_keeps_an_outer_alarm():
    # math-verify's signal.alarm replaces and then cancels any running ITIMER_REAL timer (pytest-timeout's,
    # a user's watchdog): the reward re-arms it, less the time spent
    previous = signal.getitimer(signal.ITIMER_REAL)
    handler = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        assert math_verify_reward(completions=["\\boxed{1}"], answer=["1"]) == [1.0]
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90.0 < left <= 100.0
    finally:
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, *previous)


def test_missing_extra_names_it(monkeypatch):
    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name == "math_verify" or name.startswith("math_verify."):
            raise ImportError("No module named 'math_verify'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    with pytest.raises(ValueError, match=r"pip install 'lightning-rl\[math\]'"):
        math_verify_reward(completions=["\\boxed{1}"], answer=["1"])
    # extraction and the format reward do not need the extra
    assert extract_answer("\\boxed{1}") == "1"
    assert format_reward(completions=["<think></think><answer>1</answer>"]) == [1.0]
    # through the scorer the error names the function and the extra
    scorer = RewardScorer(["lightning_rl.step.math_rewards:math_verify_reward"])
    with pytest.raises(RewardError, match=r"math_verify_reward.*lightning-rl\[math\]"):
        scorer(["q"], ["\\boxed{1}"], answer=["1"])


# -------------------------------------------------------------------------------------------- format
@pytest.mark.parametrize(("completion", "expected"), [
    ("<think>\nreason\n</think>\n<answer>\n42\n</answer>", 1.0),  # TRL / open-r1's exact layout
    ("<think>reason</think><answer>42</answer>", 1.0),  # no newlines
    ("  \n<think>a\nb</think>  \n\n <answer>42</answer>\n\n  ", 1.0),  # any whitespace around
    ("<think>\n\n</think>\n<answer>42</answer>", 1.0),  # empty thinking allowed
    ("<think>r</think>\n<answer>42</answer> trailing words", 0.0),  # text after </answer>
    ("Sure! <think>r</think><answer>42</answer>", 0.0),  # text before <think>
    ("<think>r</think> so <answer>42</answer>", 0.0),  # text between the blocks
    ("<think>r</think><answer>42", 0.0),  # <answer> without closing
    ("<think>r<answer>42</answer>", 0.0),  # </think> missing
    ("<think>r</think><answer>4</answer><answer>2</answer>", 0.0),  # two answers
    ("<think>r</think><think>s</think><answer>42</answer>", 0.0),  # two thinks
    ("<think>r <answer>x</answer></think><answer>42</answer>", 0.0),  # a tag inside think
    ("<answer>42</answer><think>r</think>", 0.0),  # answer before think
    ("<think>r</think><answer>  </answer>", 0.0),  # blank answer
    ("<THINK>r</THINK><ANSWER>42</ANSWER>", 0.0),  # tags are case-sensitive
    ("42", 0.0),
    ("", 0.0),
])
def test_format_reward(completion, expected):
    assert format_reward(completions=[completion]) == [expected]


# ------------------------------------------------------------------------------------ through the contract
def test_scorer_by_import_path():
    scorer = RewardScorer(
        ["lightning_rl.step.math_rewards:math_verify_reward", "lightning_rl.step.math_rewards:format_reward"],
        weights=[1.0, 0.1],
    )
    prompts = ["What is half of one?"] * 2 + ["Natalia sold 48 clips in April and half as many in May..."] * 2
    completions = [
        "<think>1/2</think>\n<answer>\\frac{2}{4}</answer>",  # right, formatted
        "It is \\boxed{0.25}",  # wrong, unformatted
        "48 + 24 = 72 so \\boxed{72}",  # right, unformatted
        "<think>48/2</think><answer>24</answer>",  # wrong, formatted
    ]
    answers = ["\\frac{1}{2}", "\\frac{1}{2}", "Natalia sold 48/2 = 24 clips.\n#### 72", "... #### 72"]
    totals, failed = scorer(prompts, completions, answer=answers, difficulty=[1, 1, 2, 2])
    assert failed == 0
    assert totals == pytest.approx([1.1, 0.0, 1.0, 0.1])
