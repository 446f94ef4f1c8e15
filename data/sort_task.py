"""The built-in verifiable task: sort a string of digits.

Prompt ``50318=``, answer ``01358``. A seeded training stream and a disjoint held-out set let a tiny
model learn it in minutes on a CPU, and the reward is exact match, so every RL algorithm here can be
shown to lift held-out accuracy with no network.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class SortTask:
    """Sort ``num_digits`` random digits (repeats allowed).

    Args:
        num_digits: digits per prompt.
        num_train: size of the training set (indexable, deterministic per index).
        num_val: size of the held-out set; no held-out prompt ever appears in training.
        seed: seed of both sets.
    """

    num_digits: int = 5
    num_train: int = 20_000
    num_val: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_digits < 1:
            raise ValueError(f"`num_digits` must be >= 1, got {self.num_digits}")
        if self.num_val >= 10**self.num_digits // 2:
            raise ValueError(f"`num_val`={self.num_val} is too large for {self.num_digits} digits")

    @staticmethod
    def example(digits: str) -> dict[str, str]:
        """The row for one digit string: ``{"prompt": "50318=", "answer": "01358"}``."""
        return {"prompt": f"{digits}=", "answer": "".join(sorted(digits))}

    def _digits(self, rng: random.Random) -> str:
        return "".join(rng.choice("0123456789") for _ in range(self.num_digits))

    @cached_property
    def val_digits(self) -> tuple[str, ...]:
        rng = random.Random(f"sort-val-{self.seed}")
        seen: dict[str, None] = {}
        while len(seen) < self.num_val:
            seen[self._digits(rng)] = None
        return tuple(seen)

    @cached_property
    def _val_lookup(self) -> frozenset[str]:
        return frozenset(self.val_digits)

    def val_rows(self) -> list[dict[str, str]]:
        """The held-out set, in a fixed order."""
        return [self.example(d) for d in self.val_digits]

    def train_row(self, index: int) -> dict[str, str]:
        """Training row ``index``: the same for a given seed on every machine, never a held-out prompt."""
        if not 0 <= index < self.num_train:
            raise IndexError(f"training row {index} out of range [0, {self.num_train})")
        rng = random.Random(f"sort-train-{self.seed}-{index}")
        digits = self._digits(rng)
        while digits in self._val_lookup:
            digits = self._digits(rng)
        return self.example(digits)


def sort_is_correct(completion: str, answer: str) -> bool:
    """Exact match after stripping surrounding whitespace."""
    return completion.strip() == answer.strip()
