"""An LLM as the reward: :class:`LLMJudge` asks an OpenAI-compatible chat endpoint (vLLM's server, any hosted
API) to grade completions against a rubric, and reads a score out of its answer.

Name it in YAML as a reward function object::

    model:
      init_args:
        rewards:
          on_error: zero                 # an unparsable or missing answer scores 0 and is counted
          functions:
            - class_path: lightning_rl.step.judge.LLMJudge
              init_args: {base_url: "http://127.0.0.1:8000/v1", model: judge, rubric: "..."}

Each sample is one request (``group: false``), or each group of G completions of one prompt is one request
that ranks them together (``group: true``, in the style of ART's RULER). Requests run concurrently (at most
``concurrency`` at a time per event loop), each within ``timeout`` seconds, retried ``retries`` times when the
failure may pass (:mod:`lightning_rl.step.judge_client`); answers are cached by (prompt, completion) (by
prompt and the group's completions in group mode), duplicates within a batch are asked once. The score
parser never raises on free text: an answer without a score in ``[0, max_score]`` is a failed sample, which
``model.rewards.on_error`` stops on or scores 0 and counts in ``rollout/reward_errors``. Scores are divided
by ``max_score`` (1.0: full marks). Logged per step: ``rollout/<name>_requests``,
``rollout/<name>_cache_hits``, ``rollout/<name>_retries`` and ``perf/<name>_latency_mean`` (seconds per
answered request).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import string
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from lightning_rl.step.judge_client import JudgeError, Reply, chat
from lightning_rl.step.reward_calls import RewardFunction

RUBRIC = ("Grade the response to the task below from 0 to {max_score}, {max_score} being a fully correct "
          "response.\n\nTask: {prompt}\n\nResponse: {completion}\n\nAnswer with one line: Score: <number>")
GROUP_RUBRIC = ("Grade each of the {count} responses to the task below from 0 to {max_score}, {max_score} "
                "being a fully correct response; compare them with each other.\n\nTask: {prompt}\n\n"
                "{completions}\n\nAnswer with one line per response: <response number>: <score>")
_SCORE = re.compile(r"score\s*(?:is|[:=])?\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"\s*\**\s*(-?\d+(?:\.\d+)?)\s*\**\s*\.?\s*")
_ITEM = re.compile(r"^\W*(?:response|completion|answer)?\s*#?\s*(\d+)\s*[:.)=-]\s*(?:score\s*[:=]?\s*)?"
                   r"\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE | re.MULTILINE)


def parse_score(text: str, max_score: float) -> float:
    """The last ``Score: x`` of ``text`` (or ``text`` that is just a number), over ``max_score``; raises
    ``JudgeError`` quoting the answer when there is none or it is out of range."""
    found = _SCORE.findall(text)
    whole = _NUMBER.fullmatch(text)
    if not found and whole is None:
        raise JudgeError(f"no score in the judge's answer {text[:120]!r}")
    return in_range(float(found[-1] if found else whole.group(1)), max_score, text)


def parse_group_scores(text: str, count: int, max_score: float) -> list[float]:
    """One score per response from ``<number>: <score>`` lines (the last line for a number wins)."""
    found = {int(i): v for i, v in _ITEM.findall(text)}
    missing = [i for i in range(1, count + 1) if i not in found]
    if missing:
        raise JudgeError(f"the judge's answer scores no response {missing} of {count}: {text[:160]!r}")
    return [in_range(float(found[i]), max_score, text) for i in range(1, count + 1)]


def in_range(value: float, max_score: float, text: str) -> float:
    if not 0.0 <= value <= max_score:
        raise JudgeError(f"the judge's score {value:g} is outside [0, {max_score:g}]: {text[:120]!r}")
    return value / max_score


def as_text(prompt: Any) -> str:
    """A prompt as the rubric shows it: a string, or a chat's messages as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)
    return json.dumps(prompt, default=str)


class LLMJudge(RewardFunction):
    """A reward function that asks an LLM judge (see the module docstring).

    Args:
        base_url: the OpenAI-compatible API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the model name the endpoint serves.
        rubric: the request's text, a ``str.format`` template of ``{prompt}``, ``{completion}`` (``group:
            false``) or ``{completions}`` and ``{count}`` (``group: true``: numbered responses),
            ``{max_score}`` and any data column (``{answer}``). ``None``: a generic rubric.
        group: one request per group of G completions of one prompt, answered ``<number>: <score>``.
        max_score: the top of the rubric's scale; scores are divided by it.
        concurrency: requests in flight at once (per event loop).
        retries: retries of a request that failed in a way that may pass.
        timeout: seconds per request; ``model.rewards.timeout`` bounds the whole batch.
        backoff: seconds before the first retry (doubling after each).
        max_tokens, temperature: the request's sampling.
        api_key_env: an environment variable holding the API key, sent as a bearer token (``None``: none).
        cache_size: answers kept (least recently used dropped; 0: no cache).
        name: the name in errors, ``model.rewards.isolate`` and metrics.
    """

    def __init__(self, base_url: str, model: str, rubric: str | None = None, group: bool = False,
                 max_score: float = 10.0, concurrency: int = 8, retries: int = 2, timeout: float = 30.0,
                 backoff: float = 0.5, max_tokens: int = 64, temperature: float = 0.0,
                 api_key_env: str | None = None, cache_size: int = 100_000, name: str = "judge") -> None:
        checks = {"max_score": max_score > 0, "concurrency": concurrency >= 1, "retries": retries >= 0,
                  "timeout": timeout > 0, "backoff": backoff >= 0, "cache_size": cache_size >= 0,
                  "max_tokens": max_tokens >= 1, "name": bool(re.fullmatch(r"[A-Za-z0-9_]+", name))}
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"`init_args.{key}` of the LLM judge in `model.rewards.functions` is "
                                 f"invalid: {locals()[key]!r}")
        self.base_url, self.model, self.group_reward, self.name = base_url, model, group, name
        self.rubric = rubric if rubric is not None else (GROUP_RUBRIC if group else RUBRIC)
        self.fields = {f for _, f, _, _ in string.Formatter().parse(self.rubric) if f}
        needed = "completions" if group else "completion"
        if needed not in self.fields:
            raise ValueError(f"`init_args.rubric` of the LLM judge must contain `{{{needed}}}` "
                             f"(group: {str(group).lower()}); it names {sorted(self.fields)}")
        self.max_score, self.concurrency, self.retries = max_score, concurrency, retries
        self.timeout = timeout
        self.backoff, self.max_tokens, self.temperature = backoff, max_tokens, temperature
        self.api_key_env, self.cache_size = api_key_env, cache_size
        self._setup()

    def _setup(self) -> None:
        # the data columns the rubric names are required keywords: input checks name a missing one early
        P = inspect.Parameter  # noqa: N806
        columns = sorted(self.fields - {"prompt", "completion", "completions", "count", "max_score"})
        self.__signature__ = inspect.Signature(
            [P("prompts", P.POSITIONAL_OR_KEYWORD), P("completions", P.POSITIONAL_OR_KEYWORD),
             *(P(c, P.KEYWORD_ONLY) for c in columns), P("columns", P.VAR_KEYWORD)])
        self._lock = threading.Lock()
        self._cache: OrderedDict[Any, Any] = OrderedDict()
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._counts = {"requests": 0, "cache_hits": 0, "retries": 0, "answered": 0, "seconds": 0.0}

    def __getstate__(self) -> dict[str, Any]:  # the cache, counters and lock stay in this process
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[str],
                       **columns: Any) -> list[float | JudgeError]:
        """Each completion's score over ``max_score``, or the ``JudgeError`` that kept it from one."""
        missing = self.fields - {"prompt", "completion", "completions", "count", "max_score"} - set(columns)
        if missing:
            raise ValueError(f"`init_args.rubric` of the LLM judge names {sorted(missing)}, which are not "
                             f"data columns (columns: {sorted(columns)})")
        if self.group_reward:
            return await self.group_scores(prompts, completions, columns)
        keys = [(as_text(p), c) for p, c in zip(prompts, completions, strict=True)]
        got = {k: v for k in set(keys) if (v := self.cached(k)) is not None}
        asked = {k: i for i, k in enumerate(keys) if k not in got}  # each distinct one once
        self.count(cache_hits=len(keys) - len(asked))
        answers = await asyncio.gather(*(self.ask(self.render(i, keys[i], columns), k, self.one)
                                         for k, i in asked.items()))
        got.update(zip(asked, answers, strict=True))
        return [got[k] for k in keys]

    async def group_scores(self, prompts: Sequence[Any], completions: Sequence[str],
                           columns: dict[str, Any]) -> list[float | JudgeError]:
        key = (as_text(prompts[0]), tuple(completions))
        hit = self.cached(key)
        if hit is not None:
            self.count(cache_hits=len(completions))
            return list(hit)
        numbered = "\n\n".join(f"Response {i + 1}: {c}" for i, c in enumerate(completions))
        text = self.rubric.format(prompt=key[0], completions=numbered, count=len(completions),
                                  max_score=f"{self.max_score:g}", **{k: columns[k][0] for k in self.fields
                                                                      if k in columns})
        answer = await self.ask(text, key, lambda reply: parse_group_scores(reply, len(completions),
                                                                            self.max_score))
        return [answer] * len(completions) if isinstance(answer, JudgeError) else list(answer)

    def one(self, reply: str) -> float:
        return parse_score(reply, self.max_score)

    def render(self, i: int, key: tuple[str, str], columns: dict[str, Any]) -> str:
        return self.rubric.format(prompt=key[0], completion=key[1], max_score=f"{self.max_score:g}",
                                  **{k: columns[k][i] for k in self.fields if k in columns})

    async def ask(self, text: str, key: Any, parse: Any) -> Any:
        """The parsed answer to ``text`` (cached under ``key``), or the ``JudgeError`` that kept it."""
        loop = asyncio.get_running_loop()
        with self._lock:
            limit = self._limits.setdefault(loop, asyncio.Semaphore(self.concurrency))
        payload = {"model": self.model, "messages": [{"role": "user", "content": text}],
                   "max_tokens": self.max_tokens, "temperature": self.temperature}
        key_env = os.environ.get(self.api_key_env or "", "")
        headers = {"Authorization": f"Bearer {key_env}"} if key_env else {}
        async with limit:
            try:
                reply: Reply = await chat(self.base_url, payload, headers, timeout=self.timeout,
                                          retries=self.retries, backoff=self.backoff)
            except JudgeError as err:
                self.count(requests=err.attempts, retries=max(err.attempts - 1, 0))
                return err
        self.count(requests=reply.attempts, retries=reply.attempts - 1, answered=1, seconds=reply.seconds)
        try:
            value = parse(reply.text)
        except JudgeError as err:
            return err
        self.store(key, value)
        return value

    def cached(self, key: Any) -> Any:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        return None

    def store(self, key: Any, value: Any) -> None:
        with self._lock:
            if self.cache_size:
                self._cache[key] = value
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)

    def count(self, **amounts: float) -> None:
        with self._lock:
            for k, v in amounts.items():
                self._counts[k] += v

    def pop_metrics(self) -> dict[str, float]:
        with self._lock:
            counts = self._counts
            self._counts = dict.fromkeys(counts, 0)
        out = {f"rollout/{self.name}_{k}": float(counts[k]) for k in ("requests", "cache_hits", "retries")}
        if counts["answered"]:
            out[f"perf/{self.name}_latency_mean"] = counts["seconds"] / counts["answered"]
        return out
