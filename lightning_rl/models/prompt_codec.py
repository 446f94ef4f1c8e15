"""Prompts to token ids and completions back to text, as a module's policy sees them: :class:`PromptCodec`.

A prompt row is a string or a list of chat messages; it is rendered (the chat template, and the tool schemas
of an episode's tools), tokenised (special tokens decided row by row) and left-padded to the policy's
``encode_prompts``, which refuses a prompt longer than ``max_prompt_length``. Completions are decoded
without special tokens. The sampler, the evaluator, the sample tables and the input checks all go through
one codec, so they see the same tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_rl.models.policy import Policy
from lightning_rl.text.prompts import render_prompts

# a sampler thread (`model.sampling.worker: thread`) tokenises beside the learner's validation: a fast
# tokenizer's padding / truncation settings are not safe to change from two threads at once
TOKENIZER_LOCK = threading.RLock()


@dataclass
class PromptCodec:
    """Encodes prompt rows for ``policy`` and decodes its completions (see the module docstring).

    Args:
        policy: the policy whose tokenizer and ``encode_prompts`` are used.
        chat_template: render plain-string prompts with the tokenizer's chat template (message rows always
            are).
        max_prompt_length: the longest prompt in tokens (``model.policy.max_prompt_length``).
        tools: tool schemas the chat template renders into prompts (episodes with tools), or ``None``.
    """

    policy: Policy
    chat_template: bool
    max_prompt_length: int
    tools: list[dict] | None = None

    def add_special_tokens(self, prompts: Sequence[Any]) -> list[bool]:
        """Per prompt: chat templates already hold BOS and friends; plain prompts get the tokenizer's
        specials (decided row by row, so a row's tokens never depend on the rest of its batch)."""
        return [not self.chat_template and isinstance(p, str) for p in prompts]

    def encode(self, prompts: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``(prompt_ids, prompt_mask)`` of the rows, on the policy's device."""
        with TOKENIZER_LOCK:
            texts = render_prompts(self.policy.tokenizer, prompts, self.chat_template, tools=self.tools)
            return self.policy.encode_prompts(texts, self.max_prompt_length,
                                              add_special_tokens=self.add_special_tokens(prompts))

    def decode(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
        """The texts of the masked tokens, special tokens left out."""
        ids = completion_ids.masked_fill(completion_mask == 0, self.policy.pad_token_id)
        with TOKENIZER_LOCK:
            return self.policy.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def shown(self, prompts: Sequence[Any]) -> list[str]:
        """Prompts as the model sees them, as text: rendered, cut to ``max_prompt_length`` and decoded like a
        rollout's prompt ids, so train and validation sample tables show them alike."""
        return self.decode(*self.encode(prompts))

    def render_for_reward_model(self, prompts: Sequence[Any]) -> tuple[list[str], bool]:
        """Prompts as text for a reward model's own tokenizer, and whether it adds special tokens."""
        texts = render_prompts(self.policy.tokenizer, prompts, self.chat_template)
        return texts, all(self.add_special_tokens(prompts))

    def lengths(self, prompts: Sequence[Any]) -> list[int]:
        """Token counts of ``prompts`` exactly as :meth:`encode` feeds them (one batched call per
        special-token setting)."""
        tokenizer = self.policy.tokenizer
        texts = render_prompts(tokenizer, prompts, self.chat_template, tools=self.tools)
        special = self.add_special_tokens(prompts)
        lengths = [0] * len(texts)
        for flag in (True, False):
            index = [i for i, f in enumerate(special) if f == flag]
            if index:
                encoded = tokenizer([texts[i] for i in index], add_special_tokens=flag)["input_ids"]
                for i, ids in zip(index, encoded, strict=True):
                    lengths[i] = len(ids)
        return lengths
