"""Prompt rows as the model and reward functions see them: rendering, data columns, placeholder rows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_rl.text.keys import VAL_WEIGHT_KEY


def render_prompts(
    tokenizer: Any, prompts: Sequence[Any], chat_template: bool, tools: list[dict] | None = None
) -> list[str]:
    """Prompt texts as the model sees them.

    A prompt that is a list of ``{"role", "content"}`` messages is always rendered with the
    tokenizer's chat template; a plain string is rendered as one user message when ``chat_template``.
    ``tools`` (function schemas, ``lightning_rl.episodes.tools.Tool.schema``) are passed to the chat template
    when
    given; a plain string rendered without the template does not show them.
    """
    out = []
    for p in prompts:
        if isinstance(p, str) and not chat_template:
            out.append(p)
            continue
        messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "`model.policy.chat_template` is on (or prompts are messages) but the tokenizer has no chat "
                "template"
            )
        extra = {} if tools is None else {"tools": tools}  # unchanged calls when no tools are configured
        out.append(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
        )
    return out


def batch_columns(batch: dict[str, list]) -> dict[str, list]:
    """Every data column except the prompt, passed to reward functions as keyword arguments."""
    return {k: v for k, v in batch.items() if k != "prompt" and k != VAL_WEIGHT_KEY}


def real_rows(batch: dict[str, list]) -> tuple[dict[str, list], float]:
    """A validation batch without its placeholder rows, and how many held-out rows it holds.

    A batch of placeholders only (a rank whose share ran out) keeps its first row, with weight 0.
    """
    weights = batch.get(VAL_WEIGHT_KEY)
    if weights is None:
        return batch, float(len(batch["prompt"]))
    keep = [i for i, w in enumerate(weights) if w > 0] or [0]
    rows = {k: [v[i] for i in keep] for k, v in batch.items() if k != VAL_WEIGHT_KEY}
    return rows, float(sum(weights[i] for i in keep))
