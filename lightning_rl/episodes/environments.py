"""Multi-turn episodes: the model acts, tools and an environment answer, and the whole episode trains.

An episode starts from a prompt row. Each model turn is sampled by the rollout engine until its EOS; a turn
that calls tools (``lightning_rl.episodes.tools``) gets their results appended as a tool turn, a turn without
a call
goes to the environment's ``step`` (or ends the episode when there is no environment). The episode ends when
the environment says ``done``, after ``max_turns`` model turns, or when its tokens would pass
``max_episode_tokens`` (then it is ``truncated``).

This module holds the environment seam (:class:`Environment`, :class:`StepResult`) and the episode records
(:class:`Episode`, :class:`Turn`, :class:`EpisodeBatch`); :mod:`lightning_rl.episodes.runner` runs the
episodes, token in, token out.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_rl.models.generation import Generation

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
    :meth:`final_reward` once at the end. Plain Python; an exception is handled like a reward function's
    (``model.episodes.on_error``).
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
    """An environment raised (``model.episodes.on_error: raise``)."""


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
    turns: list[Turn] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    correct: bool | None = None
    done: bool = False
    truncated: bool = False
    failed: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
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
