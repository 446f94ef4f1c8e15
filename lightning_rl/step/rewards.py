"""Reward functions.

A reward function is named in YAML by import path (``package.module:function``) and called as
``fn(prompts=[...], completions=[...], **columns)``, where ``columns`` holds every other dataset
column as a list aligned with the completions. It returns one float per completion. Standard-library
functions that run commands, evaluate code or delete files are refused by name (the rule tools follow too:
:mod:`lightning_rl.step.unsafe`). The weighted sum of several, with its errors, is
:mod:`lightning_rl.step.reward_scorer` (the functions of a batch run at once under one deadline:
:func:`run_all`, which also runs a turn's tool calls); the rewards stage of the online step (reward model,
overlong shaping, correctness) is :mod:`lightning_rl.step.reward_pipeline`.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_rl import moved_hint, split_import_path
from lightning_rl.step.unsafe import refuse_unsafe
from lightning_rl.step.worker_pool import WORKERS
from lightning_rl.step.workers import CallTimedOut, ProcessWorker, awaited

RewardFn = Callable[..., Sequence[float]]


# what the refusal of an unsafe reward function says after naming it (lightning_rl.step.unsafe)
UNSAFE_REWARD = ("a reward function is called with the data's columns as keyword arguments, so it would act "
                 "on what a column holds (`os.system(command=...)`) on the training machine, with the run's "
                 "permissions, and no such function returns one score per completion. Score model-written "
                 "code with `lightning_rl.sandbox:code_tests`, or call it from a reward function of your own "
                 "if you mean it")


def import_reward(path: str, key: str | None = None) -> RewardFn:
    """Import ``package.module:function`` (``package.module.function`` also accepted).

    Args:
        path: the import path, as written in YAML.
        key: the YAML key it was given under (``model.rewards.functions[0]``), named in errors.

    Raises:
        ValueError: naming the entry (and ``key``): bad format, module or attribute not found, not callable,
            or a standard-library function that runs commands, evaluates code or deletes files
            (:mod:`lightning_rl.step.unsafe`; refused always: no such function is a reward function).
    """
    where = f"reward function `{path}`" + (f" (`{key}`)" if key else "")
    module_name, attr = split_import_path(path)
    if not module_name or not attr:
        raise ValueError(f"{where} must look like `package.module:function`")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {where}: {err}{moved_hint(module_name)}") from err
    if not callable(fn):
        raise ValueError(f"{where} is not callable")
    refuse_unsafe(fn, where, UNSAFE_REWARD)
    return fn


# ------------------------------------------------------------------------------ functions of a batch at once
@dataclass(frozen=True)
class Outcome:
    """One call's value, or the error it raised, or that it timed out; and its seconds."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class Job:
    """``fn(*args, **kwargs)`` run ``inline``, in a ``thread`` (a coroutine function is awaited in its own
    event loop there) or in a ``process`` worker; ``post`` is applied to the value (in the worker)."""

    fn: Callable[..., Any]
    kwargs: dict[str, Any]
    where: Literal["inline", "thread", "process"] = "thread"
    post: Callable[[Any], Any] | None = None
    args: tuple[Any, ...] = ()  # positional arguments (a tool's positional-only parameters)


def _call(job: Job, timeout: float | None) -> Any:
    value = job.fn(*job.args, **job.kwargs)
    if inspect.isawaitable(value):
        try:
            value = asyncio.run(asyncio.wait_for(awaited(value), timeout))
        except asyncio.TimeoutError as err:  # cancelled: its thread ends
            raise CallTimedOut(f"timed out after {timeout} s") from err
    return job.post(value) if job.post is not None else value


def _outcome(job: Job, timeout: float | None, start: float) -> Outcome:
    try:
        return Outcome(value=_call(job, timeout), seconds=time.perf_counter() - start)
    except CallTimedOut:
        return Outcome(timed_out=True, seconds=float(timeout or 0.0))
    except Exception as err:  # noqa: BLE001 - the caller decides (re-raised with a name, or counted)
        return Outcome(error=err, seconds=time.perf_counter() - start)


def _in_thread(job: Job, timeout: float | None, start: float) -> tuple[threading.Thread, list[Outcome]]:
    """A started daemon thread that puts the job's outcome into the returned list."""
    box: list[Outcome] = []
    thread = threading.Thread(target=lambda: box.append(_outcome(job, timeout, start)), daemon=True,
                              name=f"call-{getattr(job.fn, '__name__', 'fn')}")
    thread.start()
    return thread, box


def run_all(jobs: Sequence[Job], timeout: float | None) -> list[Outcome]:
    """Every job's outcome, the jobs running at once, each given ``timeout`` seconds (``None``: no limit).

    Process jobs are sent first (forking before threads start), then threads start, then inline jobs run
    in the calling thread. A thread that times out keeps running in the background (a daemon thread: threads
    cannot be killed; a coroutine is cancelled); a process job that times out costs its worker (killed).
    """
    start = time.perf_counter()
    deadline = None if timeout is None else time.monotonic() + timeout
    sent = {i: _send(j) for i, j in enumerate(jobs) if j.where == "process"}
    threads = {i: _in_thread(j, timeout, start) for i, j in enumerate(jobs) if j.where == "thread"}
    out = []
    for i, job in enumerate(jobs):
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if job.where == "inline":
            out.append(_outcome(job, timeout, time.perf_counter()))
        elif job.where == "process":
            out.append(_process_outcome(sent[i], left, timeout, start))
        else:
            thread, box = threads[i]
            thread.join(left)
            out.append(box[0] if box else Outcome(timed_out=True, seconds=float(timeout or 0.0)))
    return out


def _send(job: Job) -> ProcessWorker | Exception:
    """The worker the job was sent to, or why it could not be (arguments that do not pickle)."""
    try:
        return WORKERS.start(job.fn, job.args, job.kwargs, job.post)
    except Exception as err:  # noqa: BLE001 - reported as the job's error
        return err


def _process_outcome(worker: ProcessWorker | Exception, left: float | None, timeout: float | None,
                     start: float) -> Outcome:
    if isinstance(worker, Exception):
        return Outcome(error=worker)
    try:
        return Outcome(value=WORKERS.finish(worker, left), seconds=time.perf_counter() - start)
    except CallTimedOut:
        return Outcome(timed_out=True, seconds=float(timeout or 0.0))
    except Exception as err:  # noqa: BLE001 - CallRaised, WorkerDied, a reply that cannot be read: reported
        return Outcome(error=err, seconds=time.perf_counter() - start)


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
        """Per sample: scored at least ``FULL`` (a group reward is called per run of one prompt, an ``async``
        one awaited here; a sample the function failed on is not correct)."""
        from lightning_rl.step.reward_calls import BatchCall, group_bounds

        call = BatchCall(self.fn)
        bounds = group_bounds(kwargs["prompts"], None)
        value = call(bounds, kwargs)
        result, _ = asyncio.run(value) if inspect.isawaitable(value) else value
        if call.group:
            result = [v for (status, group), (a, b) in zip(result, bounds, strict=True)
                      for v in (group if status == "ok" else [math.nan] * (b - a))]
        return [not isinstance(v, BaseException) and float(v) >= self.FULL for v in result]

    def __repr__(self) -> str:
        return f"{self.name} (correct at its full score, {self.FULL})"
