"""The reward ``code_tests`` (``lightning_rl.sandbox:code_tests``): the fraction of a row's test cases (the
``tests`` column) that its completion passes, judged so that the completion cannot forge a pass.

The principle: the expected values never enter the completion's process, and the verdict is decided by a
process that never holds the completion's objects. Three places take part:

- **the completion's process** (``sandbox.run_python`` on :mod:`lightning_rl.code_judge_harness`): runs the
  completion's code (see ``extract_code``), then the test statements that touch its names and, for each
  assert, only the subexpressions that need its names (``f(x)`` of ``assert abs(f(x) - 2.5) < 1e-6``),
  with the builtins as they were before the code ran. Values leave as plain data (exact ``int``, ``str``,
  ``list``, ... and subclasses that add no behaviour; anything else is *opaque*).
- **a separate run that never sees the completion** (the same harness, no code): the tests' self-contained
  parts that are not literals (``sorted([3, 1, 2])``, ``float("inf")``, ``expected = [...]`` and its uses),
  once per row's test set (the G completions of a group share it; cached).
- **the trainer** (:mod:`lightning_rl.code_judge_values`): decodes the values (bounded) and applies the
  test's own operations (comparison, ``not``, ``abs``, ``len``, ``sorted``, ``math.isclose``, ...) itself.
  An opaque value compares equal to nothing and has no truth, so an always-equal object, an ``int``
  subclass with its own ``__eq__`` and the like fail every test that compares them.

The channel: the harness writes ``@lrl-judge begin`` once the code ran, then one message per unit (a
test's assert or statement). A test passes only when the begin came exactly once and each of its units
has exactly one well-formed message after it: a code that raises or exits early (``sys.exit(0)``,
``os._exit(0)``) never began, so all its tests fail; a second begin (a forged one) fails every test; a
message before the begin or a unit reported twice (a printed marker, a guessed format) fails that test;
a missing message (an exit or the timeout mid-way) fails that test, and the messages before it count.
The code's own standard output goes to a file, so what it prints never reaches the channel by accident.

What is left to a forger: the process runs the code, so the code can always write well-formed messages
itself (it needs no secret: there is none) and exit; all it can put in them is a claim about the values
of its own expressions for the tests' inputs, which is what a function returning those values (a lookup
table of the inputs it can read) scores too. Where a whole assert needs the completion's names (a
comprehension over its function, ``f(x).startswith("ab")``, a statement other than an assert such as a
loop of asserts), its truth or success is such a claim too: write such tests as plain asserts on values.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_rl.code_judge_harness import PREFIX
from lightning_rl.code_judge_plan import Plan, Unit, make_plan, split_tests
from lightning_rl.code_judge_values import decode, evaluate, loads, truth

__all__ = ["code_tests", "extract_code", "split_tests", "judge", "Channel"]

TEST_TIMEOUT = 5.0  # seconds per completion (all its tests), and for each separate run
WORKERS = 4
CACHE_SIZE = 256  # test sets whose plan and separate run are kept
OUTPUT_LIMIT = 16 << 20  # characters of the channel read (the sandbox's file-size limit bounds it too)
HARNESS = Path(__file__).with_name("code_judge_harness.py").read_text()
MESSAGE = re.compile(rf"{re.escape(PREFIX)} (begin|\d{{1,9}})(?: (.*))?", re.ASCII)
_CACHE: OrderedDict[tuple[str, ...], tuple[Plan, Channel | None]] = OrderedDict()
_LOCK = threading.Lock()


@dataclass(frozen=True)
class Channel:
    """What a run reported: ``began`` (exactly one begin) and, per unit, its one message (raw JSON text);
    units reported twice or before the begin are left out."""

    began: bool
    messages: dict[int, str]


def extract_code(completion: str) -> str:
    """The last fenced ```python (or bare ```) block of a completion, else the whole text."""
    blocks = re.findall(r"```(?:python|py)?[^\S\n]*\n(.*?)```", completion, flags=re.DOTALL)
    return blocks[-1] if blocks else completion


def code_tests(prompts: Sequence[Any], completions: Sequence[str], tests: Sequence[str | Sequence[str]],
               **_: Any) -> list[float]:
    """The fraction of each row's test cases (the ``tests`` column: a list of statements, or one string of
    top-level statements) its completion passes; 1.0 when a row has no tests and the code runs to its end.

    Each completion runs in one sandboxed process, ``TEST_TIMEOUT`` seconds for all its tests (a timeout
    fails the tests not reported by then); a test that raises fails alone. See the module's docstring for
    how the tests are split and judged.
    """
    rows = [tuple(split_tests(t)) for t in tests]
    unique = list(dict.fromkeys(rows))
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        prepared = dict(zip(unique, pool.map(prepare, unique), strict=True))
        return list(pool.map(lambda c, r: score(extract_code(c), *prepared[r]), completions, rows))


def score(code: str, plan: Plan, apart: Channel | None) -> float:
    """The fraction of ``plan``'s tests that ``code`` passes (1.0 for no tests when the code runs)."""
    ran, passed = judge(code, plan, apart)
    return sum(passed) / plan.count if plan.count else float(ran)


def judge(code: str, plan: Plan, apart: Channel | None) -> tuple[bool, list[bool]]:
    """Run ``code`` and the plan's inside steps; whether the code ran to its end, and each test's verdict."""
    inside, _ = run(code, plan.steps("inside"), plan.builtins)
    passed = [inside.began and t not in plan.invalid for t in range(plan.count)]
    for unit in plan.units:
        passed[unit.test] = passed[unit.test] and passes(unit, inside, apart)
    return inside.began, passed


def prepare(statements: tuple[str, ...]) -> tuple[Plan, Channel | None]:
    """A test set's plan and its separate run (None when every self-contained part is a literal); cached,
    unless the run was stopped by a limit."""
    with _LOCK:
        if statements in _CACHE:
            _CACHE.move_to_end(statements)
            return _CACHE[statements]
    plan = make_plan(statements)
    steps = plan.steps("apart")
    apart, finished = run("", steps, plan.builtins) if steps else (None, True)
    if finished:
        with _LOCK:
            _CACHE[statements] = (plan, apart)
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
    return plan, apart


def run(code: str, steps: list[dict], names: list[str]) -> tuple[Channel, bool]:
    """Run the harness on ``code`` and ``steps`` in the sandbox; its channel, and whether it finished
    without a limit stopping it."""
    from lightning_rl import sandbox  # sandbox re-exports this module's names: import it when needed

    payload = json.dumps({"code": code, "steps": steps, "builtins": names})
    result = sandbox.run_python(HARNESS, timeout=TEST_TIMEOUT, stdin=payload, output_limit=OUTPUT_LIMIT)
    return read_channel(result.stdout), result.limit is None


def read_channel(stdout: str) -> Channel:
    """The messages of a run's standard output that count (see the module's docstring)."""
    begins, counts, early, bodies = 0, Counter[int](), set(), {}
    for line in stdout.split("\n"):
        found = MESSAGE.fullmatch(line) if line.startswith(PREFIX) else None
        if found is None:
            continue
        if found[1] == "begin":
            begins += 1
            continue
        unit = int(found[1])
        counts[unit] += 1
        bodies[unit] = found[2] or ""
        if not begins:
            early.add(unit)
    return Channel(begins == 1, {u: b for u, b in bodies.items() if counts[u] == 1 and u not in early})


def passes(unit: Unit, inside: Channel, apart: Channel | None) -> bool:
    """Whether one unit passes: its messages are there and say it ran (a statement), or its verdict tree
    is true on the values they carry (an assert). Any error while judging fails it."""
    values = dict(unit.literals)
    try:
        for step, channel, key in ((unit.inside, inside, "h"), (unit.apart, apart, "a")):
            if step is None:
                continue
            if channel is None or not channel.began:
                return False
            message = loads(channel.messages[step["u"]])
            if unit.check is None and message != {"ok": 1}:
                return False
            if unit.check is not None:
                found = message["v"]
                if type(found) is not list or len(found) != len(step["eval"]):
                    return False
                values.update({f"{key}:{k}": decode(v) for k, v in enumerate(found)})
        return unit.check is None or truth(evaluate(unit.check, values))
    except Exception:  # a missing message, malformed JSON, an opaque value compared, an error raised
        return False
