"""Reward functions.

A reward function is named in YAML by import path (``package.module:function``) and called as
``fn(prompts=[...], completions=[...], **columns)``, where ``columns`` holds every other dataset
column as a list aligned with the completions. It returns one float per completion. The weighted sum of
several, with its errors, is :mod:`lightning_rl.step.reward_scorer`; the rewards stage of the online step
(reward model, overlong shaping, correctness) is :mod:`lightning_rl.step.reward_pipeline`.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from lightning_rl import moved_hint

RewardFn = Callable[..., Sequence[float]]


def import_reward(path: str) -> RewardFn:
    """Import ``package.module:function`` (``package.module.function`` also accepted)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward function `{path}` must look like `package.module:function`")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import reward function `{path}`: {err}{moved_hint(module_name)}") from err
    if not callable(fn):
        raise ValueError(f"reward function `{path}` is not callable")
    return fn


def exact_match(completions: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
    """1.0 where the completion equals the answer after stripping whitespace, else 0.0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


def _last_number(text: str) -> float | None:
    if "\\boxed{" in text:  # prefer a LaTeX boxed answer when there is one
        text = text[text.rindex("\\boxed{") :]
        found = _NUMBER.findall(text)
        return float(found[0].replace(",", "")) if found else None
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def numeric_match(
    completions: Sequence[str], answer: Sequence[str], rel_tol: float = 1e-6, **_: Any
) -> list[float]:
    """1.0 where the completion's final number (or its ``\\boxed{}`` one) equals the answer's number.

    ``"1,000"``, ``"1000.0"`` and ``"1e3"`` are all equal; a completion with no number scores 0.
    """
    out = []
    for c, a in zip(completions, answer, strict=True):
        got, want = _last_number(c), _last_number(str(a))
        out.append(float(
            got is not None and want is not None and math.isclose(got, want, rel_tol=rel_tol, abs_tol=1e-9)
        ))
    return out


class FullScore:
    """Correctness from a reward function: correct where it scores its full score, 1.0 or more (the default
    correctness of online modules without ``accuracy_fn``: it follows their main reward function)."""

    FULL = 1.0

    def __init__(self, name: str, fn: RewardFn) -> None:
        self.name, self.fn = name, fn

    def __call__(self, **kwargs: Any) -> list[bool]:
        return [float(v) >= self.FULL for v in self.fn(**kwargs)]

    def __repr__(self) -> str:
        return f"{self.name} (correct at its full score, {self.FULL})"
