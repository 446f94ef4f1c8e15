"""Tests for the reward ``code_tests`` (lightning_rl.code_judge): hand-worked scores; the expected values
never enter the completion's process; values cross as plain data (anything else is opaque); the channel
counts one message per unit after one begin; every known trick, written as a model would, scores what an
honest wrong answer scores (or less), where the old judge (kept below as ``old_score``) was fooled; honest
code scores what it scored under the old judge."""

from __future__ import annotations

import ast
import collections
import functools
import json
import re
import secrets

import pytest

from lightning_rl import code_judge as cj
from lightning_rl import sandbox
from lightning_rl.code_judge_harness import encode
from lightning_rl.code_judge_plan import make_plan
from lightning_rl.code_judge_values import JudgeError, Opaque, decode, evaluate, loads
from lightning_rl.sandbox import code_tests, extract_code, split_tests

ADD = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(5, 5) == 10"]
RIGHT = "def add(a, b):\n    return a + b\n"
CHECK = "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(3) == 9\n"  # HumanEval
WRONG = "def add(a, b):\n    return a * b\n"  # honest and wrong: only add(2, 2) passes, 1/3


def scores(pairs: list[tuple[str, list[str] | str]]) -> list[float]:
    got = code_tests(["p"] * len(pairs), [c for c, _ in pairs], tests=[t for _, t in pairs])
    return [round(s, 4) for s in got]


# the judge before this module (HEAD of lightning_rl/sandbox.py): passes printed with a nonce from stdin
OLD_HARNESS = """\
import json, sys
_h, _exec, _compile, _out = json.loads(sys.stdin.readline()), exec, compile, sys.stdout
_g = {"__name__": "__main__"}
_exec(_compile(_h["code"], "<completion>", "exec"), _g)
for _t in _h["tests"]:
    try:
        _exec(_compile(_t, "<test>", "exec"), _g)
    except BaseException:
        continue
    _out.write("\\n" + _h["nonce"] + " pass\\n")
    _out.flush()
"""


def old_score(code: str, tests: list[str] | str) -> float:
    rows, nonce = split_tests(tests), secrets.token_hex(16)
    stdin = json.dumps({"code": extract_code(code), "tests": rows, "nonce": nonce})
    result = sandbox.run_python(OLD_HARNESS, timeout=cj.TEST_TIMEOUT, stdin=stdin)
    passed = len(re.findall(rf"^{nonce} pass$", result.stdout, flags=re.MULTILINE))
    return round(passed / len(rows) if rows else float(result.ok), 4)


# -------------------------------------------------------------------------------- moved from test_sandbox
def test_extract_code_and_split_tests():
    assert extract_code("Here:\n```python\nx = 1\n```\nand\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("x = 3") == "x = 3"
    two = ["assert f(1) == 2", "assert f(\n    2) == 3"]
    assert split_tests("assert f(1) == 2\nassert f(\n    2) == 3\n") == two
    assert split_tests(["assert True"]) == ["assert True"]
    with pytest.raises(ValueError, match="`tests` column"):
        split_tests("assert (")


def test_code_tests_scores_the_fraction_of_asserts_passed(monkeypatch):
    monkeypatch.setattr(cj, "TEST_TIMEOUT", 0.5)
    three = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 5"]
    completions = [
        "Sure:\n```python\ndef add(a, b):\n    return a + b\n```",  # 1 and 2 pass, 3 is wrong: 2/3
        "def add(a, b):\n    return a - b",  # only add(0, 0): 1/3
        "def add(a, b):\n    while True:\n        pass",  # hangs on the first test: 0 before the timeout
        "print('pass')\nimport sys\nsys.exit(0)",  # exits before the tests: 0
        "import builtins\nbuiltins.exec = builtins.compile = lambda *a: None",  # the judge keeps its own: 0
        "def add(a, b):\n    return a + b",  # the tests as one string: 2/2
    ]
    tests = [three] * 5 + ["assert add(1, 1) == 2\nassert add(-1, 1) == 0"]
    assert scores(list(zip(completions, tests, strict=True))) == [0.6667, 0.3333, 0.0, 0.0, 0.0, 1.0]


def test_code_tests_by_import_path_through_the_reward_scorer_reads_the_tests_column():
    from lightning_rl.step.reward_scorer import RewardScorer

    assert (code_tests, extract_code, split_tests) == (cj.code_tests, cj.extract_code, cj.split_tests)

    scorer = RewardScorer(["lightning_rl.sandbox:code_tests"], weights=[2.0])
    totals, failed = scorer(["p", "q"], ["x = 1", "x = 2"], tests=[["assert x == 1"], ["assert x == 1"]])
    assert (totals, failed) == ([2.0, 0.0], 0)


# ------------------------------------------------------------------------------------ the plan (no runs)
def inside_of(tests: list[str]) -> list[object]:
    return [step.get("eval", step.get("exec")) for step in make_plan(tests).steps("inside")]


def test_each_assert_shape_sends_only_the_completions_parts_into_its_process():
    assert inside_of(["assert f(3) == 9"]) == [["f(3)"]]
    assert inside_of(["assert abs(f(0.1) - 0.3) < 1e-6"]) == [["f(0.1)"]]
    assert inside_of(['assert f(1) == 2, "f(1) should be 2"']) == [["f(1)"]]
    assert inside_of(["assert 0 <= f(1) < 10 and not f(2) and f(3) is None"]) == [["f(1)", "f(2)", "f(3)"]]
    assert inside_of(["assert f(2) in [4, 5]", "assert 3 not in f(1)"]) == [["f(2)"], ["f(1)"]]
    isclose = ["import math", "assert math.isclose(f(1), 0.5, rel_tol=1e-3)"]
    assert inside_of(isclose) == ["import math", ["f(1)"]]
    assert inside_of(["assert sorted(f([3, 1]), reverse=True) == sorted([3, 1])"]) == [["f([3, 1])"]]
    # setup: `x` is handed to f, so it lives in f's process; `expected` is not, so it runs apart only
    plan = make_plan(["x = [3, 1, 2]", "expected = [1, 2, 3]", "assert srt(x) == expected",
                      "assert x == [3, 1, 2]"])
    inside, apart = ([s.get("eval", s.get("exec")) for s in plan.steps(side)] for side in ("inside", "apart"))
    assert inside == ["x = [3, 1, 2]", ["srt(x)"], ["x"]]
    assert apart == ["expected = [1, 2, 3]", ["expected"]]
    # holes whole: identity between two of its values, a comprehension over its values, its own class
    assert inside_of(["a = []", "assert f(a) is a"]) == ["a = []", ["f(a) is a"]]
    assert inside_of(["xs = [1]", "assert all(f(i) == i for i in xs)"]) == [
        "xs = [1]", ["(f(i) == i for i in xs)"]]
    # ... but all() / any() over a literal is unrolled: each item split on its own
    assert inside_of(["assert all(f(i) == i for i in range(3))"]) == [["f(0)", "f(1)", "f(2)"]]
    assert inside_of(["assert any(f(x) == y for x, y in [(1, 2), (3, 4)])"]) == [["f(1)", "f(3)"]]
    assert inside_of(["assert isinstance(f(1), Node)", "assert isinstance(f(1), int)"]) == [
        ["isinstance(f(1), Node)"], ["f(1)"]]


def test_a_check_function_of_asserts_is_judged_as_its_asserts():
    tests = CHECK.replace("):\n", "):\n    '''HumanEval.'''\n", 1) + "\ncheck(square)\n"
    plan = make_plan(split_tests(tests))
    assert plan.count == 2 and [u.test for u in plan.units] == [0, 1, 1]
    assert plan.units[0].apart == {"u": 0, "exec": ast.unparse(ast.parse(split_tests(tests)[0]))}
    assert inside_of(split_tests(tests)) == [["square(2)"], ["square(3)"]]


def test_the_expected_values_never_reach_the_completions_process_input():
    tests = ["expected = 4242", "assert add(1, 2) == expected", "assert abs(add(1, 2) - 4343) < 1e-9",
             "import math", "assert math.isclose(add(2, 2), 4444)", "assert add(3, 3) == sorted([4545])[0]",
             "def check(candidate):\n    assert candidate(4, 4) == 4646", "check(add)"]
    sent = json.dumps(make_plan(tests).steps("inside"))
    assert "add(1, 2)" in sent and not re.search("42|43|44|45|46", sent)


# --------------------------------------------------------------------------------------- values (no runs)
def crossed(value: object) -> object:
    return decode(loads(json.dumps(encode(value))))


def test_plain_values_cross_exactly_and_nan_never_equals():
    value = {"a": [1, 2.5, (3, "x")], 4: {5, 6}, (7,): frozenset({b"z"}), None: [True, 1 + 2j, range(3)]}
    assert crossed(value) == value and type(crossed((1,))) is tuple and type(crossed(True)) is bool
    assert crossed(10**5000) == 10**5000 and crossed(-0.0) == 0.0
    nan = float("nan")
    assert crossed(nan) != crossed(nan) and crossed([nan]) != crossed([nan])  # a fresh NaN each time
    assert crossed(int) is int and crossed(type(None)) is type(None)


def test_iterators_views_and_value_subclasses_keep_pythons_comparisons():
    point = collections.namedtuple("Point", "x y")
    assert crossed(point(1, 2)) == (1, 2) and type(crossed(point(1, 2))) is tuple
    assert crossed(collections.Counter("aab")) == {"a": 2, "b": 1}
    assert list(crossed(x * x for x in range(3))) == [0, 1, 4] and crossed(iter([1])) != [1]
    d = {"b": 1, "a": 2}
    assert crossed(d.keys()) == {"a", "b"} and list(crossed(d.keys())) == ["b", "a"]
    assert list(crossed(d.items())) == [("b", 1), ("a", 2)] and list(crossed(d.values())) == [1, 2]

    class Name(str):
        def __repr__(self) -> str:
            return "Name"

    assert type(crossed(Name("ab"))) is str and crossed(Name("ab")) == "ab"


def test_always_equal_objects_and_int_subclasses_with_their_own_eq_are_opaque():
    class Same:
        def __eq__(self, other):
            return True

    class Int(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    for trick in (Same(), Int(3), [Int(3)], {"k": Same()}):
        value = crossed(trick)
        with pytest.raises(JudgeError):
            _ = value == 3 or value == [3] or value == {"k": 3}
        if not isinstance(trick, (list, dict)):  # a list holding one is a non-empty list: true
            with pytest.raises(JudgeError):
                bool(value)
    opaque = crossed(Same())
    assert isinstance(opaque, Opaque) and opaque is not None and opaque is not True
    assert all(crossed(x) for x in (len, lambda: 0, Same, collections))  # functions, classes, modules: true
    with pytest.raises(JudgeError):
        _ = crossed(len) == crossed(len)
    with pytest.raises(JudgeError):
        _ = opaque != 3
    assert isinstance(crossed(list(range(300_000))), Opaque)  # over the budget: too large
    cycle: list = []
    cycle.append(cycle)
    assert isinstance(crossed(cycle), Opaque)
    assert isinstance(decode({"r": [0, 10**12, 1]}), Opaque) and isinstance(decode({"zz": 1}), Opaque)


def test_the_trainer_applies_the_tests_operators_within_bounds():
    def verdict(expression: str, **values: object) -> object:
        return evaluate(ast.parse(expression, mode="eval").body, values)

    assert verdict("abs(h - a) < 1e-6", h=0.30000000000000004, a=0.3) is True
    assert verdict("isclose(h, 0.5, rel_tol=0.01)", h=0.501) is True
    assert verdict("sorted(h) == [1, 2] and len(h) == 2", h=[2, 1]) is True
    assert verdict("h or a", h=0, a=[]) == [] and verdict("not h", h=()) is True
    assert verdict("(h + [3]) * 2", h=[1]) == [1, 3, 1, 3]
    for big in ("h ** 100000", "h * 10000000", "h % 3"):
        with pytest.raises(JudgeError):
            verdict(big, h=2**64 if big.startswith("h **") else "ab")


# ------------------------------------------------------------------------------------------- the channel
def test_the_channel_counts_one_message_per_unit_after_exactly_one_begin():
    m = cj.PREFIX
    ok = cj.read_channel(f"noise\n{m} begin\n{m} 0 {{\"v\": [3]}}\n{m} 1 {{\"ok\": 1}}\n{m} end\n")
    assert ok == cj.Channel(True, {0: '{"v": [3]}', 1: '{"ok": 1}'})
    early = cj.read_channel(f"{m} 0 {{\"v\": [3]}}\n{m} begin\n{m} 1 x\n{m} 1 y\n{m} 2 z\n")
    assert early == cj.Channel(True, {2: "z"})  # 0 came before the begin, 1 twice
    assert not cj.read_channel(f"{m} begin\n{m} 0 a\n{m} begin\n").began
    assert not cj.read_channel(f"{m} 0 a\n").began


# ---------------------------------------------------------------------------------- runs in the sandbox
@pytest.mark.slow
def test_hand_worked_scores_across_test_shapes(monkeypatch):
    monkeypatch.setattr(cj, "TEST_TIMEOUT", 2.0)
    shapes = ["assert half(4) == 2", "assert abs(half(1) - 0.5) < 1e-9", "assert half(3) in (1, 1.5)",
              'assert half(0) == 0, "zero"', "assert not half(0)", "assert half(None) is None",
              "expected = [0.5, 1.0]", "assert [half(1), half(2)] == expected",
              "assert half(-1) < 0 < half(1)", "assert half(float('inf')) == float('inf')"]
    right = "def half(x):\n    return None if x is None else x / 2"
    floor = "def half(x):\n    return None if x is None else x // 2"  # 4//2, 0, None, -1 < 0: and `expected`
    raising = "def half(x):\n    return x / 2"  # half(None) raises: that test alone fails
    assert scores([(right, shapes), (floor, shapes), (raising, shapes), ("x = (", shapes), ("", []),
                   ("raise ValueError", [])]) == [1.0, 0.6, 0.9, 0.0, 1.0, 0.0]


@pytest.mark.slow
def test_a_timeout_keeps_what_was_reported_before_it_and_all_over_a_literal_is_judged_item_by_item(
        monkeypatch):
    monkeypatch.setattr(cj, "TEST_TIMEOUT", 0.5)
    hangs_on_zero = "def add(a, b):\n    while a == 0:\n        pass\n    return a + b"
    tests = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 4"]  # 1 passes, 2 hangs
    every = ["assert all(add(x, x) == y for x, y in [(1, 2), (2, 4)])",
             "assert any(add(x, 0) == 5 for x in range(9))"]
    same = "class Same:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Same()"
    assert scores([(hangs_on_zero, tests), (RIGHT, every), (same, every), (WRONG, every)]) == [
        0.3333, 1.0, 0.0, 0.0]


def probe_code() -> str:
    """A completion that searches everything its process can read (stdin rewound, every frame's locals and
    globals, every string in an object the collector tracks) for the tests' expected values; ``add`` returns
    whether it found each and, as a control, the text of its own call (the searched texts are built at run
    time, so that the code itself holds none of them)."""
    return """\
import gc, os, sys
os.lseek(0, 0, 0)
STDIN = sys.stdin.read()
def add(a, b):
    texts, frame = [STDIN], sys._getframe(1)
    while frame is not None:
        texts += [repr(frame.f_locals)[:200000], repr(frame.f_globals)[:200000]]
        frame = frame.f_back
    for obj in gc.get_objects():
        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
        texts += [x for x in list(items) if isinstance(x, str)]
    found = [any(str(4200 + n) in t for t in texts) for n in (42, 143, 244)]
    return found, any(f"add({a}, {b})" in t for t in texts)
"""


@pytest.mark.slow
def test_the_expected_values_are_nowhere_in_the_completions_process(monkeypatch):
    without_hook(monkeypatch)  # the hook refuses gc.get_objects: the probe reads everything without it
    plan = make_plan(["expected = 4242", "assert add(1, 2) == expected", "assert abs(add(1, 2) - 4343) < 1",
                      "assert add(1, 2) == sorted([4444])"])
    channel, finished = cj.run(probe_code(), plan.steps("inside"), plan.builtins)
    found = [decode(loads(channel.messages[u])["v"][0]) for u in (1, 2, 3)]
    assert finished and channel.began and found == [([False, False, False], True)] * 3


def without_hook(monkeypatch) -> None:
    """Runs without the sandbox's audit hook (the kernel layers stay), so that the judge alone is tested."""
    monkeypatch.setattr(sandbox, "run_python", functools.partial(sandbox.run_python, audit=False))


def trick(code: str) -> str:
    return WRONG + code


TRICKS = {  # each as a model would write it, on top of the honest wrong answer (1/3)
    "stdin rewind": trick("""\
import os, re, sys
os.lseek(0, 0, 0)
SEEN = sys.stdin.read()
_add = add
def add(a, b):
    hit = re.search(rf"add\\({a}, {b}\\) == (\\d+)", SEEN)
    return int(hit[1]) if hit else _add(a, b)
"""),
    "frame walking": trick("""\
import re, sys
_add = add
def add(a, b):
    frame = sys._getframe(1)
    while frame is not None:
        for scope in (frame.f_locals, frame.f_globals):
            hit = re.search(rf"add\\({a}, {b}\\) == (\\d+)", repr(list(scope.values())))
            if hit:
                return int(hit[1])
        frame = frame.f_back
    return _add(a, b)
"""),
    "gc scan": trick("""\
import gc, re
_add = add
def add(a, b):
    for obj in gc.get_objects():
        for item in list(obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list) else ()):
            hit = re.search(rf"add\\({a}, {b}\\) == (\\d+)", item) if isinstance(item, str) else None
            if hit:
                return int(hit[1])
    return _add(a, b)
"""),
    "always equal": trick("""\
class Same:
    def __eq__(self, other):
        return True
def add(a, b):
    return Same()
"""),
    "int subclass": trick("""\
class Int(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
_add = add
def add(a, b):
    return Int(_add(a, b))
"""),
    "os._exit early": trick("import os\nprint('all tests passed')\nos._exit(0)\n"),
    "sys.exit early": trick("import sys\nsys.exit(0)\n"),
    "printed markers": trick("""\
import sys
for line in ["pass", "@lrl-judge begin", '@lrl-judge 0 {"v": [3]}', '@lrl-judge 1 {"v": [4]}']:
    print(line)
sys.stdout.flush()
"""),
    "fake messages on every fd, then exit": trick("""\
import os
fake = "\\n@lrl-judge begin\\n" + "".join(f'@lrl-judge {u} {{"v": [true]}}\\n' for u in range(3))
for fd in range(1, 64):
    try:
        os.write(fd, fake.encode())
    except OSError:
        pass
os._exit(0)
"""),
    "fake messages on every fd, judge goes on": trick("""\
import os
for fd in range(1, 64):
    try:
        os.write(fd, b'\\n@lrl-judge begin\\n@lrl-judge 0 {"v": [3]}\\n')
    except OSError:
        pass
"""),
    "monkeypatching the harness": trick("""\
import __main__, sys
judge = sys._getframe(1).f_globals
for scope in (judge, vars(__main__)):
    scope["run_step"] = lambda *args: {"v": [True]}
    scope["encode"] = lambda value: True
"""),
}


@pytest.mark.slow
@pytest.mark.parametrize("hook", [False, True], ids=["judge alone", "with the audit hook"])
def test_every_known_trick_scores_what_an_honest_wrong_answer_scores(monkeypatch, hook):
    if not hook:
        without_hook(monkeypatch)
    names = list(TRICKS)
    got = dict(zip(names, scores([(TRICKS[n], ADD) for n in names]), strict=True))
    assert scores([(WRONG, ADD)]) == [0.3333]
    lookups = ("stdin rewind", "frame walking", "gc scan", "printed markers")
    expected = dict.fromkeys(names, 0.0) | dict.fromkeys(lookups, 0.3333)  # found nothing, no effect: 1/3
    if hook:
        expected["gc scan"] = 0.0  # the hook refuses gc.get_objects: the scan raises
    assert got == expected
    # the old judge: the tests sat in its process (stdin, frames, gc) and compared the objects themselves
    fooled = [n for n in ("stdin rewind", "frame walking", "gc scan", "always equal", "int subclass")
              if not (hook and n == "gc scan")]
    assert [old_score(TRICKS[n], ADD) for n in fooled] == [1.0] * len(fooled)


@pytest.mark.slow
def test_patched_and_shadowed_builtins_do_not_reach_the_tests():
    tests = ["assert len(digits(1234)) == 4", "assert sorted(digits(312)) == [1, 2, 3]",
             "assert sum(digits(55)) == 10", "assert digits(len('ab'))[0] == 2"]
    wrong = "def digits(n):\n    return [int(c) for c in str(n)] + [0]\n"  # only the sum and the last: 2/4
    patched = wrong + "import builtins\nbuiltins.len = lambda x: 4\nbuiltins.sorted = lambda x: [1, 2, 3]\n" \
                      "sum = lambda x: 10\n"
    assert scores([(wrong, tests), (patched, tests)]) == [0.5, 0.5]
    assert old_score(patched, tests) == 0.75  # the old judge ran the tests with the patched builtins


@pytest.mark.slow
def test_a_forged_message_is_worth_what_returning_the_claimed_value_is_worth():
    forged = """\
import os
claims = b"\\n@lrl-judge begin\\n" + b"".join(
    b'@lrl-judge %d {"v": [%d]}\\n' % (u, v) for u, v in enumerate([2, 4, 25]))
for fd in range(3, 64):  # the channel is one of them: claim a * b there, then leave before the judge
    try:
        os.write(fd, claims)
    except OSError:
        pass
os._exit(0)
"""
    assert scores([(forged, ADD), (WRONG, ADD)]) == [0.3333, 0.3333]


SORT = ["x = [3, 1, 2]", "assert srt(x) == [1, 2, 3]", "assert x == [3, 1, 2]"]
HONEST = [  # (code, tests): shapes the old judge scored right, which must score the same
    (RIGHT, ADD), (WRONG, ADD), ("def add(a, b):\n    raise ValueError", ADD), ("def add(a, b) return", ADD),
    ("def srt(x):\n    x.sort()\n    return x", SORT), ("def srt(x):\n    return sorted(x)", SORT),
    ("import math\ndef area(r):\n    return math.pi * r * r",
     ["import math", "assert abs(area(2) - 12.566) < 1e-3",
      "assert math.isclose(area(1), 3.1416, rel_tol=1e-3)"]),
    ("def even(n):\n    print('checking', n)\n    return n % 2 == 0",
     ["assert even(2)", "assert not even(3)", "assert even(3) is False", "assert even(5) in (True,)"]),
    ("def square(x):\n    return x * x", CHECK + "\ncheck(square)\n"),
    ("def square(x):\n    return x + x", CHECK + "\ncheck(square)\n"),
    ("from collections import Counter, namedtuple\nP = namedtuple('P', 'x y')\n"
     "def freq(s):\n    return Counter(s)\n"
     "def pt():\n    return P(1, 2)\ndef gen(n):\n    return (i for i in range(n))",
     ["assert freq('aab') == {'a': 2, 'b': 1}", "assert pt() == (1, 2)", "assert list(gen(3)) == [0, 1, 2]",
      "assert gen(1) != [0]", "expected = {'b': 2, 'a': 1}", "assert freq('abb') == expected"]),
    ("def biggest(xs):\n    return max(xs, default=float('-inf'))",
     ["assert biggest([]) == float('-inf')", "assert biggest([1, 5]) == 5", "assert missing(1) == 1"]),
    ("COUNT = 0\ndef bump():\n    global COUNT\n    COUNT += 1", ["bump()", "bump()", "assert COUNT == 2"]),
    ("def f(x):\n    return x", ["assert f", "assert callable(f)"]),
    ("def f(x):\n    return x", []), ("raise SystemExit(3)", []),
]


@pytest.mark.slow
def test_honest_code_scores_what_it_scored_under_the_old_judge():
    new = scores(HONEST)
    assert new == [old_score(code, tests) for code, tests in HONEST]
    assert new == [1.0, 0.3333, 0.0, 0.0, 0.6667, 1.0, 1.0, 0.75, 1.0, 0.5, 1.0, 0.6667, 1.0, 1.0, 1.0, 0.0]
