"""Scoring completion tokens: per-token log-probs from one forward pass, and the frozen reference.

``TokenScorer.token_logprobs`` is shared by the trained :class:`~lightning_rl.models.policy.Policy` and the
:class:`ReferencePolicy` (a frozen copy, or the PEFT policy with its adapters disabled).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rl.models.heads import head_logprobs, scatter_rows
from lightning_rl.models.model_utils import (
    base_model,
    cache_argument,
    eval_mode,
    filter_logits,
    keep_logits,
    position_ids,
    returned_cache,
)
from lightning_rl.models.packing import packable, packed_logprobs, probe_rows, refuse_crossing


def _completion_logits(
    model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
    completion_mask: Tensor,
) -> Tensor:
    """``[N, C, V]`` logits predicting each completion token, from one forward over prompt + completion."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    # Position t predicts token t+1: completion tokens come from positions P-1 .. P+C-2. Asking
    # the model for the last C+1 positions only skips the [N, P, V] prompt logits.
    keep = completion_ids.shape[1] + 1
    out = model(input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                use_cache=False, **keep_logits(model, keep))
    return out.logits[:, -keep:-1]


def shared_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(first, inverse)`` when rows repeat prompts (a group's G samples): ``first`` indexes one row per
    distinct prompt, ``inverse`` maps each row to its distinct prompt. ``None`` when every prompt differs."""
    rows = torch.cat([prompt_ids * prompt_mask, prompt_mask], dim=1)
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if len(distinct) == len(rows):
        return None
    first = torch.full((len(distinct),), len(rows), dtype=torch.long, device=rows.device)
    first = first.scatter_reduce(0, inverse, torch.arange(len(rows), device=rows.device), reduce="amin")
    return first, inverse


def _prefix_shared_logits(
    model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
    completion_mask: Tensor, first: Tensor, inverse: Tensor,
) -> Tensor:
    """The logits of :func:`_completion_logits`, with each distinct prompt run through the model once.

    The prompts' keys and values (and the logits of their last position, which predict the first
    completion token) are computed once per distinct prompt and indexed out to its rows; the completions
    then run on top of that cache. Gradients flow through the shared prefix into every row's loss, so the
    result and its gradient equal the one-pass form (to float rounding).
    """
    prefix = model(prompt_ids[first], attention_mask=prompt_mask[first].long(),
                   position_ids=position_ids(prompt_mask[first]), use_cache=True, **keep_logits(model, 1))
    cache = returned_cache(prefix)
    cache.batch_select_indices(inverse)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    lengths = prompt_mask.long().sum(1, keepdim=True)
    steps = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    keep = keep_logits(model, completion_ids.shape[1])
    out = model(completion_ids, attention_mask=attention_mask, position_ids=lengths + steps, use_cache=True,
                **{cache_argument(model): cache}, **keep)
    return torch.cat([prefix.logits[:, -1:][inverse], out.logits[:, :-1]], dim=1)


# causal LMs whose logits are exactly ``lm_head(decoder(...).last_hidden_state)`` (no scaling or capping)
PLAIN_HEAD_MODELS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def split_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """``(decoder, lm_head)`` of a causal LM in :data:`PLAIN_HEAD_MODELS` (a PEFT model around one too:
    its adapters live inside those modules), so the head can run on chosen positions only; else None."""
    base = base_model(model)
    if type(base).__name__ not in PLAIN_HEAD_MODELS:
        return None
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    return (decoder, head) if isinstance(head, nn.Linear) else None


def _valid_position_logprobs(
    split: tuple[nn.Module, nn.Linear], prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
    completion_mask: Tensor, temperature: float, top_k: int, top_p: float, with_entropy: bool,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``token_logprobs`` with each distinct prompt run once and the output layer (and the softmax over
    the vocabulary) applied only at the completion's real tokens, not at its padding; with ``chunk``,
    over that many tokens at a time (their fp32 logits recomputed in the backward, never all kept).

    Entropy is 0 on padding. The same values and gradients as the one-pass form, to float rounding.
    """
    decoder, head = split
    shared = shared_prompts(prompt_ids, prompt_mask)
    first, inverse = shared if shared is not None else (torch.arange(len(prompt_ids)), None)
    mask = prompt_mask.long()
    prefix = decoder(prompt_ids[first], attention_mask=mask[first], position_ids=position_ids(mask[first]),
                     use_cache=True)
    cache = returned_cache(prefix)
    last = prefix.last_hidden_state[:, -1:]
    if inverse is not None:
        cache.batch_select_indices(inverse)
        last = last[inverse]
    steps = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    out = decoder(completion_ids, attention_mask=torch.cat([mask, completion_mask.long()], dim=1),
                  position_ids=mask.sum(1, keepdim=True) + steps, use_cache=True,
                  **{cache_argument(decoder): cache})
    hidden = torch.cat([last, out.last_hidden_state[:, :-1]], dim=1)  # the states predicting each token
    valid = completion_mask.bool()
    logp, entropy = head_logprobs(head, hidden[valid], completion_ids[valid], temperature=temperature,
                                  top_k=top_k, top_p=top_p, with_entropy=with_entropy, chunk=chunk)
    return scatter_rows(valid, logp), None if entropy is None else scatter_rows(valid, entropy)


def _all_completion_logits(
    model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
    completion_mask: Tensor, share_prompts: bool,
) -> Tensor:
    """``[N, C, V]`` completion logits: with each distinct prompt run once (:func:`_prefix_shared_logits`)
    when ``share_prompts`` and rows repeat prompts, else from one forward over prompt + completion."""
    shared = shared_prompts(prompt_ids, prompt_mask) if share_prompts else None
    if shared is not None:
        return _prefix_shared_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *shared)
    return _completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)


def _logprobs_from_logits(
    logits: Tensor, completion_ids: Tensor, completion_mask: Tensor, temperature: float, top_k: int,
    top_p: float, with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """``(logp, entropy)`` of the completion tokens from their ``[N, C, V]`` logits: tempered, then
    top-k / top-p filtered; 0 on masked positions (entropy: None unless ``with_entropy``)."""
    logits = logits.float() / temperature
    if top_k > 0 or top_p < 1.0:
        logits = filter_logits(logits, top_k, top_p)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    # Padding may hold tokens filtered to -inf: keep masked positions finite for the callers' sums.
    logp = logp.masked_fill(completion_mask == 0, 0.0)
    if not with_entropy:
        return logp, None
    # Filtered tokens have p = 0 and log p = -inf: count them as 0, not NaN.
    return logp, -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)


class TokenScorer(nn.Module):
    """Scores completion tokens with ``self._scoring()``'s model; shared by policy and reference.

    ``share_prompts``: run each distinct prompt once per forward and reuse its keys and values for all the
    rows that repeat it (a group's samples), instead of once per row; same log-probs and gradients.
    """

    share_prompts: bool = False
    logprob_chunk: int | None = None  # tokens per chunk of the output layer where it runs apart, None: all
    packing: bool = False  # rows packed into one sequence (lightning_rl.models.packing); before share_prompts

    def _scoring(self) -> tuple[nn.Module, AbstractContextManager]:
        raise NotImplementedError

    def token_logprobs(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, *,
        temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, with_entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probs of the completion tokens, from one forward pass over prompt + completion.

        Pass the ``temperature`` that sampled the tokens. ``top_k`` / ``top_p`` score the filtered,
        renormalised distribution exactly as ``generate`` sampled it; the RL step does not use them
        (``OnlineRL`` scores current, behaviour and reference log-probs unfiltered), because under a
        filter a token outside another model's kept set scores ``-inf``.

        Args:
            prompt_ids: ``[N, P]`` left-padded prompt tokens; ``prompt_mask`` 1 on real ones.
            completion_ids: ``[N, C]`` completion tokens; ``completion_mask`` 1 on real ones.
            temperature: sampling temperature (> 0).
            top_k: top-k filter (0 = off).
            top_p: top-p filter (1.0 = off).
            with_entropy: also return the entropy of each position's distribution.

        Returns:
            ``(logp, entropy)``: ``[N, C]`` float32 (0 on masked positions), and ``[N, C]`` float32
            or None.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
        model, context = self._scoring()
        if self.packing and packable(prompt_mask, completion_mask):
            with context:
                return packed_logprobs(model, split_head(model), prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, temperature=temperature, top_k=top_k, top_p=top_p,
                                       with_entropy=with_entropy, chunk=self.logprob_chunk)
        return self._padded_logprobs(model, context, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                     temperature, top_k, top_p, with_entropy)

    def _padded_logprobs(
        self, model: nn.Module, context: AbstractContextManager, prompt_ids: Tensor, prompt_mask: Tensor,
        completion_ids: Tensor, completion_mask: Tensor, temperature: float, top_k: int, top_p: float,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """``token_logprobs`` of padded (not packed) rows, the model run under ``context``: under
        ``share_prompts`` with a model whose output layer runs apart, only the valid positions go through it
        (:func:`_valid_position_logprobs`); else from the ``[N, C, V]`` completion logits."""
        split = split_head(model) if self.share_prompts else None
        if split is not None:
            with context:
                return _valid_position_logprobs(split, prompt_ids, prompt_mask, completion_ids,
                                                completion_mask, temperature, top_k, top_p, with_entropy,
                                                self.logprob_chunk)
        with context:
            logits = _all_completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                            self.share_prompts)
        return _logprobs_from_logits(logits, completion_ids, completion_mask, temperature, top_k, top_p,
                                     with_entropy)

    def check_packing(self) -> None:
        """Refuse ``packing`` (one line) where this model's packed log-probs are not its padded ones: every
        rank runs the same two-row probe at once (under sharded weights its forwards are collectives)."""
        model, context = self._scoring()
        rows = probe_rows(model)
        with context, torch.no_grad():
            padded, _ = _logprobs_from_logits(_completion_logits(model, *rows), rows[2], rows[3], 1.0, 0, 1.0,
                                              False)
            packed, _ = packed_logprobs(model, split_head(model), *rows, temperature=1.0)
        refuse_crossing(model, padded, packed)

    def forward(self, *args: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """Same as ``token_logprobs``, so that DDP / FSDP wrappers route through it."""
        return self.token_logprobs(*args, **kwargs)


class ReferencePolicy(TokenScorer):
    """The frozen reference policy for KL terms and DPO; ``token_logprobs`` never tracks gradients.

    Either owns a frozen copy of the policy's model (a registered submodule, so ``.to()`` moves it),
    or, for a PEFT model, runs the policy's own model with the adapters disabled: no second copy.
    """

    def __init__(self, model: nn.Module, *, shares_weights: bool) -> None:
        super().__init__()
        self.shares_weights = shares_weights
        if shares_weights:
            # Not registered: the weights belong to the policy (no duplicate in state_dict / .to()).
            self.__dict__["_shared_model"] = model
        else:
            self.model = model.requires_grad_(False).eval()

    def train(self, mode: bool = True) -> ReferencePolicy:
        """Stay in eval mode: a parent's ``.train()`` must not turn dropout on in the reference."""
        return super().train(False)

    @contextmanager
    def _frozen(self, model: nn.Module) -> Iterator[None]:
        adapters_off = model.disable_adapter() if self.shares_weights else nullcontext()
        # The shared model is in train mode while the policy trains: no dropout for the reference.
        with torch.no_grad(), adapters_off, eval_mode(model):
            yield

    def _scoring(self) -> tuple[nn.Module, AbstractContextManager]:
        model = self.__dict__["_shared_model"] if self.shares_weights else self.model
        return model, self._frozen(model)
