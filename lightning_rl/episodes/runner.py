"""Running multi-turn episodes: :class:`EpisodeRunner` samples each model turn with the rollout engine and
appends the tools' results or the environment's answer (:mod:`lightning_rl.episodes.environments`), until
every episode ends; :func:`episode_runner` builds it from ``OnlineRL``'s episode keys.

Token in, token out: the episode's ids are exactly the sampled ids plus each observation's ids, rendered and
tokenised once when appended. Earlier turns are never re-rendered or re-tokenised, so a chat template that
rewrites history (drops earlier ``<think>`` blocks, say) cannot change what is trained. The result is a
:class:`~lightning_rl.models.generation.Generation` whose completion is the whole episode after the prompt:
``completion_mask`` holds every token (the context), ``model_mask`` only the sampled ones (the loss).

Collectives: each turn every rank makes one all-reduce of its number of unfinished episodes and stops when
the sum is 0, so ranks whose episodes take different numbers of turns make the same calls; where generation
is itself a collective (sharded weights), a rank with no unfinished episode still generates for a
placeholder row.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_rl.episodes.environments import (
    Environment,
    Episode,
    EpisodeBatch,
    EpisodeError,
    Observation,
    Turn,
)
from lightning_rl.episodes.tool_formats import ToolFormat, chat_suffix
from lightning_rl.episodes.tool_formats import tool_format as make_tool_format
from lightning_rl.episodes.tools import Tool, ToolCall, ToolResult, execute, load_tools
from lightning_rl.models.generation import Generation, SamplingParams
from lightning_rl.text.pairs import pad_rows


def episode_runner(environment: Environment | None, tools: list[str] | None, *, tokenizer: Any,
                   chat: bool, max_turns: int, max_new_tokens: int, max_episode_tokens: int | None,
                   max_prompt_length: int, context: int | None, tool_format: str, tool_timeout: float,
                   on_env_error: Literal["raise", "zero"]) -> EpisodeRunner | None:
    """The runner for ``OnlineRL``'s episode keys, or ``None`` when there is neither an environment nor tools
    (single-turn rollouts). ``context``: the model's longest sequence, which prompt + episode must fit."""
    if environment is None and not tools:
        if max_episode_tokens is not None:
            raise ValueError("`model.episodes.max_episode_tokens` applies to episodes: set "
                             "`model.episodes.environment` or `model.episodes.tools`")
        return None
    if environment is not None and not isinstance(environment, Environment):
        raise ValueError("`model.episodes.environment` must be a "
                         "lightning_rl.episodes.environments.Environment, got "
                         f"{type(environment).__name__}")
    budget = max_episode_tokens if max_episode_tokens is not None else max_turns * max_new_tokens
    if context is not None and max_prompt_length + budget > context:
        raise ValueError(f"`model.policy.max_prompt_length` ({max_prompt_length}) + "
                         f"`model.episodes.max_episode_tokens` ({budget}) is more than the model's "
                         f"context of {context} tokens")
    return EpisodeRunner(environment, load_tools(tools or []), make_tool_format(tool_format, tokenizer, chat),
                         tokenizer, chat=chat, max_turns=max_turns, max_episode_tokens=budget,
                         tool_timeout=tool_timeout, on_env_error=on_env_error)


class EpisodeRunner:
    """Runs G episodes per prompt row with a generate function (the rollout engine) and returns them.

    Args:
        environment: the template environment, or ``None`` (tool calls only).
        tools: the callable tools (``lightning_rl.episodes.tools.load_tools``); may be empty.
        tool_format: how calls are parsed and results rendered.
        tokenizer: the policy's tokenizer (observations are tokenised once with it).
        chat: observations are rendered through the chat template (``model.policy.chat_template`` on).
        max_turns: model turns per episode, at least 1.
        max_episode_tokens: tokens after the prompt (model and observation tokens), at least 1.
        tool_timeout: seconds a tool call may take before it answers an error.
        on_env_error: ``raise`` stops on an environment exception; ``zero`` ends that episode with return 0
            and counts it (``rollout/env_errors``).
    """

    def __init__(self, environment: Environment | None, tools: Sequence[Tool], tool_format: ToolFormat,
                 tokenizer: Any, *, chat: bool = False, max_turns: int = 4, max_episode_tokens: int = 256,
                 tool_timeout: float = 10.0, on_env_error: Literal["raise", "zero"] = "raise") -> None:
        checks = {"max_turns": (max_turns >= 1, max_turns),
                  "max_episode_tokens": (max_episode_tokens >= 1, max_episode_tokens),
                  "tool_timeout": (tool_timeout > 0, tool_timeout),
                  "on_error": (on_env_error in ("raise", "zero"), on_env_error)}
        for key, (ok, value) in checks.items():
            if not ok:
                raise ValueError(f"`model.episodes.{key}` is out of range, got {value!r}")
        self.environment, self.tools = environment, {t.name: t for t in tools}
        self.format, self.tokenizer, self.chat = tool_format, tokenizer, chat
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.tool_timeout, self.on_env_error = tool_timeout, on_env_error

    @property
    def env_name(self) -> str:
        return type(self.environment).__name__ if self.environment is not None else "tools"

    def __call__(self, rows: list[dict[str, Any]], *, num_samples: int, sampling: SamplingParams,
                 seed: int | None, encode: Callable[[list[Any]], tuple[Tensor, Tensor]],
                 generate: Callable[..., Generation], collectives: Any = None,
                 synced: bool = False) -> EpisodeBatch:
        """Run ``num_samples`` episodes per row (the samples of row ``i`` are episodes ``i*G .. i*G+G-1``).

        ``encode(prompts) -> (ids, mask)`` left-pads prompts as the module does; ``generate(ids, mask, *,
        num_samples, sampling, seed)`` samples one turn (the engine). ``collectives`` agree on the turn count.
        """
        start = time.perf_counter()
        episodes = self.start_episodes(rows, num_samples)
        prompt_ids, prompt_mask, first_ids, first_mask, n = self.encode_prompts(episodes, num_samples, encode)
        device = prompt_ids.device
        prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
        for turn in range(self.max_turns):
            active = [ep for ep in episodes if not ep.done]
            if not self.any_active(len(active), collectives, device):
                break
            turn_seed = None if seed is None else (seed + 7919 * turn) % 2**31
            step, rows = self.turn_sampling(sampling, active), []
            if turn == 0:  # every episode, one prompt row per group when they share it
                gen = generate(first_ids, first_mask, num_samples=n, sampling=step, seed=turn_seed)
                rows = [ep.index for ep in active]
            elif active or synced:  # a rank without episodes still joins a collective generation
                ids, mask = self.contexts(active or episodes[:1], prompts)
                gen = generate(ids.to(device), mask.to(device), num_samples=1, sampling=step, seed=turn_seed)
                rows = list(range(len(active)))
            for ep, j in zip(active, rows, strict=True):
                self.take_turn(ep, gen, j, last=turn == self.max_turns - 1)
        self.finish_episodes(episodes)
        generation = self.to_generation(episodes, prompt_ids, prompt_mask)
        return EpisodeBatch(generation, episodes, self.stats(episodes, time.perf_counter() - start))

    # ---- turns ---------------------------------------------------------------------------------------
    def start_episodes(self, rows: list[dict[str, Any]], num_samples: int) -> list[Episode]:
        """``num_samples`` episodes per row, each with its own environment, reset with its row: the prompt is
        what ``reset`` returned, else the row's ``prompt``."""
        episodes = [Episode(row, self.environment.spawn() if self.environment else None, i * num_samples + k)
                    for i, row in enumerate(rows) for k in range(num_samples)]
        for ep in episodes:
            first = self.guarded(ep, "reset", lambda ep=ep: ep.env.reset(ep.row) if ep.env else None)
            ep.prompt = first if first is not None else ep.row["prompt"]
        return episodes

    def finish_episodes(self, episodes: list[Episode]) -> None:
        """End every episode: add the environment's final reward, or set the return to 0 for a failed one."""
        for ep in episodes:
            ep.done = True
            if ep.env is not None and not ep.failed:
                final = self.guarded(ep, "final_reward", lambda ep=ep: ep.env.final_reward(ep))
                ep.rewards.append(float(final or 0.0))
            if ep.failed:
                ep.rewards = [0.0]

    def encode_prompts(self, episodes: list[Episode], num_samples: int,
                       encode: Callable) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """Every episode's prompt ids and mask, and the first turn's rows: one per group, sampled
        ``num_samples`` times, when the group's prompts are equal (the usual case); one per episode else."""
        shared = all(ep.prompt == episodes[ep.index - ep.index % num_samples].prompt for ep in episodes)
        n = num_samples if shared else 1
        ids, mask = encode([ep.prompt for ep in episodes[::n]])
        return ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), ids, mask, n

    def contexts(self, episodes: list[Episode], prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Left-padded ids of each episode so far: its prompt ids, then every turn's ids as appended."""
        rows = [prompts[ep.index] + [i for t in ep.turns for i in t.ids] for ep in episodes]
        return pad_rows(rows, self.tokenizer.pad_token_id, left=True)

    def turn_sampling(self, sampling: SamplingParams, active: list[Episode]) -> SamplingParams:
        """This turn's token budget: at most ``max_new_tokens``, and no more than the largest room left."""
        room = max((self.max_episode_tokens - ep.num_tokens for ep in active), default=1)
        return replace(sampling, max_new_tokens=max(1, min(sampling.max_new_tokens, room)))

    def take_turn(self, ep: Episode, gen: Generation, j: int, last: bool) -> None:
        """Append the model's turn ``j`` of ``gen`` to ``ep``, then the tools' or environment's answer."""
        n = int(gen.completion_mask[j].sum())
        ids = gen.completion_ids[j, :n].tolist()
        logp = gen.rollout_logp[j, :n].tolist() if gen.rollout_logp is not None else None
        room = self.max_episode_tokens - ep.num_tokens
        if n > room or bool(gen.truncated[j]):  # no EOS within the turn's budget
            ids, logp = ids[:room], None if logp is None else logp[:room]
            ep.truncated = ep.done = True
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        ep.turns.append(Turn("assistant", text, ids, logp))
        if ep.done:
            return
        start = time.perf_counter()
        role, observation = self.answer(ep, text)
        ep.env_time += time.perf_counter() - start
        if observation:
            obs_ids = self.tokenizer(observation, add_special_tokens=False)["input_ids"]
            if ep.num_tokens + len(obs_ids) >= self.max_episode_tokens:  # no room left to answer it
                ep.truncated = ep.done = True
            else:
                ep.turns.append(Turn(role, observation, obs_ids))
        ep.done = ep.done or last

    def answer(self, ep: Episode, text: str) -> tuple[str, str | None]:
        """``(role, observation text)`` for a model turn: tool results when it calls tools, else the
        environment's answer (or the end of the episode without one)."""
        calls = self.format.parse(text, self.tools) if self.tools else []
        if calls:
            results = [execute(self.tools, c, self.tool_timeout) if isinstance(c, ToolCall) else c
                       for c in calls]
            ep.tool_calls += len(results)
            ep.tool_errors += sum(isinstance(r, ToolResult) and r.error for r in results)
            return "tool", self.format.render_results(results, self.tokenizer)
        if ep.env is None:
            ep.done = True
            return "environment", None
        result = self.guarded(ep, "step", lambda: ep.env.step(text))
        if result is None:
            return "environment", None
        ep.rewards.append(float(result.reward))
        if "correct" in result.info:
            ep.correct = bool(result.info["correct"])
        ep.done = bool(result.done)
        if result.observation is None or ep.done:
            return "environment", None
        return "environment", self.render_observation(result.observation)

    def render_observation(self, observation: Observation) -> str:
        """An environment's observation as text appended after the model's EOS (once, never re-rendered)."""
        if self.chat:
            messages = [{"role": "user", "content": observation}] if isinstance(observation, str) \
                else list(observation)
            return chat_suffix(self.tokenizer, messages)
        if isinstance(observation, str):
            return observation
        return "".join(str(m.get("content", "")) for m in observation)

    def guarded(self, ep: Episode, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; an exception stops the run naming the environment and episode (``raise``) or ends the
        episode with return 0, counted (``zero``)."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 - re-raised with the environment named, or counted
            where = f"episode {ep.index} (prompt {str(ep.row.get('prompt'))[:80]!r})"
            message = f"environment `{self.env_name}` raised {type(err).__name__} in {what} of {where}: {err}"
            if self.on_env_error == "raise":
                raise EpisodeError(message + "; set `model.episodes.on_error: zero` to score such episodes 0 "
                                   "instead") from err
            ep.failed = ep.done = True
            ep.error = message
            return None

    def any_active(self, local: int, collectives: Any, device: torch.device) -> bool:
        """Whether any rank has an unfinished episode: one all-reduce per turn on every rank."""
        if collectives is None or collectives.world_size == 1:
            return local > 0
        return bool(collectives.sum(torch.tensor(float(local), device=device)) > 0)

    # ---- results -------------------------------------------------------------------------------------
    def to_generation(self, episodes: list[Episode], prompt_ids: Tensor, prompt_mask: Tensor) -> Generation:
        """The episodes as one right-padded completion each: every token in ``completion_mask``, the sampled
        ones in ``model_mask``; ``rollout_logp`` when every sampled turn carried the engine's log-probs."""
        pad, device = self.tokenizer.pad_token_id, prompt_ids.device
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

    def stats(self, episodes: list[Episode], seconds: float) -> dict[str, float]:
        n = float(len(episodes)) or 1.0
        env_time = sum(ep.env_time for ep in episodes)
        return {"rollout/turns_mean": sum(ep.model_turns for ep in episodes) / n,
                "rollout/tool_calls_mean": sum(ep.tool_calls for ep in episodes) / n,
                "rollout/tool_errors": float(sum(ep.tool_errors for ep in episodes)),
                "rollout/env_errors": float(sum(ep.failed for ep in episodes)),
                "rollout/env_time": env_time / n, "perf/env_time": env_time,
                "perf/episode_time": seconds}


def pad_float(rows: list[list[float]]) -> Tensor:
    """Right-pad float rows with 0.0 into ``[len(rows), max length]``."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)
