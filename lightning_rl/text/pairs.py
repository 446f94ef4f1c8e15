"""Preference pairs as tokens: rendering (plain text or chat template), tokenisation and padding.

Shared by DPO (:class:`~lightning_rl.algorithms.dpo.DPO`), the reward model
(:mod:`lightning_rl.models.reward_network`) and the preference data (``lightning_rl.data.preference``, which
re-exports these names). Pure tokenizer and torch code: no model, no data loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class EncodedPairs:
    """A tokenised batch of ``B`` pairs: rows ``0..B-1`` are the chosen, ``B..2B-1`` the rejected sequences.

    Attributes:
        prompt_ids: ``[2B, P]`` long, left-padded (each prompt appears twice).
        prompt_mask: ``[2B, P]`` long 0/1, 1 on real prompt tokens.
        completion_ids: ``[2B, C]`` long, right-padded; each completion ends at its first EOS, inclusive
            (unless cut): what a chat template renders after it (ChatML's newline) is not scored.
        completion_mask: ``[2B, C]`` long 0/1, 1 on the completion tokens that are scored.
        prompt_truncated: pairs whose prompt lost tokens on the left (``max_prompt_length``).
        completion_truncated: completions (of the ``2B``) cut on the right (``max_completion_length``).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    prompt_truncated: int
    completion_truncated: int

    def to(self, device: torch.device | str) -> EncodedPairs:
        move = {k: getattr(self, k).to(device)
                for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        return EncodedPairs(
            **move, prompt_truncated=self.prompt_truncated, completion_truncated=self.completion_truncated
        )


def _messages(value: Any, role: str) -> list[dict[str, Any]]:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def render_pair(tokenizer: Any, prompt: Any, completion: Any, chat_template: bool) -> tuple[str, str, bool]:
    """Render one prompt and one completion as text.

    Plain strings are used as they are unless ``chat_template``. Otherwise (or when either is a list of
    messages) the prompt is rendered with the chat template and a generation prompt, the completion is
    the rest of the rendered full conversation, as in TRL.

    Returns:
        ``(prompt_text, completion_text, templated)``.
    """
    if isinstance(prompt, str) and isinstance(completion, str) and not chat_template:
        return prompt, completion, False
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "conversational rows (or `model.policy.chat_template`) need a tokenizer with a chat template"
        )
    prompt_msgs = _messages(prompt, "user")
    prompt_text = tokenizer.apply_chat_template(prompt_msgs, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(prompt_msgs + _messages(completion, "assistant"), tokenize=False)
    if not full.startswith(prompt_text):
        raise ValueError(
            f"the chat template does not render prompt {prompt!r} as a prefix of prompt + completion; "
            "use plain-text rows or a template whose generation prompt is a prefix"
        )
    return prompt_text, full[len(prompt_text) :], True


def pad_rows(rows: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows as one ``[N, max len]`` long tensor padded with ``pad_id`` on the left (``left``) or
    the right, and its 0/1 long mask (1 on the rows' own tokens)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, span] = torch.tensor(r, dtype=torch.long)
        mask[i, span] = 1
    return ids, mask


def encode_pairs(
    tokenizer: Any,
    prompts: list[Any],
    chosen: list[Any],
    rejected: list[Any],
    *,
    max_prompt_length: int,
    max_completion_length: int,
    chat_template: bool = False,
) -> EncodedPairs:
    """Tokenise ``B`` pairs into one ``2B``-row batch (chosen rows first) for a single forward pass.

    Prompts keep their last ``max_prompt_length`` tokens (cut on the left, so the text nearest the answer
    stays); completions end at their first EOS, inclusive (what the chat template renders after the
    turn's end, such as ChatML's ``\\n`` after ``<|im_end|>``, is dropped: the model stops sampling at
    EOS, as :func:`lightning_rl.models.generation.completion_mask` scores the RL step's samples), get EOS
    appended
    when they have none, and keep their first ``max_completion_length`` tokens. Plain-text prompts are
    encoded with the tokenizer's special tokens (as ``Policy.encode_prompts`` does for generation);
    templated text and completions without them.
    """
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    prompt_rows: list[list[int]] = []
    completion_rows: list[list[int]] = []
    prompt_cut = completion_cut = 0
    for side in (chosen, rejected):
        for p, c in zip(prompts, side, strict=True):
            p_text, c_text, templated = render_pair(tokenizer, p, c, chat_template)
            p_ids = tokenizer(p_text, add_special_tokens=not templated)["input_ids"]
            c_ids = tokenizer(c_text, add_special_tokens=False)["input_ids"]
            c_ids = c_ids[: c_ids.index(eos) + 1] if eos in c_ids else c_ids + [eos]
            if side is chosen:  # count each pair's prompt once
                prompt_cut += len(p_ids) > max_prompt_length
            completion_cut += len(c_ids) > max_completion_length
            prompt_rows.append(p_ids[-max_prompt_length:])
            completion_rows.append(c_ids[:max_completion_length])
    prompt_ids, prompt_mask = pad_rows(prompt_rows, pad, left=True)
    completion_ids, completion_mask = pad_rows(completion_rows, pad, left=False)
    return EncodedPairs(prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_cut, completion_cut)


__all__ = ["EncodedPairs", "encode_pairs", "pad_rows", "render_pair"]
