"""Reward functions.

A reward function is named in YAML by import path (``package.module:function``) and called as
``fn(prompts=[...], completions=[...], **columns)``, where ``columns`` holds every other dataset
column as a list aligned with the completions. It returns one float per completion.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_rl import moved_hint

RewardFn = Callable[..., Sequence[float]]
log = logging.getLogger(__name__)


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


class RewardError(RuntimeError):
    """A reward function raised, returned the wrong number of values, or returned NaN."""


@dataclass(frozen=True)
class RewardFailure:
    """One sample a reward function failed on (``on_error: zero``), with the original error text."""

    sample: int  # index in the scored batch
    prompt: str
    completion: str
    error: str  # e.g. "raised KeyError: 'answer' (...)" or "returned nan"

    def __str__(self) -> str:
        quoted = f"prompt {self.prompt[:80]!r}, completion {self.completion[:80]!r}"
        return f"sample {self.sample} ({quoted}): {self.error}"


@dataclass(frozen=True)
class FunctionErrors:
    """How often one reward function failed in a scored batch, and its last failure."""

    fn: str  # import path, as in ``model.rewards.functions``
    count: int  # samples it failed on
    total: int  # samples scored
    last: RewardFailure

    def __str__(self) -> str:
        return f"reward function `{self.fn}` failed on {self.count} of {self.total} samples: {self.last}"


@dataclass(frozen=True)
class RewardScores:
    """The rewards of one batch, and which samples failed and why (``on_error: zero``).

    ``totals[i]`` is the weighted sum over functions, 0.0 where any function failed on sample ``i``;
    ``failed`` holds those samples; ``errors`` one entry per function that failed, in ``fns`` order;
    ``seconds`` each function's wall time on the batch and ``values`` its values (0.0 where it failed), in
    ``fns`` order.
    """

    totals: list[float]
    failed: frozenset[int]
    errors: list[FunctionErrors]
    seconds: tuple[float, ...] = ()
    values: tuple[list[float], ...] = ()


class RewardScorer:
    """Weighted sum of several reward functions, with errors that name the function and the sample.

    Args:
        fns: import paths ``package.module:function``.
        weights: one weight per function (default 1.0 each).
        on_error: ``raise`` stops the run on the first bad reward; ``zero`` scores it 0 and counts it.
        max_error_frac: under ``zero``, the largest fraction of failed samples that ``check_failures``
            lets through (1.0: any).
    """

    def __init__(
        self,
        fns: Sequence[str],
        weights: Sequence[float] | None = None,
        on_error: str = "raise",
        max_error_frac: float = 1.0,
    ) -> None:
        if not fns:
            raise ValueError("`model.rewards.functions` is empty: name at least one reward function")
        if weights is not None and len(weights) != len(fns):
            raise ValueError(
                f"`model.rewards.weights` has {len(weights)} values for {len(fns)} `model.rewards.functions`"
            )
        if on_error not in ("raise", "zero"):
            raise ValueError(f"`model.rewards.on_error` must be 'raise' or 'zero', got {on_error!r}")
        if not 0.0 <= max_error_frac <= 1.0:
            raise ValueError(f"`model.rewards.max_error_frac` must be in [0, 1], got {max_error_frac}")
        self.names = list(fns)
        self.fns = [import_reward(f) for f in fns]
        self.weights = list(weights) if weights is not None else [1.0] * len(fns)
        self.on_error, self.max_error_frac = on_error, max_error_frac

    @property
    def limits_failures(self) -> bool:
        """Whether ``check_failures`` can raise: failures are counted (``zero``) and not all let through."""
        return self.on_error == "zero" and self.max_error_frac < 1.0

    def check_failures(self, scores: RewardScores, failed: float, total: float, where: str = "") -> None:
        """Raise ``RewardError`` when ``failed / total`` exceeds ``max_error_frac``.

        Args:
            scores: the local batch's scores, whose errors (function, sample, original error) are quoted.
            failed, total: failed and scored samples, possibly summed over ranks.
            where: names the process whose errors are quoted (e.g. ``rank 1``), if there are several.
        """
        if not self.limits_failures or not total or failed / total <= self.max_error_frac:
            return
        here = "; ".join(str(e) for e in scores.errors) or "no reward failed here"
        raise RewardError(
            f"rewards failed on {failed:.0f} of {total:.0f} samples, more than "
            f"`model.rewards.max_error_frac`={self.max_error_frac}. {where + ': ' if where else ''}{here}. "
            "Fix the reward function or raise the limit (`model.rewards.on_error: raise` stops at the "
            "first failure, with its traceback)"
        )

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[str], **columns: Any
    ) -> tuple[list[float], int]:
        """Total reward per completion and the number of samples whose reward failed (``on_error: zero``)."""
        scores = self.score(prompts, completions, **columns)
        return scores.totals, len(scores.failed)

    def score(self, prompts: Sequence[Any], completions: Sequence[str], **columns: Any) -> RewardScores:
        """Total reward per completion; every failure (``on_error: zero``) named by function and sample."""
        n = len(completions)
        total = [0.0] * n
        failed: set[int] = set()
        errors: list[FunctionErrors] = []
        seconds, per_fn = [], []
        for name, fn, weight in zip(self.names, self.fns, self.weights, strict=True):
            start = time.perf_counter()
            values, bad = self._one(name, fn, prompts, completions, columns)
            seconds.append(time.perf_counter() - start)
            per_fn.append(values)
            total = [t + weight * v for t, v in zip(total, values, strict=True)]
            if bad:
                i = max(bad)
                last = RewardFailure(i, str(prompts[i]), str(completions[i]), bad[i])
                errors.append(FunctionErrors(name, len(bad), n, last))
                failed.update(bad)
        totals = [0.0 if i in failed else t for i, t in enumerate(total)]
        return RewardScores(totals, frozenset(failed), errors, tuple(seconds), tuple(per_fn))

    def _one(
        self, name: str, fn: RewardFn, prompts: Sequence[Any], completions: Sequence[str], columns: dict
    ) -> tuple[list[float], dict[int, str]]:
        """One function's values (0.0 where it failed) and, in ``zero`` mode, each failed sample's error."""
        n = len(completions)
        try:
            values = list(fn(prompts=list(prompts), completions=list(completions), **columns))
        except Exception as err:  # noqa: BLE001 - re-raised with the function named, or counted
            if self.on_error == "raise":
                raise RewardError(f"reward function `{name}` raised {type(err).__name__}: {err}") from err
            why = f"raised {type(err).__name__}: {err} (one call for the batch: all {n} samples failed)"
            return [0.0] * n, dict.fromkeys(range(n), why)
        if len(values) != n:
            raise RewardError(f"reward function `{name}` returned {len(values)} values for {n} completions")
        out: list[float] = []
        bad: dict[int, str] = {}
        for i, v in enumerate(values):
            try:
                v = float(v)
            except (TypeError, ValueError):
                v = math.nan
            if math.isfinite(v):
                out.append(v)
                continue
            if self.on_error == "raise":
                raise RewardError(
                    f"reward function `{name}` returned {values[i]!r} for sample {i} "
                    f"(prompt {str(prompts[i])[:80]!r}, completion {str(completions[i])[:80]!r}); "
                    "set `model.rewards.on_error: zero` to score such samples 0 instead"
                )
            out.append(0.0)
            bad[i] = f"returned {values[i]!r}"
        return out, bad


def overlong_shaping(buffer: int | str | None, factor: float,
                     max_new_tokens: int) -> tuple[int, int, float] | None:
    """``(max_len, buffer, factor)`` of DAPO's overlong shaping for ``RewardPipeline``, or ``None`` when off
    (``buffer`` None or 0); ``auto``: a fifth of ``max_new_tokens``, at least 1."""
    buffer = max(1, max_new_tokens // 5) if buffer == "auto" else buffer
    if buffer is not None and not 0 <= buffer <= max_new_tokens:
        raise ValueError(f"`model.rewards.overlong_buffer` must be 'auto' or in "
                         f"[0, max_new_tokens={max_new_tokens}], got {buffer}")
    return (max_new_tokens, buffer, factor) if buffer else None


def overlong_reward(completion_lengths: Sequence[int], max_len: int, cache_len: int) -> list[float]:
    """DAPO's soft overlong punishment per completion (see ``losses.overlong_penalty``)."""
    import torch

    from lightning_rl.maths.advantages import overlong_penalty

    return overlong_penalty(torch.as_tensor(list(completion_lengths)), max_len, cache_len).tolist()


@dataclass
class RewardResult:
    """The rewards of one batch of samples.

    Attributes:
        rewards: ``[N]`` float: the functions' weighted total + the weighted reward-model score + shaping.
        correct: ``[N]`` bool: verifiable correctness (``correctness_fn``), what filters and accuracy read.
        scores: the reward functions' scores, failures and errors (``RewardScores``).
        stats: ``rollout/reward_errors``, ``rollout/overlong_penalty_mean``, ``perf/reward_time``.
    """

    rewards: Any
    correct: Any
    scores: RewardScores
    stats: dict[str, float]


class RewardPipeline:
    """The rewards stage: reward functions, a reward model, overlong shaping, correctness, and the check
    that stops a run whose rewards fail too often (decided on counts summed over all ranks).

    Args:
        scorer: the weighted reward functions, or ``None`` (a reward model alone).
        correctness_fn: ``(prompts=, completions=, **columns) -> list`` of correctness per sample.
        reward_model: a ``RewardModelScorer`` (``score(texts, completions, add_special_tokens=)``) or None.
        reward_model_weight: weight of its score.
        render: ``prompts -> (rendered texts, add_special_tokens)`` for the reward model's re-tokenising.
        overlong: ``(max_len, buffer, factor)`` of DAPO's soft overlong punishment, or None.

    Each part's time (every reward function, the reward model, ``correctness_fn``) is summed in ``timings``
    until :meth:`warn_if_slow`, which names the slowest when rewards take most of a training step.
    """

    def __init__(self, scorer: RewardScorer | None, correctness_fn: RewardFn, *, reward_model: Any = None,
                 reward_model_weight: float = 1.0, render: Any = None,
                 overlong: tuple[int, int, float] | None = None) -> None:
        self.scorer, self.correctness_fn = scorer, correctness_fn
        self.reward_model, self.reward_model_weight = reward_model, reward_model_weight
        self.render, self.overlong = render, overlong
        self.timings: dict[str, list[float]] = {}  # part -> [seconds, calls] since the last `warn_if_slow`
        self.warned_slow = False
        fn = correctness_fn
        self.correctness_part = f"correctness function `{getattr(fn, '__module__', '?')}:" \
                                f"{getattr(fn, '__qualname__', type(fn).__name__)}`"

    def timed(self, part: str, seconds: float) -> None:
        """Add one call of ``part`` (e.g. "reward function `pkg.mod:fn`") that took ``seconds``."""
        total = self.timings.setdefault(part, [0.0, 0])
        total[0] += seconds
        total[1] += 1

    def warn_if_slow(self, reward_time: float, step_time: float) -> None:
        """Warn (rank 0, once per run) when the rewards took more than half of a training step, naming the
        slowest part and its seconds per call; the timings then start again for the next step."""
        timings, self.timings = self.timings, {}
        if self.warned_slow or not timings or not reward_time > 0.5 * step_time:
            return
        from lightning.pytorch.utilities import rank_zero_warn

        part, (seconds, calls) = max(timings.items(), key=lambda item: item[1][0])
        self.warned_slow = True
        calls = int(calls)
        rank_zero_warn(
            f"rewards took {reward_time:.2f}s of a {step_time:.2f}s training step (`perf/reward_time` of "
            f"`perf/step_time`); the slowest is the {part} at {seconds / calls:.2f}s per call ({calls} "
            f"call{'s' * (calls != 1)}): score the batch at once, cache or parallelise it, or it bounds the "
            "run's speed"
        )

    def score(self, prompts: Sequence[Any], texts: list[str], lengths: list[int],
              columns: dict[str, list]) -> tuple[Any, RewardScores]:
        """``[N]`` rewards (functions + reward model, unshaped) and the functions' scores."""
        import torch

        if self.scorer is not None:
            scores = self.scorer.score(prompts, texts, completion_lengths=lengths, **columns)
            for name, seconds in zip(self.scorer.names, scores.seconds, strict=False):
                self.timed(f"reward function `{name}`", seconds)
        else:
            scores = RewardScores([0.0] * len(texts), frozenset(), [])
        rewards = torch.tensor(scores.totals, dtype=torch.float32)
        if self.reward_model is not None and texts:
            start = time.perf_counter()
            rendered, special = self.render(prompts)
            model_scores = self.reward_model.score(rendered, texts, add_special_tokens=special)
            self.timed("reward model", time.perf_counter() - start)
            rewards = rewards + self.reward_model_weight * model_scores.cpu().float()
        return rewards, scores

    def __call__(self, prompts: Sequence[Any], texts: list[str], lengths: list[int], columns: dict[str, list],
                 *, collectives: Any = None, decide: bool = True) -> RewardResult:
        """Score one batch; warnings on rank 0. ``decide``: whether too many rewards failed, on counts summed
        over ranks (every rank once per step, on its first batch; refill rounds are rank-dependent in
        number, so they never decide, their failures are counted and warned about)."""
        import torch

        start = time.perf_counter()
        rewards, scores = self.score(prompts, texts, lengths, columns)
        if collectives is not None and decide:
            self.check_failures(scores, collectives)
        if collectives is None or collectives.rank == 0:
            for errors in scores.errors:
                log.warning(str(errors))
        penalty = torch.zeros(len(texts))
        if self.overlong is not None:
            max_len, buffer, factor = self.overlong
            penalty = factor * torch.tensor(overlong_reward(lengths, max_len, buffer), dtype=torch.float32)
            rewards = rewards + penalty
        correctness_start = time.perf_counter()
        if isinstance(self.correctness_fn, FullScore) and self.scorer is not None \
                and self.correctness_fn.name in self.scorer.names:  # the scores just computed, not a 2nd call
            values = scores.values[self.scorer.names.index(self.correctness_fn.name)]
            correct = torch.tensor([v >= FullScore.FULL for v in values], dtype=torch.bool)
        else:
            correct = torch.tensor([bool(c) for c in self.correctness_fn(prompts=prompts, completions=texts,
                                                                       **columns)], dtype=torch.bool)
        self.timed(self.correctness_part, time.perf_counter() - correctness_start)
        stats = {"rollout/reward_errors": float(len(scores.failed)),
                 "rollout/overlong_penalty_mean": float(penalty.mean()) if len(penalty) else 0.0,
                 "perf/reward_time": time.perf_counter() - start}
        return RewardResult(rewards, correct, scores, stats)

    def check_failures(self, scores: RewardScores, collectives: Any) -> None:
        """Stop when failures summed over all ranks exceed ``model.rewards.max_error_frac`` (every rank
        makes the all-reduce and reaches the same verdict, so they raise together)."""
        import torch

        if self.scorer is None or not self.scorer.limits_failures:
            return
        counts = torch.tensor([len(scores.failed), len(scores.totals)], dtype=torch.float32)
        failed, total = collectives.sum(counts).tolist()
        where = f"rank {collectives.rank}" if collectives.world_size > 1 else ""
        self.scorer.check_failures(scores, failed, total, where)
