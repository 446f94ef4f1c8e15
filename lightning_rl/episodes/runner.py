"""Running multi-turn episodes: :class:`EpisodeRunner` samples each model turn with the rollout engine and
appends the tools' results or the environment's answer (:mod:`lightning_rl.episodes.environments`), until
every episode ends; :func:`episode_runner` builds it from ``OnlineRL``'s episode keys.

Token in, token out: the episode's ids are exactly the sampled ids plus each observation's ids, rendered and
tokenised once when appended. Earlier turns are never re-rendered or re-tokenised, so a chat template that
rewrites history (drops earlier ``<think>`` blocks, say) cannot change what is trained. The result is a
:class:`~lightning_rl.models.generation.Generation` whose completion is the whole episode after the prompt:
``completion_mask`` holds every token (the context), ``model_mask`` only the sampled ones (the loss).

Contract: every return of the environment's ``reset``, ``step`` and ``final_reward`` is checked
(:func:`~lightning_rl.episodes.environments.checked_step` and its siblings), and so is the length of a prompt
``reset`` returned; a violation names the class, the method and the episode, and fails the episode like an
exception (``on_error``). Observations are cut to what the episode can still hold before they are tokenised
(:mod:`lightning_rl.episodes.observations`).

Collectives: each turn every rank makes one all-reduce of its number of unfinished episodes and stops when
the sum is 0, so ranks whose episodes take different numbers of turns make the same calls; where generation
is itself a collective (sharded weights), a rank with no unfinished episode still generates for a
placeholder row.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_rl.episodes.env_failures import EnvironmentFailures
from lightning_rl.episodes.environments import (
    ContractError,
    Environment,
    Episode,
    EpisodeBatch,
    Turn,
    checked_final_reward,
    checked_reset,
    checked_step,
    episode_stats,
    episodes_generation,
)
from lightning_rl.episodes.observations import observation_ids, render_observation
from lightning_rl.episodes.tool_formats import ToolFormat
from lightning_rl.episodes.tool_formats import tool_format as make_tool_format
from lightning_rl.episodes.tools import Tool, execute_all, load_tools
from lightning_rl.maths.checks import require
from lightning_rl.models.generation import Generation, SamplingParams
from lightning_rl.text.pairs import pad_rows


def episode_runner(environment: Environment | None, tools: list[str] | None, *, tokenizer: Any,
                   chat: bool, max_turns: int, max_new_tokens: int, max_episode_tokens: int | None,
                   max_prompt_length: int, context: int | None, tool_format: str, tool_timeout: float,
                   on_env_error: Literal["raise", "zero"], max_error_frac: float = 0.5,
                   allow_unsafe_tools: bool = False) -> EpisodeRunner | None:
    """The runner for ``OnlineRL``'s episode keys, or ``None`` when there is neither an environment nor tools
    (single-turn rollouts). ``context``: the model's longest sequence, which prompt + episode must fit;
    unsafe tools are refused unless ``allow_unsafe_tools``."""
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
    loaded = load_tools(tools or [], allow_unsafe=allow_unsafe_tools)
    return EpisodeRunner(environment, loaded, make_tool_format(tool_format, tokenizer, chat),
                         tokenizer, chat=chat, max_turns=max_turns, max_episode_tokens=budget,
                         tool_timeout=tool_timeout, on_env_error=on_env_error, max_error_frac=max_error_frac,
                         max_prompt_length=max_prompt_length)


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
        tool_timeout: seconds a turn's tool calls may take (they run at once, under one deadline); a call
            not back by then answers an error.
        on_env_error: ``raise`` stops on an environment's exception or contract violation; ``zero`` ends
            that episode with return 0 (its reward is 0 whatever the reward functions say) and counts it
            (``rollout/env_errors``).
        max_error_frac: under ``zero``, the largest fraction of a step's episodes that may fail before
            :meth:`check_failures` stops the run (1.0: any).
        max_prompt_length: named when a prompt returned by ``reset`` is too long (``model.policy``'s key).
    """

    def __init__(self, environment: Environment | None, tools: Sequence[Tool], tool_format: ToolFormat,
                 tokenizer: Any, *, chat: bool = False, max_turns: int = 4, max_episode_tokens: int = 256,
                 tool_timeout: float = 10.0, on_env_error: Literal["raise", "zero"] = "raise",
                 max_error_frac: float = 0.5, max_prompt_length: int | None = None) -> None:
        require("model.episodes", max_turns=(max_turns >= 1, max_turns, ">= 1"),
                max_episode_tokens=(max_episode_tokens >= 1, max_episode_tokens, ">= 1"),
                tool_timeout=(tool_timeout > 0, tool_timeout, "> 0 (seconds)"),
                on_error=(on_env_error in ("raise", "zero"), on_env_error, "one of raise, zero"),
                max_error_frac=(0.0 <= max_error_frac <= 1.0, max_error_frac, "in [0, 1]"))
        self.environment, self.tools = environment, {t.name: t for t in tools}
        self.format, self.tokenizer, self.chat = tool_format, tokenizer, chat
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens
        self.tool_timeout, self.max_prompt_length = tool_timeout, max_prompt_length
        self.failures = EnvironmentFailures(self.env_name, on_env_error, max_error_frac)

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
        generation = episodes_generation(episodes, prompt_ids, prompt_mask, self.tokenizer.pad_token_id)
        return EpisodeBatch(generation, episodes, episode_stats(episodes, time.perf_counter() - start))

    # ---- turns ---------------------------------------------------------------------------------------
    def start_episodes(self, rows: list[dict[str, Any]], num_samples: int) -> list[Episode]:
        """``num_samples`` episodes per row, each with its own environment, reset with its row: the prompt is
        what ``reset`` returned, else the row's ``prompt``."""
        episodes = [Episode(row, self.environment.spawn() if self.environment else None, i * num_samples + k)
                    for i, row in enumerate(rows) for k in range(num_samples)]
        for ep in episodes:
            first = self.guarded(ep, "reset", lambda ep=ep: checked_reset(ep.env.reset(ep.row)) if ep.env
                                 else None)
            ep.prompt, ep.prompt_from_env = (first, True) if first is not None else (ep.row["prompt"], False)
        return episodes

    def finish_episodes(self, episodes: list[Episode]) -> None:
        """End every episode: add the environment's final reward, or set the return to 0 for a failed one."""
        for ep in episodes:
            ep.done = True
            if ep.env is not None and not ep.failed:
                final = self.guarded(ep, "final_reward",
                                     lambda ep=ep: checked_final_reward(ep.env.final_reward(ep)))
                ep.rewards.append(0.0 if final is None else final)
            if ep.failed:
                ep.rewards = [0.0]

    def encode_prompts(self, episodes: list[Episode], num_samples: int,
                       encode: Callable) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """Every episode's prompt ids and mask, and the first turn's rows: one per group, sampled
        ``num_samples`` times, when the group's prompts are equal (the usual case); one per episode else."""
        shared = all(ep.prompt == episodes[ep.index - ep.index % num_samples].prompt for ep in episodes)
        n = num_samples if shared else 1
        try:
            ids, mask = encode([ep.prompt for ep in episodes[::n]])
        except ValueError:
            if not self.reject_long_prompts(episodes, encode):
                raise  # a data row's prompt: the module's error names it
            return self.encode_prompts(episodes, num_samples, encode)
        return ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), ids, mask, n

    def reject_long_prompts(self, episodes: list[Episode], encode: Callable) -> bool:
        """After ``encode`` refused a batch: fail each episode whose prompt from ``reset`` it refuses alone
        (``raise``: stop, naming the environment, the episode and the prompt's length; ``zero``: the
        episode fails and keeps its row's prompt). Whether any was the environment's."""
        refused: dict[str, str | None] = {}  # repr(prompt) -> encode's error, None when accepted
        for ep in episodes:
            if not ep.prompt_from_env:
                continue
            key = repr(ep.prompt)
            if key not in refused:
                try:
                    encode([ep.prompt])
                    refused[key] = None
                except ValueError as err:
                    refused[key] = str(err)
            if refused[key] is not None:
                self.failures.fail(ep, "reset", self.long_prompt(refused[key]))
                ep.prompt, ep.prompt_from_env = ep.row["prompt"], False
        return any(error is not None for error in refused.values())

    def long_prompt(self, error: str) -> ContractError:
        """The violation of a prompt ``encode`` refused with ``error`` (its length when the error says it)."""
        length = re.search(r"(\d+) tokens", error)
        limit = "`model.policy.max_prompt_length`" + (f"={self.max_prompt_length}"
                                                      if self.max_prompt_length is not None else "")
        got = f"a prompt of {length.group(1)} tokens" if length else f"a prompt the policy refused ({error})"
        return ContractError(got, f"at most {limit} tokens")

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
            obs_ids = observation_ids(self.tokenizer, observation, self.max_episode_tokens - ep.num_tokens)
            if obs_ids is None:  # no room left to answer it
                ep.truncated = ep.done = True
            else:
                ep.turns.append(Turn(role, observation, obs_ids))
        ep.done = ep.done or last

    def answer(self, ep: Episode, text: str) -> tuple[str, str | None]:
        """``(role, observation text)`` for a model turn: tool results when it calls tools, else the
        environment's answer (or the end of the episode without one)."""
        calls = self.format.parse(text, self.tools) if self.tools else []
        if calls:  # at once, under one deadline: a turn costs at most one `tool_timeout` however many hang
            results = execute_all(self.tools, calls, self.tool_timeout)
            ep.tool_calls += len(results)
            ep.tool_errors += sum(r.error for r in results)
            ep.tool_timeouts += sum(r.timed_out for r in results)
            return "tool", self.format.render_results(results, self.tokenizer)
        if ep.env is None:
            ep.done = True
            return "environment", None
        result = self.guarded(ep, "step", lambda: checked_step(ep.env.step(text)))
        if result is None:
            return "environment", None
        ep.rewards.append(result.reward)
        if "correct" in result.info:
            ep.correct = bool(result.info["correct"])
        ep.done = bool(result.done)
        if result.observation is None or ep.done:
            return "environment", None
        return "environment", render_observation(self.tokenizer, result.observation, self.chat)

    def guarded(self, ep: Episode, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` (the environment's method ``what``), failing the episode on an exception: see
        :class:`~lightning_rl.episodes.env_failures.EnvironmentFailures`."""
        return self.failures.guarded(ep, what, fn)

    def check_failures(self, batch: EpisodeBatch, collectives: Any = None, decide: bool = True) -> None:
        """Stop a step with too many failed episodes, or warn once: :meth:`EnvironmentFailures.check`."""
        self.failures.check(batch, collectives, decide)

    def any_active(self, local: int, collectives: Any, device: torch.device) -> bool:
        """Whether any rank has an unfinished episode: one all-reduce per turn on every rank."""
        if collectives is None or collectives.world_size == 1:
            return local > 0
        return bool(collectives.sum(torch.tensor(float(local), device=device)) > 0)
