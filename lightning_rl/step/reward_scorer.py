"""The weighted sum of several reward functions (:class:`RewardScorer`), with errors that name the function
and the sample: a function that raises, returns NaN or times out stops the run (``on_error: raise``) or scores
0 and is counted (``on_error: zero``), up to ``max_error_frac`` of the samples.

The functions of a batch run at once (:func:`lightning_rl.step.rewards.run_all`): plain ones each in a
thread, ``async def`` ones each awaited in an event loop of their own thread, ``isolate``d ones each in a
worker process; each gets ``timeout`` seconds. A thread that times out cannot be stopped (it runs on in the
background); an isolated function's worker is killed. A group reward (:mod:`lightning_rl.step.reward_calls`)
is called once per group within that call; a group it fails on fails alone. A function may mark one sample
failed by returning an exception instance in its place (a judge's unparsable answer), counted like NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_rl.step.reward_calls import BatchCall, group_bounds, is_async, is_group_reward
from lightning_rl.step.rewards import Job, Outcome, RewardFn, import_reward, run_all
from lightning_rl.step.workers import describe, register


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
    metrics: dict[str, float] | None = None  # what the functions reported (a judge's cache hits, latency)


class RewardScorer:
    """Weighted sum of several reward functions, with errors that name the function and the sample.

    Args:
        fns: import paths ``package.module:function``, or reward function objects (``RewardFunction``, built
            from ``class_path`` + ``init_args``), named by their ``name`` or ``module.Class``.
        weights: one weight per function (default 1.0 each).
        on_error: ``raise`` stops the run on the first bad reward; ``zero`` scores it 0 and counts it.
        max_error_frac: under ``zero``, the largest fraction of failed samples that ``check_failures``
            lets through (1.0: any).
        timeout: seconds each function may take on a batch (``None``: no limit); a slower one fails on every
            sample of the batch.
        isolate: the functions (import paths, or ``True``: all) run in worker processes, killed on timeout.

    A single plain function without a timeout runs in the calling thread (nothing to overlap or stop).
    """

    def __init__(
        self,
        fns: Sequence[str | RewardFn],
        weights: Sequence[float] | None = None,
        on_error: str = "raise",
        max_error_frac: float = 1.0,
        timeout: float | None = None,
        isolate: bool | Sequence[str] = False,
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
        if timeout is not None and not timeout > 0:
            raise ValueError(f"`model.rewards.timeout` must be > 0 seconds or null, got {timeout}")
        self.names = function_names(fns)
        unknown = [] if isinstance(isolate, bool) else [f for f in isolate if f not in self.names]
        if unknown:
            raise ValueError(f"`model.rewards.isolate` names {', '.join(map(repr, unknown))}, which "
                             f"`model.rewards.functions` does not list ({', '.join(self.names)})")
        self.fns = [import_reward(f, f"model.rewards.functions[{i}]") if isinstance(f, str) else checked(f, i)
                    for i, f in enumerate(fns)]
        self.weights = list(weights) if weights is not None else [1.0] * len(fns)
        self.on_error, self.max_error_frac, self.timeout = on_error, max_error_frac, timeout
        self.where = [self.placement(n, fn, isolate) for n, fn in zip(self.names, self.fns, strict=True)]
        self.calls = [BatchCall(fn) for fn in self.fns]
        for call, where in zip(self.calls, self.where, strict=True):
            if where == "process":
                register(call)  # before workers are forked, so they inherit it

    def placement(self, name: str, fn: RewardFn, isolate: bool | Sequence[str]) -> str:
        """Where ``fn`` runs: ``process`` (isolated), ``inline`` (the only function, plain, no timeout) or
        ``thread``."""
        if isolate is True or (not isinstance(isolate, bool) and name in isolate):
            return "process"
        alone = len(self.names) == 1 and self.timeout is None
        return "inline" if alone and not is_async(fn) else "thread"

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

    def score(self, prompts: Sequence[Any], completions: Sequence[str], group_size: int | None = None,
              **columns: Any) -> RewardScores:
        """Total reward per completion; every failure (``on_error: zero``) named by function and sample.
        ``group_size``: the groups group rewards score (``None``: runs of one prompt)."""
        n = len(completions)
        total = [0.0] * n
        failed: set[int] = set()
        errors: list[FunctionErrors] = []
        grouped = any(is_group_reward(fn) for fn in self.fns)
        bounds = group_bounds(prompts, group_size) if grouped else [(0, n)]
        kwargs = {"prompts": list(prompts), "completions": list(completions), **columns}
        jobs = [Job(call, {"bounds": bounds, "kwargs": kwargs}, where)
                for call, where in zip(self.calls, self.where, strict=True)]
        outcomes = run_all(jobs, self.timeout)
        per_fn, metrics = [], {}
        for name, fn, outcome, weight in zip(self.names, self.fns, outcomes, self.weights, strict=True):
            if outcome.value is not None:
                outcome, reported = ungrouped(name, outcome, bounds, prompts, is_group_reward(fn))
                for key, value in reported.items():
                    metrics[key] = metrics.get(key, 0.0) + value
            values, bad = self._one(name, outcome, prompts, completions)
            per_fn.append(values)
            total = [t + weight * v for t, v in zip(total, values, strict=True)]
            if bad:
                i = max(bad)
                last = RewardFailure(i, str(prompts[i]), str(completions[i]), bad[i])
                errors.append(FunctionErrors(name, len(bad), n, last))
                failed.update(bad)
        totals = [0.0 if i in failed else t for i, t in enumerate(total)]
        seconds = tuple(o.seconds for o in outcomes)
        return RewardScores(totals, frozenset(failed), errors, seconds, tuple(per_fn), metrics)

    def failure(self, name: str, outcome: Outcome) -> str:
        """Why the call failed: ``raised Type: message`` or ``timed out after X s``, raising ``RewardError``
        under ``on_error: raise``."""
        if outcome.timed_out:
            isolated = self.where[self.names.index(name)] == "process"
            why = f"timed out after {self.timeout} s"
            hint = ("its worker process was killed" if isolated else "its thread cannot be stopped: list it "
                    "in `model.rewards.isolate` to run it in a worker process that is killed instead")
            if self.on_error == "raise":
                raise RewardError(f"reward function `{name}` {why} (`model.rewards.timeout`; {hint})")
            return why
        if self.on_error == "raise":
            raise RewardError(f"reward function `{name}` raised {describe(outcome.error)}") from outcome.error
        return f"raised {describe(outcome.error)}"

    def _one(
        self, name: str, outcome: Outcome, prompts: Sequence[Any], completions: Sequence[str]
    ) -> tuple[list[float], dict[int, str]]:
        """One function's values (0.0 where it failed) and, in ``zero`` mode, each failed sample's error."""
        n = len(completions)
        if outcome.timed_out or outcome.error is not None:
            why = self.failure(name, outcome)
            whole = f"{why} (one call for the batch: all {n} samples failed)"
            return [0.0] * n, dict.fromkeys(range(n), whole)
        values = outcome.value
        if len(values) != n:
            raise RewardError(f"reward function `{name}` returned {len(values)} values for {n} completions")
        out: list[float] = []
        bad: dict[int, str] = {}
        for i, v in enumerate(values):
            if isinstance(v, BaseException):  # this sample failed: the function said why
                if self.on_error == "raise":
                    raise RewardError(f"reward function `{name}` failed on sample {i} (prompt "
                                      f"{str(prompts[i])[:80]!r}): {describe(v)}; set "
                                      "`model.rewards.on_error: zero` to score such samples 0 instead") from v
                out.append(0.0)
                bad[i] = describe(v)
                continue
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


def function_names(fns: Sequence[str | RewardFn]) -> list[str]:
    """How errors and ``model.rewards.isolate`` name each function: its import path, or an object's ``name``
    (else ``module.Class``), with ``#i`` after a name that repeats."""
    names = [f if isinstance(f, str) else getattr(f, "name", "") or
             f"{type(f).__module__}.{type(f).__qualname__}" for f in fns]
    return [f"{n}#{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def checked(fn: Any, i: int) -> RewardFn:
    if not callable(fn):
        raise ValueError(f"`model.rewards.functions[{i}]` is a {type(fn).__name__}, not a reward function")
    return fn


def ungrouped(name: str, outcome: Outcome, bounds: list[tuple[int, int]], prompts: Sequence[Any],
              group: bool) -> tuple[Outcome, dict[str, float]]:
    """A ``BatchCall``'s outcome as the batch's values (a failed group's samples as exceptions) and the
    function's metrics; a group that returned the wrong number of scores raises ``RewardError``."""
    result, metrics = outcome.value
    if not group:
        return Outcome(value=result, seconds=outcome.seconds), metrics
    values: list[Any] = []
    for g, ((start, stop), (status, payload)) in enumerate(zip(bounds, result, strict=True)):
        where = f"group {g} (samples {start}..{stop - 1}, prompt {str(prompts[start])[:80]!r})"
        if status == "raised":
            values += [GroupFailed(f"raised {payload} on {where}: one call for the group")] * (stop - start)
        elif len(payload) != stop - start:
            raise RewardError(f"group reward function `{name}` returned {len(payload)} scores for the "
                              f"{stop - start} completions of {where} (`model.rewards.functions`)")
        else:
            values += payload
    return Outcome(value=values, seconds=outcome.seconds), metrics


class GroupFailed(RuntimeError):
    """A group reward's call for one group raised; each of the group's samples failed with it."""
