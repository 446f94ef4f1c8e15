"""The built-in tool task: multiply two numbers of 2-3 digits, with a ``calculator`` tool.

Prompt ``37*482=``, answer ``17834``. The tiny built-in model cannot multiply, but it can learn to call the
calculator and copy its result, so a tool genuinely matters here. In the plain-text tool-call format of the
episode runner, one solved episode is (``<eos>`` is the EOS token)::

    37*482=<tool>calculator("37*482")</tool><eos><result>17834</result>17834<eos>
    prompt  model turn 1                     EOS  environment tokens      turn 2 EOS

:func:`tool_trace_rows` cuts such a trace into the two SFT rows that teach it (``data.task:
multiply_tool_traces``, the warm start of ``builtin:tiny-tools``); the tool is
``lightning_rl.episodes.tools.calculator``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import cached_property

from lightning_rl.episodes.tools import calculator
from lightning_rl.models.builtin import EOS

LOW, HIGH = 10, 999  # each factor is uniform in [LOW, HIGH]: 2 or 3 digits
TOOL_NAME = "calculator"
_PROMPT = re.compile(r"^(\d+)\*(\d+)=$")


@dataclass(frozen=True)
class MultiplyTask:
    """Multiply two factors drawn uniformly from [10, 999].

    Args:
        num_train: size of the training set (indexable, deterministic per index).
        num_val: size of the held-out set; no held-out pair ``(a, b)`` ever appears in training.
        seed: seed of both sets.
    """

    num_train: int = 20_000
    num_val: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_train < 1:
            raise ValueError(f"`num_train` must be >= 1, got {self.num_train}")
        if not 1 <= self.num_val <= (HIGH - LOW + 1) ** 2 // 2:
            raise ValueError(f"`num_val`={self.num_val} must be in [1, {(HIGH - LOW + 1) ** 2 // 2}]")

    @staticmethod
    def example(a: int, b: int) -> dict[str, str]:
        """The row for one pair: ``{"prompt": "37*482=", "answer": "17834"}``."""
        return {"prompt": f"{a}*{b}=", "answer": str(a * b)}

    @staticmethod
    def _pair(rng: random.Random) -> tuple[int, int]:
        return rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)

    @cached_property
    def val_pairs(self) -> tuple[tuple[int, int], ...]:
        rng = random.Random(f"multiply-val-{self.seed}")
        seen: dict[tuple[int, int], None] = {}
        while len(seen) < self.num_val:
            seen[self._pair(rng)] = None
        return tuple(seen)

    @cached_property
    def _val_lookup(self) -> frozenset[tuple[int, int]]:
        return frozenset(self.val_pairs)

    def val_rows(self) -> list[dict[str, str]]:
        """The held-out set, in a fixed order."""
        return [self.example(a, b) for a, b in self.val_pairs]

    def train_row(self, index: int) -> dict[str, str]:
        """Training row ``index``: the same for a given seed on every machine, never a held-out pair."""
        if not 0 <= index < self.num_train:
            raise IndexError(f"training row {index} out of range [0, {self.num_train})")
        rng = random.Random(f"multiply-train-{self.seed}-{index}")
        pair = self._pair(rng)
        while pair in self._val_lookup:
            pair = self._pair(rng)
        return self.example(*pair)


def tool_call(expression: str) -> str:
    """The model's text for one calculator call: ``<tool>calculator("37*482")</tool>``."""
    return f'<tool>{TOOL_NAME}("{expression}")</tool>'


def tool_trace_rows(row: dict[str, str]) -> list[dict[str, str]]:
    """The two SFT rows of one solved calculator episode of ``row`` (a :class:`MultiplyTask` row).

    Row 1 teaches the call: prompt ``37*482=``, answer ``<tool>calculator("37*482")</tool>``. Row 2 teaches
    copying the result: its prompt is the whole context the episode runner builds before turn 2 (prompt,
    call, the EOS that ended turn 1 written as the text ``<eos>``, which the char tokenizer maps to the EOS
    id, then ``<result>17834</result>``), its answer ``17834``. SFT appends EOS to both answers, so the
    two rows hold exactly the token sequence of the episode, with the loss on the model's turns only.

    Raises:
        ValueError: a prompt that is not ``A*B=``.
    """
    found = _PROMPT.match(row["prompt"])
    if found is None:
        raise ValueError(f"not a multiplication prompt `A*B=`: {row['prompt']!r}")
    call = tool_call(f"{found[1]}*{found[2]}")
    answer = str(row["answer"])
    second = f"{row['prompt']}{call}{EOS}<result>{calculator(f'{found[1]}*{found[2]}')}</result>"
    return [{"prompt": row["prompt"], "answer": call}, {"prompt": second, "answer": answer}]
