"""Math rewards: final-answer extraction, symbolic answer checking (``math-verify``) and a format reward.

Named in YAML like every reward function (``lightning_rl.step.math_rewards:math_verify_reward``) and called
as ``fn(prompts=[...], completions=[...], **columns)``. ``math_verify_reward`` needs the ``math`` extra
(``pip install 'lightning-rl[math]'``); ``extract_answer`` and ``format_reward`` need nothing.

Extraction rules of ``extract_answer``, first that applies wins:

1. ``<answer>...</answer>``: the last closed pair decides. Inside it, a ``\\boxed{}`` wins (rule 2
   applied to the content), else the whole content, stripped; a blank pair means no answer. An unclosed
   ``<answer>`` (a truncated generation) is ignored.
2. The last complete ``\\boxed{...}`` or ``\\fbox{...}``, braces balanced (``\\boxed{\\frac{1}{2}}``);
   ``\\boxed 5`` (no braces) also counts. A box cut off before its closing brace is skipped.
3. GSM8K's ``#### 42``: the rest of the last such line.
4. ``answer is X`` / ``answer: X`` (any case; "The final answer is $5$."): the rest of the last such
   line, cut at the end of its first sentence.
5. The last number: integers, decimals, ``1,000``-style thousands, ``3/4`` and ``\\frac{3}{4}`` with
   integer parts, a leading minus.

Math delimiters around the answer (``$...$``, ``\\(...\\)``, ``\\[...\\]``) and a trailing full stop are
stripped. Gold answers go through rules 1-4 only: a gold without any marker is taken whole (``\\frac{1}{2}``,
``0.5``, ``(1, 2)``), since its last number would cut ``\\frac{1}{2}`` down to ``2``.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

MATH_EXTRA = "pip install 'lightning-rl[math]'"

# ------------------------------------------------------------------------------------------ extraction
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)|\\boxed[ \t]+([^\s${}]+)")
_GSM8K = re.compile(r"####[ \t]*([^\n]*)")
_ANSWER_IS = re.compile(r"\banswer(?:[ \t]+is|[ \t]*:)[ \t]*:?[ \t]*([^\n]*)", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?=\s|$)")
_INT = r"\d{1,3}(?:,\d{3})+|\d+"
_LAST_NUMBER = re.compile(
    rf"\\[dt]?frac\s*\{{\s*-?\d+\s*\}}\s*\{{\s*\d+\s*\}}"  # \frac{3}{4}
    rf"|(?<![\w.)\]}}])-?(?:(?:{_INT})(?:\.\d+)?(?:\s*/\s*\d+)?|\.\d+)"  # -1,000.5  3/4  .5
)
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))


def _boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (balanced braces), else None."""
    for match in reversed(list(_BOX.finditer(text))):
        if match.group(2) is not None:  # \boxed 5
            return match.group(2)
        depth, start = 0, match.start(1)
        for i in range(start, len(text)):
            if text[i] == "{" and text[i - 1] != "\\":
                depth += 1
            elif text[i] == "}" and text[i - 1] != "\\":
                depth -= 1
                if depth == 0:
                    return text[start + 1 : i]
    return None


def _clean(answer: str) -> str:
    """Strip whitespace, enclosing math delimiters and a trailing full stop."""
    answer = answer.strip().strip("*").strip()  # markdown bold: "**Answer:** 42"
    changed = True
    while changed:
        changed = False
        if answer.endswith(".") and not answer.endswith(".."):
            answer, changed = answer[:-1].rstrip(), True
        for left, right in _DELIMITERS:
            if len(answer) > len(left) + len(right) and answer.startswith(left) and answer.endswith(right):
                answer, changed = answer[len(left) : -len(right)].strip(), True
                break
    return answer


def _extract(text: str, last_number: bool) -> str | None:
    closed = _ANSWER_TAG.findall(text)
    if closed:
        content = closed[-1]
        boxed = _boxed(content)
        answer = _clean(boxed if boxed is not None else content)
        return answer or None
    boxed = _boxed(text)
    if boxed is not None:
        return _clean(boxed) or None
    for pattern in (_GSM8K, _ANSWER_IS):
        found = [m.group(1) for m in pattern.finditer(text) if m.group(1).strip()]
        if found:
            line = found[-1]
            end = _SENTENCE_END.search(line) if pattern is _ANSWER_IS else None
            answer = _clean(line[: end.start()] if end else line)
            if answer:
                return answer
    if last_number:
        numbers = _LAST_NUMBER.findall(text)
        if numbers:
            return numbers[-1].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in ``text`` by the module's rules (``<answer>`` tag, box, ``####``, "answer is",
    last number), or None when there is none. Pure: no ``math-verify`` needed.

    >>> extract_answer(r"so \\boxed{\\frac{1}{2}} it is")
    '\\\\frac{1}{2}'
    >>> extract_answer("Natalia sold 48 + 24 = 72 clips.\\n#### 72")
    '72'
    """
    return _extract(str(text), last_number=True)


def _gold_answer(gold: Any) -> str | None:
    """A gold answer: extracted by rules 1-4 (full solutions), else the whole text (bare answers)."""
    text = str(gold)
    return _extract(text, last_number=False) or _clean(text) or None


# -------------------------------------------------------------------------------------------- checking
# words (2+ letters) that end an answer written in prose ("42 apples", "18 dollars because ...");
# function names that plain-text maths uses are not words here
_WORD = re.compile(r"(?<![A-Za-z\\])[A-Za-z]{2,}")
_MATH_WORDS = frozenset({"sqrt", "pi", "sin", "cos", "tan", "log", "ln", "exp", "inf", "infty", "oo", "mod"})
_FIRST_MATH = re.compile(r"[-+.\d(\[]")


def _math_text(answer: str) -> str:
    """The maths of an extracted answer. LaTeX (any backslash) is kept whole; prose keeps only the run
    from its first digit up to the next word: ``"42 because 6 x 7"`` -> ``"42"``, ``"about 5 cm"`` ->
    ``"5"`` (math-verify would otherwise read ``"18 dollars"`` as a product of symbols)."""
    answer = re.sub(r"^\\?\$(?=\s*\d)", "", answer)  # "$18", "\$18": currency, not a delimiter
    if "\\" in answer:
        return answer
    words = [m for m in _WORD.finditer(answer) if m.group().lower() not in _MATH_WORDS]
    if not words:
        return answer
    start = _FIRST_MATH.search(answer)
    if start is None:
        return answer
    end = next((w.start() for w in words if w.start() > start.start()), len(answer))
    return answer[start.start() : end].strip().rstrip(",;:").strip()


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError as err:
        raise ValueError(
            "`lightning_rl.step.math_rewards:math_verify_reward` needs the `math-verify` package: "
            f"{MATH_EXTRA}"
        ) from err
    return math_verify


def _usable_timeout(timeout_s: int | None) -> int | None:
    """math-verify times out with ``signal.alarm``, which works only in the main thread of a POSIX
    process (elsewhere it raises ValueError, and on Windows it spawns a process per call): None there."""
    if timeout_s is None or timeout_s <= 0 or not hasattr(signal, "SIGALRM"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    return int(timeout_s)


@contextmanager
def _outer_alarm_kept(active: bool) -> Iterator[None]:
    """Re-arm an ``ITIMER_REAL`` timer that was running before math-verify's ``signal.alarm`` (which
    replaces it and then cancels it), less the time spent: pytest-timeout and user watchdogs keep working."""
    if not active:
        yield
        return
    delay, interval = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    try:
        yield
    finally:
        if delay > 0:
            signal.setitimer(signal.ITIMER_REAL, max(delay - (time.monotonic() - start), 1e-3), interval)


def _parse(mv: Any, answer: str | None, timeout_s: int | None) -> list:
    if not answer:
        return []
    text = _math_text(answer)
    if not text:
        return []
    # boxed: math-verify's LaTeX normalisation (\dfrac, \left( \right), units, \text{}, 1,000, \%) applies
    return mv.parse("\\boxed{" + text + "}", parsing_timeout=timeout_s)


def math_verify_reward(
    completions: Sequence[str], answer: Sequence[Any], timeout_s: int | None = 5, **_: Any
) -> list[float]:
    """1.0 where the completion's final answer equals the gold answer symbolically, else 0.0.

    Both sides are extracted (``extract_answer`` for completions, which prefers ``<answer>``; rules 1-4
    or the whole text for ``answer``, so bare answers and GSM8K ``#### 42`` solutions both work), parsed
    and compared with ``math-verify``: ``2/4`` = ``\\frac{1}{2}`` = ``\\dfrac12`` = ``0.5``,
    ``1,000`` = ``1000``, ``5 cm`` = ``5``, ``\\left(1, 2\\right)`` = ``(1,2)``, and a percentage equals
    both its number and its fraction (``50\\%`` = ``50`` = ``0.5``), as math-verify decides. Floats
    compare after rounding to 6 decimals (``0.333333`` = ``\\frac13``, ``0.333`` does not). A completion
    with no answer, or one that does not parse, scores 0.0; nothing raises.

    Args:
        timeout_s: per parse / comparison, through math-verify's ``signal.alarm``. Used only in the
            main thread of a POSIX process; elsewhere (a worker thread, Windows) math-verify runs with no
            timeout at all, so a pathological expression can stall that thread.

    Raises:
        ValueError: ``math-verify`` is not installed (the message names the ``math`` extra).
    """
    mv = _math_verify()
    timeout = _usable_timeout(timeout_s)
    golds: dict[str, list] = {}
    out = []
    with _outer_alarm_kept(timeout is not None):
        for completion, gold in zip(completions, answer, strict=True):
            key = str(gold)
            try:
                if key not in golds:
                    golds[key] = _parse(mv, _gold_answer(gold), timeout)
                want = golds[key]
                got = _parse(mv, extract_answer(str(completion)), timeout) if want else []
                ok = bool(got) and mv.verify(want, got, timeout_seconds=timeout)
            except Exception:  # noqa: BLE001 - untrusted model text must score 0, never stop the run
                ok = False
            out.append(float(ok))
    return out


# -------------------------------------------------------------------------------------------- format
_FORMAT = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def format_reward(completions: Sequence[str], **_: Any) -> list[float]:
    """1.0 where the completion is ``<think>...</think>`` then ``<answer>...</answer>`` and nothing else.

    Like TRL / open-r1's ``^<think>\\n.*?\\n</think>\\n<answer>\\n.*?\\n</answer>$`` (DOTALL), but any
    whitespace (or none) may stand where they require newlines: before ``<think>``, between the blocks,
    inside the tags and after ``</answer>``. Exactly one of each tag; nothing but whitespace before
    ``<think>`` (reasoning outside the tags is what the layout rules out: a chat template that opens
    ``<think>`` in the prompt needs its own reward); the answer must not be blank; the thinking may be
    (models with thinking switched off emit ``<think>\\n\\n</think>``).
    """
    out = []
    for completion in completions:
        text = str(completion)
        match = _FORMAT.fullmatch(text)
        ok = match is not None and all(text.count(tag) == 1 for tag in _TAGS) and bool(match.group(2).strip())
        out.append(float(ok))
    return out
