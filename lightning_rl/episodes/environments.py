"""Multi-turn episodes: the model acts, tools and an environment answer, and the whole episode trains.

An episode starts from a prompt row. Each model turn is sampled by the rollout engine until its EOS; a turn
that calls tools (``lightning_rl.episodes.tools``) gets their results appended as a tool turn, a turn without
a call
goes to the environment's ``step`` (or ends the episode when there is no environment). The episode ends when
the environment says ``done``, after ``max_turns`` model turns, or when its tokens would pass
``max_episode_tokens`` (then it is ``truncated``).

This module holds the environment seam (:class:`Environment`, :class:`StepResult`), the checks of its
contract (:func:`checked_reset`, :func:`checked_step`, :func:`checked_final_reward`, raising
:class:`ContractError`) and the episode records (:class:`Episode`, :class:`Turn`, :class:`EpisodeBatch`);
:mod:`lightning_rl.episodes.runner` runs the episodes, token in, token out.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lightning_rl.models.generation import Generation
from lightning_rl.text.pairs import pad_rows

Observation = str | list[dict[str, str]] | None


@dataclass
class StepResult:
    """What the environment answers to one model turn.

    Attributes:
        observation: text (a user turn under a chat template, raw text otherwise) or messages appended as
            the environment's turn; ``None`` appends nothing.
        reward: the step's reward, summed into the episode's return.
        done: the episode ends here.
        info: free-form; ``info["correct"]`` (bool) at the last step decides the episode's correctness.
    """

    observation: Observation = None
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """The environment seam: subclass it and name it in YAML (``model.init_args.episodes.environment``).

    The configured object is a template: each episode gets its own :meth:`spawn` (a deep copy), then
    :meth:`reset` with the prompt row, :meth:`step` after every model turn that made no tool call, and
    :meth:`final_reward` once at the end. Plain Python. Every return is checked against these signatures
    (a gym-style tuple, a number as observation, a string or NaN reward are errors naming the class, the
    method and the episode); such a violation and an exception are both the environment's failure, handled
    by ``model.episodes.on_error`` (and ``max_error_frac``).
    """

    def spawn(self) -> Environment:
        """A fresh environment for one episode (override when deep copies are wrong for a resource)."""
        return copy.deepcopy(self)

    def reset(self, row: dict[str, Any]) -> Observation:
        """Start an episode from a data row; return its first prompt (text or messages), or ``None`` for
        the row's own ``prompt``."""
        return None

    def step(self, turn: str) -> StepResult:
        """Answer the model's turn (its text, EOS removed)."""
        return StepResult(done=True)

    def final_reward(self, episode: Episode) -> float:
        """A reward for the whole episode, added to the step rewards."""
        return 0.0


class EpisodeError(RuntimeError):
    """An environment raised or broke its contract (``model.episodes.on_error: raise``), or failed in more
    than ``model.episodes.max_error_frac`` of a step's episodes (``on_error: zero``)."""


class ContractError(TypeError):
    """An environment's method returned what its signature does not allow: ``got`` says what it returned,
    ``expected`` what it should have (the runner adds the class, the method and the episode)."""

    def __init__(self, got: str, expected: str) -> None:
        super().__init__(f"returned {got}: expected {expected}")
        self.got, self.expected = got, expected


RESET_EXPECTED = ("a prompt: a non-empty str, a non-empty list of messages ({'role': str, 'content': str}), "
                  "or None for the row's own prompt")
STEP_EXPECTED = ("a StepResult(observation: str | list of messages | None, reward: finite float, done: bool, "
                 "info: dict)")
FINAL_REWARD_EXPECTED = "a finite float"


def short_repr(value: Any, width: int = 60) -> str:
    """``value``'s repr, cut to ``width`` characters."""
    text = repr(value)
    return text if len(text) <= width else text[:width] + "..."


def shown(value: Any) -> str:
    """``value``'s short repr and its type: ``'high' (str)``."""
    return f"{short_repr(value)} ({type(value).__name__})"


def is_messages(value: Any) -> bool:
    """Whether ``value`` is a list of ``{"role": str, "content": str}`` messages."""
    return isinstance(value, list) and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value)


def is_observation(value: Any) -> bool:
    """Whether ``value`` is an :data:`Observation`: ``None``, text or messages."""
    return value is None or isinstance(value, str) or is_messages(value)


def as_number(value: Any) -> float | None:
    """``value`` as a float (ints, floats, numpy and 0-d torch scalars), or ``None`` for anything else
    (strings, ``None``, containers)."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def as_flag(value: Any) -> bool | None:
    """``value`` as a bool (``True``/``False``, 0/1, numpy and 0-d torch booleans), or ``None``."""
    try:
        return bool(value) if value in (True, False) else None
    except (TypeError, ValueError, RuntimeError):  # arrays and tensors of several values
        return None


def checked_reset(value: Any) -> Observation:
    """What ``reset`` returned, if it is a prompt (or ``None``); else :class:`ContractError`."""
    if value is None or ((isinstance(value, str) or is_messages(value)) and value):
        return value
    raise ContractError(shown(value), RESET_EXPECTED)


def checked_step(value: Any) -> StepResult:
    """What ``step`` returned, with its reward as a finite float and ``done`` as a bool, if it is a
    :class:`StepResult` of the right field types; else :class:`ContractError` naming the first bad field."""
    if not isinstance(value, StepResult):
        raise ContractError(f"{type(value).__name__} {short_repr(value)}", STEP_EXPECTED)
    reward, done = as_number(value.reward), as_flag(value.done)
    fields_ok = {"observation": is_observation(value.observation),
                 "reward": reward is not None and math.isfinite(reward),
                 "done": done is not None, "info": isinstance(value.info, Mapping)}
    for name, ok in fields_ok.items():
        if not ok:
            raise ContractError(f"a StepResult whose {name} is {shown(getattr(value, name))}", STEP_EXPECTED)
    return replace(value, reward=reward, done=done)


def checked_final_reward(value: Any) -> float:
    """What ``final_reward`` returned as a float, if it is a finite number; else :class:`ContractError`."""
    number = as_number(value)
    if number is None or not math.isfinite(number):
        raise ContractError(shown(value), FINAL_REWARD_EXPECTED)
    return number


@dataclass
class Turn:
    """One segment of an episode: ``role`` ``assistant`` (sampled), ``tool`` or ``environment``."""

    role: str
    text: str
    ids: list[int]
    logp: list[float] | None = None  # the engine's log-probs of sampled ids, when it returns them


@dataclass
class Episode:
    """One episode: its row, prompt, turns and what the environment said."""

    row: dict[str, Any]
    env: Environment | None
    index: int  # row index in the batch x samples
    prompt: Any = None
    prompt_from_env: bool = False  # the prompt is what ``reset`` returned, not the row's
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    correct: bool | None = None
    done: bool = False
    truncated: bool = False
    failed: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0  # calls past `tool_timeout` (their worker killed), counted in tool_errors too
    env_time: float = 0.0
    error: str = ""  # the environment's exception (``on_env_error: zero``)

    @property
    def num_tokens(self) -> int:
        return sum(len(t.ids) for t in self.turns)

    @property
    def model_turns(self) -> int:
        return sum(t.role == "assistant" for t in self.turns)

    @property
    def final_text(self) -> str:
        """The last model turn's text: the episode's answer, which reward functions score."""
        return next((t.text for t in reversed(self.turns) if t.role == "assistant"), "")

    def messages(self) -> list[dict[str, str]]:
        """The turns as ``{"role", "content"}`` messages (predictions, sample tables, reward functions)."""
        return [{"role": t.role, "content": t.text} for t in self.turns]


@dataclass
class EpisodeBatch:
    """The episodes of one batch: as a :class:`Generation` (``model_mask`` set), as records, and stats."""

    generation: Generation
    episodes: list[Episode]
    stats: dict[str, float]

    @property
    def returns(self) -> Tensor:
        """``[N]`` each episode's step rewards plus its final reward (0 for a failed episode)."""
        return torch.tensor([sum(e.rewards) for e in self.episodes], dtype=torch.float32)

    @property
    def failed(self) -> Tensor:
        """``[N]`` bool: the episodes whose environment failed (``on_error: zero``); they train with reward
        0 whatever the reward functions say."""
        return torch.tensor([e.failed for e in self.episodes], dtype=torch.bool)

    @property
    def texts(self) -> list[str]:
        """Each episode's final model turn: what reward functions and correctness score."""
        return [e.final_text for e in self.episodes]

    @property
    def turns(self) -> list[list[dict[str, str]]]:
        return [e.messages() for e in self.episodes]

    @property
    def said_correct(self) -> list[bool | None]:
        """Each episode's ``info["correct"]`` (``None`` where its environment did not say)."""
        return [e.correct for e in self.episodes]


# ---- the episodes as a generation, and their statistics ---------------------------------------------
def episodes_generation(episodes: list[Episode], prompt_ids: Tensor, prompt_mask: Tensor,
                        pad: int) -> Generation:
    """The episodes as one right-padded completion each (``pad``: the tokenizer's pad id): every token in
    ``completion_mask``, the sampled ones in ``model_mask``; ``rollout_logp`` when every sampled turn
    carried the engine's log-probs."""
    device = prompt_ids.device
    seqs = [[i for t in ep.turns for i in t.ids] or [pad] for ep in episodes]
    ids, mask = pad_rows(seqs, pad, left=False)
    model = [[int(t.role == "assistant") for t in ep.turns for _ in t.ids] or [0] for ep in episodes]
    model_mask, _ = pad_rows(model, 0, left=False)
    mask = mask * torch.tensor([float(bool(ep.turns)) for ep in episodes]).long()[:, None]
    logp = None
    if all(t.logp is not None for ep in episodes for t in ep.turns if t.role == "assistant"):
        rows = [[x for t in ep.turns for x in (t.logp or [0.0] * len(t.ids))] or [0.0] for ep in episodes]
        logp = pad_float(rows).to(device)
    truncated = torch.tensor([ep.truncated for ep in episodes], device=device)
    gen = Generation(prompt_ids, prompt_mask.long(), ids.to(device), mask.to(device), truncated,
                     rollout_logp=logp)
    gen.model_mask = model_mask.to(device) * gen.completion_mask
    return gen


def episode_stats(episodes: list[Episode], seconds: float) -> dict[str, float]:
    """The step's episode statistics (``rollout/*``, ``perf/env_time``, ``perf/episode_time``)."""
    n = float(len(episodes)) or 1.0
    env_time = sum(ep.env_time for ep in episodes)
    return {"rollout/turns_mean": sum(ep.model_turns for ep in episodes) / n,
            "rollout/tool_calls_mean": sum(ep.tool_calls for ep in episodes) / n,
            "rollout/tool_errors": float(sum(ep.tool_errors for ep in episodes)),
            "rollout/tool_timeouts": float(sum(ep.tool_timeouts for ep in episodes)),
            "rollout/env_errors": float(sum(ep.failed for ep in episodes)),
            "rollout/env_time": env_time / n, "perf/env_time": env_time,
            "perf/episode_time": seconds}


def pad_float(rows: list[list[float]]) -> Tensor:
    """Right-pad float rows with 0.0 into ``[len(rows), max length]``."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)
