"""Rollout engines: what samples completions for the RL step, validation and predict.

An engine takes left-padded prompts and returns a :class:`Generation`. The module attaches it to the
policy once (``attach``), asks it to sample (``generate``) and tells it after every optimiser step that
precedes a rollout (``sync_weights``; a no-op for an engine that samples with the trained module itself).
An engine that keeps its own weights (a lower-precision copy, a server) sets ``returns_logprobs`` when
its generations carry the sampled tokens' log-probs (``rollout_logp``) and ``is_trained_module = False``,
so the step recomputes or corrects behaviour log-probs instead of assuming the sampler is the trainer.

:class:`HFEngine` is the in-process engine: transformers' ``generate`` (with each prompt prefilled once
for its group's samples), or :func:`lightning_rl.sampling.sample_compacting` (finished rows leave the
batch) where forwards are not collectives. It owns ``synced_gpus``: sharded weights keep every rank
stepping until all ranks finish.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from transformers import GenerationConfig

from lightning_rl.sampling import sample_compacting
from lightning_rl.scoring import (
    base_model,
    cache_argument,
    eval_mode,
    keep_logits,
    position_ids,
    returned_cache,
)

if TYPE_CHECKING:
    from lightning_rl.policy import Policy


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
        model_mask: ``[N, C]`` long 0/1 for episodes (``lightning_rl.environments``): 1 on the sampled tokens,
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
        with eval_mode(model):
            out = sample_compacting(model, ids, mask, max_new_tokens=sampling.max_new_tokens,
                                    eos_token_id=eos, pad_token_id=pad, temperature=sampling.temperature,
                                    top_k=sampling.top_k, top_p=sampling.top_p, do_sample=not sampling.greedy,
                                    return_logprobs=return_logprobs)
        out, logp = out if return_logprobs else (out, None)
        gen = make_generation(ids, mask, out, eos, pad)
        gen.rollout_logp = None if logp is None else logp * gen.completion_mask
        return gen
    prefix = {}
    if num_samples > 1 and prompt_ids.shape[1] > 1 and policy.share_prompts:
        prefix = prefilled_cache(model, prompt_ids, prompt_mask, num_samples)
    options = {"do_sample": False}
    if not sampling.greedy:
        options = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
                   "top_p": sampling.top_p}
    config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                              return_dict_in_generate=True, output_logits=return_logits, **options)
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


class RolloutEngine:
    """The rollout-engine seam. Subclass and name it in YAML: ``model.init_args.engine.class_path``.

    Attributes:
        returns_logprobs: generations carry ``rollout_logp`` (behaviour log-probs ``from_engine``).
        is_trained_module: the engine samples with the very module being trained (the ratio of a single
            update per rollout is then exactly 1 and behaviour log-probs may be skipped).
    """

    returns_logprobs: bool = False
    is_trained_module: bool = True

    def attach(self, policy: Policy, *, synced: bool = False, compact: bool = False) -> None:
        """Bind to the trained policy. ``synced``: forwards are collectives (sharded weights), so every
        rank must keep generating until all finish; ``compact``: the compacting sampler is allowed."""
        raise NotImplementedError

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, *, num_samples: int = 1,
                 sampling: SamplingParams, seed: int | None = None) -> Generation:
        """``num_samples`` completions per prompt; ``seed`` makes the draw reproducible (resume)."""
        raise NotImplementedError

    def sync_weights(self, policy: Policy) -> None:
        """Refresh the engine's weights from the trained policy (after an optimiser step)."""


class HFEngine(RolloutEngine):
    """In-process sampling with the trained module itself (see the module docstring).

    Args:
        compact: use the compacting sampler when forwards are not collectives: ``None`` follows the
            module's ``share_prompt_prefix``; ``False`` always uses transformers' ``generate``.
    """

    def __init__(self, compact: bool | None = None) -> None:
        self.compact_option = compact
        self.policy: Any = None
        self.synced, self.compact = False, False

    def attach(self, policy: Policy, *, synced: bool = False, compact: bool = False) -> None:
        self.policy, self.synced = policy, synced
        self.compact = (compact if self.compact_option is None else self.compact_option) and not synced

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, *, num_samples: int = 1,
                 sampling: SamplingParams, seed: int | None = None) -> Generation:
        if self.policy is None:
            raise RuntimeError("the engine is not attached to a policy: call `attach(policy)` first")
        with seeded(seed, prompt_ids.device):
            return hf_generate(self.policy, prompt_ids, prompt_mask, num_samples=num_samples,
                               sampling=sampling, compact=self.compact, synced_gpus=self.synced)


@contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Draw from ``seed`` without disturbing the global RNG streams (nothing happens for ``None``)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


class CopyEngine(HFEngine):
    """Samples with its own copy of the policy's weights in ``dtype`` (bf16 by default): AMX / tensor-core
    arithmetic for rollouts while training keeps fp32 master weights. Its log-probs (``rollout_logp``)
    differ from the trainer's, so the step recomputes behaviour log-probs and corrects the gap
    (``model.rollout_correction``) and logs it (``rollout/mismatch_*``).

    ``sync_weights`` copies the trained weights into the copy in place (cast), once per step before
    sampling: one parameter at a time, so under FSDP2 each is gathered alone (every rank joins each gather,
    in the same order) and never the whole model at once; under LoRA only the trained (adapter) weights are
    copied. The copy is a plain attribute: out of checkpoints, optimisers and the module tree.

    Args:
        dtype: ``bfloat16``, ``float16`` or ``float32`` (``float32``: an exact copy, for checks).
        compact: as :class:`HFEngine`.
    """

    returns_logprobs = True
    is_trained_module = False

    def __init__(self, dtype: str = "bfloat16", compact: bool | None = None) -> None:
        super().__init__(compact)
        choices = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
        if dtype not in choices:
            raise ValueError(f"`model.engine.init_args.dtype` must be one of {sorted(choices)}, "
                             f"got {dtype!r}")
        self.dtype = choices[dtype]
        self.copy: Any = None  # a Policy around the engine's own model
        self.source: Any = None  # the trained Policy it copies

    def attach(self, policy: Policy, *, synced: bool = False, compact: bool = False) -> None:
        if self.source is not policy:
            self.source, self.copy = policy, self.build(policy)
            self.sync_weights(policy)
        # the copy is whole on every rank: its forwards are local, never collectives
        super().attach(self.copy, synced=False, compact=compact)

    def build(self, policy: Policy) -> Policy:
        """A frozen copy of the policy's model in ``dtype`` on its device (weights: ``sync_weights``)."""
        from lightning_rl.policy import Policy
        from lightning_rl.sharding import is_sharded

        model = policy.model
        if is_sharded(model):  # FSDP2: the same architecture, built whole; weights arrive layer by layer
            if hasattr(model, "peft_config"):
                raise ValueError("`model.engine: CopyEngine` under FSDP2 needs a model without adapters "
                                 "(`model.peft`); use the default engine with LoRA under FSDP2")
            from transformers import AutoModelForCausalLM

            device = policy.device if policy.device.type != "meta" else torch.device("cpu")
            engine_model = AutoModelForCausalLM.from_config(base_model(model).config, dtype=self.dtype)
            engine_model.to(device)
        else:
            engine_model = copy.deepcopy(model).to(self.dtype)
        engine_model.requires_grad_(False).eval()
        engine = Policy(engine_model, policy.tokenizer)
        engine.share_prompts = policy.share_prompts
        return engine

    @torch.no_grad()
    def sync_weights(self, policy: Policy) -> None:
        """Copy (and cast) the trained weights into the engine's; only trainable ones under LoRA."""
        if self.copy is None:
            return
        from lightning_rl.sharding import full_value

        mine = dict(self.copy.model.named_parameters())
        peft = hasattr(policy.model, "peft_config")
        for name, param in policy.model.named_parameters():
            if peft and not param.requires_grad:
                continue
            target = mine[name]
            target.copy_(full_value(param.detach()).to(device=target.device, dtype=target.dtype))

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, *, num_samples: int = 1,
                 sampling: SamplingParams, seed: int | None = None) -> Generation:
        if self.copy is None:
            raise RuntimeError("the engine is not attached to a policy: call `attach(policy)` first")
        device_type = prompt_ids.device.type
        # its weights are already in their dtype: an enclosing autocast (bf16-mixed) would only re-cast
        with seeded(seed, prompt_ids.device), torch.autocast(device_type, enabled=False):
            return hf_generate(self.copy, prompt_ids, prompt_mask, num_samples=num_samples, sampling=sampling,
                               compact=self.compact, return_logprobs=not sampling.greedy)
