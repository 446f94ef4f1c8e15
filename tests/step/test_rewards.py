"""Tests for lightning_rl.step.rewards: verifiable-answer rewards, import paths, and RewardScorer's weights,
error modes (messages name the function and the sample) and dataset columns passed as keywords."""

from __future__ import annotations

import math

import pytest

from lightning_rl.step.reward_pipeline import overlong_reward
from lightning_rl.step.reward_scorer import RewardError, RewardScorer
from lightning_rl.step.rewards import exact_match, import_reward, numeric_match

HERE = __name__  # reward functions below are imported by path, as YAML names them


# reward functions used by path ------------------------------------------------------------------------
def half(completions, **_):
    return [0.5] * len(completions)


def length_reward(completions, **_):
    return [float(len(c)) for c in completions]


def boom(completions, **_):
    raise KeyError("missing field")


def nan_at_one(completions, **_):
    return [math.nan if i == 1 else 1.0 for i in range(len(completions))]


def inf_at_two(completions, **_):
    return [math.inf if i == 2 else 0.0 for i in range(len(completions))]


def text_at_zero(completions, **_):
    return ["not a number" if i == 0 else 0.25 for i in range(len(completions))]


def too_few(completions, **_):
    return [1.0] * (len(completions) - 1)


def uses_columns(prompts, completions, answer, difficulty, **_):
    # reward = difficulty where the completion is right; needs the extra `difficulty` column
    return [float(d) * float(c == a) for c, a, d in zip(completions, answer, difficulty, strict=True)]


NOT_CALLABLE = 3


# ----------------------------------------------------------------------------------------- exact match
def test_exact_match():
    completions = [" 01358\n", "01358", "0135", "42", ""]
    answers = ["01358", " 01358 ", "01358", 42, "x"]
    # whitespace stripped on both sides; non-string answers compared as text
    assert exact_match(completions=completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_exact_match_length_mismatch_raises():
    with pytest.raises(ValueError):
        exact_match(completions=["a", "b"], answer=["a"])


# --------------------------------------------------------------------------------------- numeric match
@pytest.mark.parametrize(("completion", "answer", "expected"), [
    ("1,000", "1000.0", 1.0),
    ("The total is 1,000 apples", "1000", 1.0),
    ("1e3", "1000", 1.0),
    ("so the answer is \\boxed{42}", "42", 1.0),
    ("\\boxed{42} (checked with 7 cases)", "42", 1.0),  # boxed wins over the last number
    ("first 3, then 5", "5", 1.0),  # last number
    ("first 3, then 5", "3", 0.0),
    ("no number here", "7", 0.0),
    ("", "0", 0.0),
    ("-12.5 degrees", "-12.50", 1.0),
    ("12.5", "-12.5", 0.0),
    ("0.1 + 0.2 = 0.30000000000000004", "0.3", 1.0),  # relative tolerance 1e-6
    ("1001", "1000", 0.0),
    ("7", "no number", 0.0),
])
def test_numeric_match(completion, answer, expected):
    assert numeric_match(completions=[completion], answer=[answer]) == [expected]


def test_numeric_match_batch_and_tolerance():
    assert numeric_match(completions=["3.0000001", "3.1"], answer=["3", 3]) == [1.0, 0.0]
    assert numeric_match(completions=["3.1"], answer=["3"], rel_tol=0.05) == [1.0]


# --------------------------------------------------------------------------------------- import paths
def test_import_reward_forms():
    assert import_reward("lightning_rl.step.rewards:exact_match") is exact_match
    assert import_reward("lightning_rl.step.rewards.numeric_match") is numeric_match  # dotted form
    assert import_reward(f"{HERE}:half") is half


@pytest.mark.parametrize(("path", "match"), [
    ("no_such_module_xyz:fn", "cannot import reward function `no_such_module_xyz:fn`"),
    ("lightning_rl.step.rewards:no_such_fn",
     "cannot import reward function `lightning_rl.step.rewards:no_such_fn`"),
    (f"{HERE}:NOT_CALLABLE", "is not callable"),
    ("justaname", "must look like `package.module:function`"),
    (":fn", "must look like"),
    ("module:", "must look like"),
    # a path from before the core was layered names where its module went
    ("lightning_rl.rewards:exact_match", r"No module named 'lightning_rl.rewards' \(it moved to "
                                         r"`lightning_rl.step.rewards`\)$"),
])
def test_import_reward_errors(path, match):
    with pytest.raises(ValueError, match=match):
        import_reward(path)


UNSAFE_ENTRIES = [
    ("os:system", "os.system", "runs commands"), ("posix:system", "os.system", "runs commands"),
    ("subprocess:run", "subprocess.run", "runs commands"),
    ("builtins:eval", "builtins.eval", "evaluates code"), ("io:open", "builtins.open", "writes files"),
    ("shutil.rmtree", "shutil.rmtree", "deletes files"), ("os:kill", "os.kill", "kills processes"),
]


@pytest.mark.parametrize("entry, name, does", UNSAFE_ENTRIES)
def test_unsafe_reward_functions_are_refused_by_the_tools_rule_naming_key_and_entry(entry, name, does):
    """`os:system` used to load as a reward function and was refused only for want of a `command` column
    (`posix:system` needs the data column `command`): with one, it ran the column. It is refused for what it
    is, by the rule that refuses it as a tool, in one line naming the YAML key and the entry as written."""
    from lightning_rl.episodes.tools import load_tools

    with pytest.raises(ValueError) as refused:
        RewardScorer(["lightning_rl.step.rewards:exact_match", entry])
    assert str(refused.value).startswith(
        f"reward function `{entry}` (`model.rewards.functions[1]`) is `{name}`, which {does}: a reward "
        "function is called with the data's columns as keyword arguments")
    assert "\n" not in str(refused.value) and "`lightning_rl.sandbox:code_tests`" in str(refused.value)
    tool = rf"^`model.episodes.tools` entry `{entry}` is `{name}`, which {does}: "
    with pytest.raises(ValueError, match=tool):
        load_tools([entry])  # the same rule


@pytest.mark.parametrize("key", ["correctness_fn", "accuracy_fn"])
def test_an_unsafe_correctness_or_accuracy_fn_is_refused_naming_its_key(key):
    from lightning_rl.algorithms.assembly import reward_stages
    from lightning_rl.algorithms.sampler_options import RewardOptions

    with pytest.raises(ValueError, match=rf"^reward function `os:popen` \(`model.rewards.{key}`\) is "
                                         r"`os.popen`, which runs commands: "):
        reward_stages(RewardOptions(**{key: "os:popen"}), environment_only=False, budget=8, render=str,
                      trust_remote_code=False)


def test_lookalikes_and_own_functions_that_call_unsafe_ones_are_not_refused():
    assert import_reward("shutil:which") is __import__("shutil").which  # reads, runs nothing
    assert import_reward(f"{HERE}:half", "model.rewards.functions[0]") is half


def test_moved_hint_names_the_layer_only_for_modules_of_the_flat_layout():
    from lightning_rl import moved_hint

    assert moved_hint("lightning_rl.tools") == " (it moved to `lightning_rl.episodes.tools`)"
    assert moved_hint("lightning_rl.strategies") == " (it moved to `lightning_rl.models.strategies`)"
    assert moved_hint("lightning_rl.nope") == moved_hint("mypkg.rewards") == ""
    assert moved_hint("lightning_rl.step.rewards") == ""  # already the new path


# --------------------------------------------------------------------------------------------- scorer
PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["ab", "b", "abcd", ""]
ANSWERS = ["ab", "x", "abcd", "y"]


def test_scorer_weighted_sum():
    scorer = RewardScorer(["lightning_rl.step.rewards:exact_match", f"{HERE}:half", f"{HERE}:length_reward"],
                          weights=[2.0, -1.0, 0.25])
    totals, errors = scorer(PROMPTS, COMPLETIONS, answer=ANSWERS)
    # 2 * exact - 0.5 + 0.25 * len: "ab" 2 - .5 + .5 = 2.0; "b" 0 - .5 + .25 = -0.25;
    # "abcd" 2 - .5 + 1 = 2.5; "" 0 - .5 + 0 = -0.5
    assert totals == pytest.approx([2.0, -0.25, 2.5, -0.5])
    assert errors == 0


def test_scorer_default_weights_are_one():
    scorer = RewardScorer(["lightning_rl.step.rewards:exact_match", f"{HERE}:half"])
    totals, _ = scorer(PROMPTS, COMPLETIONS, answer=ANSWERS)
    assert totals == pytest.approx([1.5, 0.5, 1.5, 0.5])


def test_scorer_passes_extra_columns_as_keywords():
    scorer = RewardScorer([f"{HERE}:uses_columns"])
    totals, _ = scorer(PROMPTS, COMPLETIONS, answer=ANSWERS, difficulty=[3, 5, 7, 9])
    assert totals == [3.0, 0.0, 7.0, 0.0]


def test_scorer_raise_mode_names_function():
    scorer = RewardScorer([f"{HERE}:boom"])
    with pytest.raises(RewardError, match=rf"`{HERE}:boom` raised KeyError.*missing field"):
        scorer(PROMPTS, COMPLETIONS, answer=ANSWERS)


@pytest.mark.parametrize(("fn", "sample"), [("nan_at_one", 1), ("inf_at_two", 2), ("text_at_zero", 0)])
def test_scorer_raise_mode_names_function_and_sample(fn, sample):
    scorer = RewardScorer([f"{HERE}:{fn}"])
    with pytest.raises(RewardError) as info:
        scorer(PROMPTS, COMPLETIONS, answer=ANSWERS)
    message = str(info.value)
    assert f"`{HERE}:{fn}`" in message
    assert f"sample {sample}" in message
    assert repr(PROMPTS[sample]) in message  # the prompt is quoted too
    assert "model.rewards.on_error" in message  # and the way out


def test_scorer_zero_mode_scores_failed_samples_zero_and_counts_them():
    scorer = RewardScorer(["lightning_rl.step.rewards:exact_match", f"{HERE}:nan_at_one",
                           f"{HERE}:inf_at_two"], on_error="zero")
    totals, errors = scorer(PROMPTS, ["ab", "x", "abcd", "y"], answer=["ab", "x", "abcd", "z"])
    # exact match (1, 1, 1, 0) + nan_at_one (1, NaN, 1, 1) + inf_at_two (0, 0, inf, 0):
    # samples 1 and 2 failed -> 0 (even though exact_match scored them 1); sample 0: 2, sample 3: 1
    assert totals == [2.0, 0.0, 0.0, 1.0]
    assert errors == 2


def test_scorer_zero_mode_on_raising_function():
    scorer = RewardScorer([f"{HERE}:half", f"{HERE}:boom"], on_error="zero")
    totals, errors = scorer(PROMPTS, COMPLETIONS, answer=ANSWERS)
    assert totals == [0.0] * 4 and errors == 4


@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_scorer_wrong_number_of_values_always_raises(on_error):
    scorer = RewardScorer([f"{HERE}:too_few"], on_error=on_error)
    with pytest.raises(RewardError, match=rf"`{HERE}:too_few` returned 3 values for 4 completions"):
        scorer(PROMPTS, COMPLETIONS, answer=ANSWERS)


@pytest.mark.parametrize(("args", "match"), [
    (dict(fns=[]), "model.rewards.functions"),
    (dict(fns=["lightning_rl.step.rewards:exact_match"], weights=[1.0, 2.0]), "model.rewards.weights"),
    (dict(fns=["lightning_rl.step.rewards:exact_match"], on_error="ignore"), "model.rewards.on_error"),
    (dict(fns=["lightning_rl.step.rewards:nope"]), "cannot import"),
])
def test_scorer_config_errors(args, match):
    with pytest.raises(ValueError, match=match):
        RewardScorer(**args)


def test_overlong_reward_by_hand():
    # max 8, buffer 4 -> expected length 4: L <= 4 -> 0; (4 - L) / 4 inside; L > 8 -> -1
    assert overlong_reward([3, 4, 5, 6, 8, 9], max_len=8, cache_len=4) == pytest.approx(
        [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
