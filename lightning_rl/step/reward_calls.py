"""How one reward function is called on one batch: once for the batch, or once per group (a *group reward*).

A group reward scores the G completions of one prompt in one call (a ranking judge in the style of ART's
RULER, :class:`lightning_rl.step.judge.LLMJudge` with ``group: true``): it is called as any reward function,
``fn(prompts=[...], completions=[...], **columns)``, but with one group's G rows, and returns G scores.
Declare it with :func:`group_reward` (a function) or ``group_reward = True`` (a :class:`RewardFunction`
object). The groups are the sampler's (G consecutive samples of one prompt, never split across ranks: each
rank samples and scores whole groups); where no group size is given (validation, predictions), the runs of
consecutive samples of one prompt.

:class:`BatchCall` is what :class:`lightning_rl.step.reward_scorer.RewardScorer` runs, in a thread, inline or
in an isolated worker: the function over the batch or over each group, and the metrics the function reports
(:meth:`RewardFunction.pop_metrics`, read where it ran, so an isolated function's come back too). A group's
error fails that group only; the batch's timeout (``model.rewards.timeout``) covers every group, so a group
reward written ``async def`` scores the groups concurrently, a plain one one after the other.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from lightning_rl.step.workers import describe


def group_reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as a group reward: called once per group with its G rows, returns G scores."""
    fn.group_reward = True  # type: ignore[attr-defined]
    return fn


def is_group_reward(fn: Any) -> bool:
    return getattr(fn, "group_reward", False) is True


class RewardFunction:
    """A reward function configured from YAML (an entry of ``model.rewards.functions`` given as
    ``class_path`` + ``init_args``): subclass it and implement ``__call__`` (plain or ``async def``).

    Attributes:
        group_reward: called once per group (G rows, G scores) instead of once per batch.
        name: how errors, ``model.rewards.isolate`` and metrics name it.
    """

    group_reward: bool = False
    name: str = ""

    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **columns: Any) -> Any:
        raise NotImplementedError

    def pop_metrics(self) -> dict[str, float]:
        """Step statistics gathered since the last call (``rollout/...``, ``perf/...``; summed over the
        step's rounds, except names ending in ``_mean``), then reset."""
        return {}


def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine (an ``async def`` function or ``__call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def group_bounds(prompts: Sequence[Any], group_size: int | None) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of each group: ``group_size`` consecutive rows, or (``None``) each run of
    consecutive rows with one prompt."""
    n = len(prompts)
    if group_size is not None:
        if group_size < 1 or n % group_size:
            raise ValueError(f"{n} samples do not split into groups of {group_size}")
        return [(i, i + group_size) for i in range(0, n, group_size)]
    starts = [i for i in range(n) if i == 0 or prompts[i] != prompts[i - 1]]
    return list(zip(starts, starts[1:] + [n], strict=True))


def _rows(kwargs: dict[str, Any], start: int, stop: int, n: int) -> dict[str, Any]:
    """The keyword arguments of one group: every per-sample list cut to its rows."""
    return {k: v[start:stop] if isinstance(v, list | tuple) and len(v) == n else v for k, v in kwargs.items()}


class BatchCall:
    """One reward function's call on a batch (see the module docstring), picklable by reference to a worker
    (register it before workers fork).

    Returns ``(result, metrics)``: for a batch function ``result`` is its value as a list; for a group
    reward one entry per group, ``("ok", values)`` or ``("raised", "Type: message")``.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.group = fn, is_group_reward(fn)
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, bounds: list[tuple[int, int]], kwargs: dict[str, Any]) -> Any:
        if not self.group:
            value = self.fn(**kwargs)
            if inspect.isawaitable(value):
                return self._batch_async(value)
            return list(value), self.metrics()
        n = len(kwargs["completions"])
        if is_async(self.fn):
            return self._groups_async(bounds, kwargs, n)
        out = []
        for start, stop in bounds:
            try:
                out.append(("ok", list(self.fn(**_rows(kwargs, start, stop, n)))))
            except Exception as err:  # noqa: BLE001 - this group failed; the scorer names it
                out.append(("raised", describe(err)))
        return out, self.metrics()

    async def _batch_async(self, value: Any) -> tuple[list[Any], dict[str, float]]:
        return list(await value), self.metrics()

    async def _groups_async(self, bounds: list[tuple[int, int]], kwargs: dict[str, Any],
                            n: int) -> tuple[list[tuple], dict[str, float]]:
        async def one(start: int, stop: int) -> tuple:
            try:
                return ("ok", list(await self.fn(**_rows(kwargs, start, stop, n))))
            except Exception as err:  # noqa: BLE001 - this group failed; the scorer names it
                return ("raised", describe(err))

        return list(await asyncio.gather(*(one(a, b) for a, b in bounds))), self.metrics()

    def metrics(self) -> dict[str, float]:
        return self.fn.pop_metrics() if isinstance(self.fn, RewardFunction) else {}
