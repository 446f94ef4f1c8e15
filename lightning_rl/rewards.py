"""Reward functions.

A reward function is named in YAML by import path (``package.module:function``) and called as
``fn(prompts=[...], completions=[...], **columns)``, where ``columns`` holds every other dataset
column as a list aligned with the completions. It returns one float per completion.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

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
        raise ValueError(f"cannot import reward function `{path}`: {err}") from err
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


class RewardError(RuntimeError):
    """A reward function raised, returned the wrong number of values, or returned NaN."""


class RewardScorer:
    """Weighted sum of several reward functions, with errors that name the function and the sample.

    Args:
        fns: import paths ``package.module:function``.
        weights: one weight per function (default 1.0 each).
        on_error: ``raise`` stops the run on the first bad reward; ``zero`` scores it 0 and counts it.
    """

    def __init__(
        self, fns: Sequence[str], weights: Sequence[float] | None = None, on_error: str = "raise"
    ) -> None:
        if not fns:
            raise ValueError("`model.reward_fns` is empty: name at least one reward function")
        if weights is not None and len(weights) != len(fns):
            raise ValueError(
                f"`model.reward_weights` has {len(weights)} values for {len(fns)} `model.reward_fns`"
            )
        if on_error not in ("raise", "zero"):
            raise ValueError(f"`model.on_reward_error` must be 'raise' or 'zero', got {on_error!r}")
        self.names = list(fns)
        self.fns = [import_reward(f) for f in fns]
        self.weights = list(weights) if weights is not None else [1.0] * len(fns)
        self.on_error = on_error

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[str], **columns: Any
    ) -> tuple[list[float], int]:
        """Total reward per completion and the number of samples whose reward failed (``on_error: zero``)."""
        total = [0.0] * len(completions)
        failed: set[int] = set()
        for name, fn, weight in zip(self.names, self.fns, self.weights, strict=True):
            for i, value in enumerate(self._one(name, fn, prompts, completions, columns)):
                if value is None:
                    failed.add(i)
                else:
                    total[i] += weight * value
        for i in failed:
            total[i] = 0.0
        return total, len(failed)

    def _one(self, name: str, fn: RewardFn, prompts, completions, columns) -> list[float | None]:
        try:
            values = list(fn(prompts=list(prompts), completions=list(completions), **columns))
        except Exception as err:  # noqa: BLE001 - re-raised with the function named, or counted
            if self.on_error == "raise":
                raise RewardError(f"reward function `{name}` raised {type(err).__name__}: {err}") from err
            return [None] * len(completions)
        if len(values) != len(completions):
            raise RewardError(
                f"reward function `{name}` returned {len(values)} values for {len(completions)} completions"
            )
        out: list[float | None] = []
        for i, v in enumerate(values):
            try:
                v = float(v)
            except (TypeError, ValueError):
                v = math.nan
            if math.isfinite(v):
                out.append(v)
            elif self.on_error == "raise":
                raise RewardError(
                    f"reward function `{name}` returned {values[i]!r} for sample {i} "
                    f"(prompt {str(prompts[i])[:80]!r}, completion {str(completions[i])[:80]!r}); "
                    "set `model.on_reward_error: zero` to score such samples 0 instead"
                )
            else:
                out.append(None)
        return out


def overlong_reward(completion_lengths: Sequence[int], max_len: int, cache_len: int) -> list[float]:
    """DAPO's soft overlong punishment per completion (see ``losses.overlong_penalty``)."""
    import torch

    from lightning_rl.losses import overlong_penalty

    return overlong_penalty(torch.as_tensor(list(completion_lengths)), max_len, cache_len).tolist()
