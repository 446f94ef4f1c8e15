"""What an episode appends after a model turn, as text and as ids: an environment's observation rendered once
(:func:`render_observation`, through the chat template when the policy chats), and any observation, tool
results included, tokenised once within the room the episode has left (:func:`observation_ids`).

Token in, token out (:mod:`lightning_rl.episodes.runner`): what is rendered and tokenised here is appended to
the episode as is and never re-rendered. Only a prefix of the text is tokenised, so a huge tool result costs
about the tokens the episode could still keep, not the tokens of the whole text.
"""

from __future__ import annotations

from typing import Any

from lightning_rl.episodes.environments import Observation
from lightning_rl.episodes.tool_formats import chat_suffix

# An observation is tokenised from its first (room left x this) characters, 4x more while that holds fewer
# tokens than the room, so a huge tool result costs about the tokens the episode could still keep.
CHARS_PER_TOKEN = 16


def observation_ids(tokenizer: Any, observation: str, room: int) -> list[int] | None:
    """The observation's ids when fewer than ``room`` tokens (the model must still answer), else ``None``.

    Only a prefix is tokenised: ``room * CHARS_PER_TOKEN`` characters, 4x more while that prefix holds
    fewer than ``room`` tokens and is not the whole text; a prefix of ``room`` tokens or more means the
    whole cannot fit. A 10 MB tool result costs the tokens of a few kilobytes."""
    limit = max(1, room) * CHARS_PER_TOKEN
    while True:
        ids = tokenizer(observation[:limit], add_special_tokens=False)["input_ids"]
        if len(ids) >= room:
            return None
        if limit >= len(observation):
            return ids
        limit *= 4


def render_observation(tokenizer: Any, observation: Observation, chat: bool) -> str:
    """An environment's observation as text appended after the model's EOS (once, never re-rendered): with
    ``chat``, a user message (or the messages given) through the tokenizer's chat template; else the text,
    or the messages' contents joined."""
    if chat:
        messages = [{"role": "user", "content": observation}] if isinstance(observation, str) \
            else list(observation)
        return chat_suffix(tokenizer, messages)
    if isinstance(observation, str):
        return observation
    return "".join(str(m.get("content", "")) for m in observation)
