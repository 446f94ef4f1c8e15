"""Generation mechanics shared by every engine: the sampling parameters, the :class:`Generation` record
and transformers' ``generate`` with each prompt prefilled once for its group's samples (:func:`hf_generate`).
The engines (``lightning_rl.step.engine``) choose when and with which weights to call them; the policy's
``generate`` and the episode runner use them directly.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from lightning_rl.models.model_utils import (
    base_model,
    cache_argument,
    eval_mode,
    keep_logits,
    position_ids,
    returned_cache,
)
from lightning_rl.models.sampling import sample_compacting

if TYPE_CHECKING:
    from lightning_rl.models.policy import Policy


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``temperature`` (0 or ``do_sample=False``: greedy), ``top_p`` (1.0 off), ``top_k``
    (0 off), at most ``max_new_tokens`` tokens per completion."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True

    def __post_init__(self) -> None:
        bad = (self.max_new_tokens < 1 or self.temperature < 0 or self.top_k < 0
               or not 0.0 < self.top_p <= 1.0)
        if bad:
            raise ValueError(f"invalid sampling settings: {self}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


@dataclass
class Generation:
    """One batch of sampled completions; the samples of prompt ``i`` are rows ``i*G .. i*G+G-1``.

    Attributes:
        prompt_ids: ``[N, P]`` long, left-padded with the pad token.
        prompt_mask: ``[N, P]`` long 0/1, 1 on real prompt tokens.
        completion_ids: ``[N, C]`` long, right-padded with the pad token after the first EOS.
        completion_mask: ``[N, C]`` long 0/1, 1 on tokens up to and including the first EOS (a pad
            token sampled before EOS is a real token, so this is not ``completion_ids != pad``).
        truncated: ``[N]`` bool, True where no EOS was sampled within ``max_new_tokens``.
        logits: ``[N, C, V]`` raw logits of each completion token (``return_logits`` only), else None.
        rollout_logp: ``[N, C]`` the engine's log-probs of the sampled tokens (tempered, unfiltered, 0 on
            padding), from engines with ``returns_logprobs``; else None.
        model_mask: ``[N, C]`` long 0/1 for episodes (``lightning_rl.episodes.environments``): 1 on the
            sampled tokens,
            0 on observation tokens (which ``completion_mask`` holds: they are context). ``None``: every
            token of ``completion_mask`` was sampled.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    logits: Tensor | None = None
    rollout_logp: Tensor | None = None
    model_mask: Tensor | None = None

    @property
    def lengths(self) -> Tensor:
        """``[N]`` long: number of completion tokens, EOS included."""
        return self.completion_mask.sum(-1)


def completion_mask(completion_ids: Tensor, eos_token_id: int) -> tuple[Tensor, Tensor]:
    """``(mask, truncated)``: ``[N, C]`` long 0/1 on the tokens up to and including each row's first EOS,
    and ``[N]`` bool where a row has no EOS."""
    is_eos = (completion_ids == eos_token_id).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # EOS tokens strictly before each position
    return (eos_before == 0).long(), is_eos.sum(-1) == 0


def make_generation(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, eos_token_id: int,
                    pad_token_id: int, logits: Tensor | None = None) -> Generation:
    """A :class:`Generation` from raw sampled ids: masks from the first EOS, padding after it."""
    mask, truncated = completion_mask(completion_ids, eos_token_id)
    return Generation(prompt_ids, prompt_mask.long(), completion_ids.masked_fill(mask == 0, pad_token_id),
                      mask, truncated, logits)


@contextmanager
def plain_generation_config(model: nn.Module) -> Iterator[None]:
    """Hide the checkpoint's ``generation_config.json`` during ``generate``: transformers would fill every
    option we leave unset from it (repetition_penalty, min_p, extra EOS ids, ...), so sampling would differ
    from the distribution the step scores."""
    base = base_model(model)
    saved = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


@torch.no_grad()
def prefilled_cache(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, num_samples: int) -> dict:
    """``generate``'s cache argument holding every prompt but its last token, computed once per prompt
    and repeated for its ``num_samples`` rows (``generate`` then runs only the last prompt token)."""
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1].long()
    with eval_mode(model):
        out = model(ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=True,
                    **keep_logits(model, 1))
    cache = returned_cache(out)
    cache.batch_repeat_interleave(num_samples)
    return {cache_argument(model): cache}


def _generation_config(sampling: SamplingParams, eos: int, pad: int, return_logits: bool) -> GenerationConfig:
    """``generate``'s config for ``sampling``: greedy, or sampling at its temperature / top-k / top-p; the
    output a dict, with each step's raw logits when ``return_logits``."""
    options = {"do_sample": False}
    if not sampling.greedy:
        options = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
                   "top_p": sampling.top_p}
    return GenerationConfig(max_new_tokens=sampling.max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                            return_dict_in_generate=True, output_logits=return_logits, **options)


def _compact_generate(model: nn.Module, ids: Tensor, mask: Tensor, sampling: SamplingParams, eos: int,
                      pad: int, return_logprobs: bool) -> Generation:
    """:func:`hf_generate` with :func:`sample_compacting` (in eval mode) over the already repeated prompt
    rows; ``rollout_logp`` 0 on padding when ``return_logprobs``."""
    with eval_mode(model):
        out = sample_compacting(model, ids, mask, max_new_tokens=sampling.max_new_tokens,
                                eos_token_id=eos, pad_token_id=pad, temperature=sampling.temperature,
                                top_k=sampling.top_k, top_p=sampling.top_p, do_sample=not sampling.greedy,
                                return_logprobs=return_logprobs)
    out, logp = out if return_logprobs else (out, None)
    gen = make_generation(ids, mask, out, eos, pad)
    gen.rollout_logp = None if logp is None else logp * gen.completion_mask
    return gen


@torch.no_grad()
def hf_generate(policy: Policy, prompt_ids: Tensor, prompt_mask: Tensor, *, num_samples: int,
                sampling: SamplingParams, compact: bool = False, synced_gpus: bool = False,
                return_logits: bool = False, return_logprobs: bool = False) -> Generation:
    """``num_samples`` completions per prompt with ``policy``'s own model, in eval mode (no dropout).

    ``compact``: :func:`sample_compacting` (never with ``synced_gpus`` or ``return_logits``); else
    transformers' ``generate``, with each prompt prefilled once when ``policy.share_prompts``.
    ``return_logprobs``: ``rollout_logp`` too, the sampled tokens' log-probs at the sampling temperature,
    unfiltered (from the sampler's own logits, or one scoring pass after ``generate``).
    """
    model, eos, pad = policy.model, policy.eos_token_id, policy.pad_token_id
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    ids, mask = prompt_ids.repeat_interleave(num_samples, 0), prompt_mask.repeat_interleave(num_samples, 0)
    if compact and not synced_gpus and not return_logits:
        return _compact_generate(model, ids, mask, sampling, eos, pad, return_logprobs)
    prefix = {}
    if num_samples > 1 and prompt_ids.shape[1] > 1 and policy.share_prompts:
        prefix = prefilled_cache(model, prompt_ids, prompt_mask, num_samples)
    config = _generation_config(sampling, eos, pad, return_logits)
    with eval_mode(model), plain_generation_config(model):
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                             synced_gpus=synced_gpus, **prefix)
    logits = torch.stack(out.logits, dim=1) if return_logits else None
    gen = make_generation(ids, mask, out.sequences[:, ids.shape[1]:], eos, pad, logits)
    if return_logprobs:
        with eval_mode(model):
            gen.rollout_logp, _ = policy.token_logprobs(gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                                                        gen.completion_mask,
                                                        temperature=sampling.temperature or 1.0)
    return gen
