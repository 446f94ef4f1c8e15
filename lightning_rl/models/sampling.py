"""A KV-cached sampling loop that stops computing rows once they end, and prefills each prompt once.

``transformers``' ``generate`` keeps every row of the batch in every decode step until the last row ends
(or the token budget runs out), and with ``num_return_sequences`` it prefills each prompt once per sample.
When completion lengths vary, as they do in RL, most decode work goes to rows that already emitted EOS.
Here each distinct prompt is prefilled once and its cache repeated for its samples, and after every step
the rows that just ended leave the batch (their cache rows are dropped), so step ``t`` costs only the rows
still running. Sampling is HF's: temperature, then top-k, then top-p on the logits (the same warpers), then
a multinomial draw (or argmax when greedy).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rl.models.model_utils import (
    base_model,
    cache_argument,
    filter_logits,
    keep_logits,
    position_ids,
    returned_cache,
)
from lightning_rl.models.scoring import shared_prompts

_draws = threading.local()  # this thread's generator for the draws (`drawing_from`)


@contextmanager
def drawing_from(generator: torch.Generator | None) -> Iterator[None]:
    """The draws of :func:`sample_compacting` in this thread come from ``generator`` (``None``: the global
    RNG). A sampler in a thread beside the learner (``model.sampling.worker: thread``) then neither
    disturbs the learner's RNG nor is disturbed by it."""
    previous = getattr(_draws, "generator", None)
    _draws.generator = generator
    try:
        yield
    finally:
        _draws.generator = previous


@torch.no_grad()
def sample_compacting(
    model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, *, max_new_tokens: int, eos_token_id: int,
    pad_token_id: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, do_sample: bool = True,
    return_logprobs: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``[N, C]`` completion tokens for the ``N`` (left-padded) prompt rows, ``C <= max_new_tokens``;
    after a row's EOS the rest is ``pad_token_id``. Rows that repeat a prompt share its prefill.

    ``return_logprobs``: also ``[N, C]`` float32 log-probs of the sampled tokens under the tempered,
    *unfiltered* softmax (top-k / top-p shape the draw only, as every log-prob of the RL step), 0 after EOS.
    """
    n, device = prompt_ids.shape[0], prompt_ids.device
    mask = prompt_mask.long()
    logits, cache = _prefill(model, prompt_ids, mask)
    out = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logp = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device) if return_logprobs else None
    scale = temperature if temperature > 0 else 1.0
    rows = torch.arange(n, device=device)  # the original row of each running row
    lengths = mask.sum(1)
    name = cache_argument(model)
    for t in range(max_new_tokens):
        token = _pick(logits, temperature, top_k, top_p, do_sample)
        out[rows, t] = token
        if logp is not None:
            picked = torch.log_softmax(logits.float() / scale, -1).gather(-1, token[:, None])
            logp[rows, t] = picked.squeeze(1)
        running = token != eos_token_id
        if t == max_new_tokens - 1 or not running.any():
            width = t + 1 if not running.any() else max_new_tokens
            return (out[:, :width], logp[:, :width]) if logp is not None else out[:, :width]
        if not running.all():  # the rows that just ended leave the batch
            keep = torch.nonzero(running).squeeze(1)
            rows, token = rows[keep], token[keep]
            cache.batch_select_indices(keep)
        logits, cache = _decode_step(model, token, mask[rows], lengths[rows], t, cache, name)
    return (out, logp) if logp is not None else out


def _prefill(model: nn.Module, prompt_ids: Tensor, mask: Tensor) -> tuple[Tensor, Any]:
    """The last prompt position's logits ``[N, V]`` and the prompts' cache, each distinct prompt run once."""
    shared = shared_prompts(prompt_ids, mask)
    first, inverse = shared if shared is not None else (None, None)
    ids, m = (prompt_ids, mask) if first is None else (prompt_ids[first], mask[first])
    out = model(ids, attention_mask=m, position_ids=position_ids(m), use_cache=True,
                **keep_logits(model, 1))
    logits, cache = out.logits[:, -1], returned_cache(out)
    if inverse is not None:
        cache.batch_select_indices(inverse)
        logits = logits[inverse]
    return logits, cache


def _decode_step(
    model: nn.Module, token: Tensor, mask: Tensor, lengths: Tensor, t: int, cache: Any, name: str
) -> tuple[Tensor, Any]:
    """One decode step of the running rows: their sampled ``token`` ``[R]`` (completion position ``t``) on
    top of ``cache`` (passed as ``name``), given their prompt ``mask`` and ``lengths``. Returns the next
    logits ``[R, V]`` and the cache."""
    attention = torch.cat([mask, torch.ones(len(token), t + 1, dtype=torch.long, device=mask.device)], 1)
    step = model(token[:, None], attention_mask=attention, position_ids=(lengths + t)[:, None],
                 use_cache=True, **{name: cache}, **keep_logits(model, 1))
    return step.logits[:, -1], returned_cache(step)


def _pick(logits: Tensor, temperature: float, top_k: int, top_p: float, do_sample: bool) -> Tensor:
    """The next token of each row: argmax, or a draw from the tempered, top-k / top-p filtered softmax."""
    logits = logits.float()
    if not do_sample or temperature == 0:
        return logits.argmax(-1)
    logits = filter_logits(logits / temperature, top_k, top_p)
    generator = getattr(_draws, "generator", None)
    return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator).squeeze(1)


__all__ = ["base_model", "drawing_from", "sample_compacting"]
