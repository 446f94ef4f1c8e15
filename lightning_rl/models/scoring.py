"""Scoring completion tokens: per-token log-probs from one forward pass, and the frozen reference.

``TokenScorer.token_logprobs`` is shared by the trained :class:`~lightning_rl.models.policy.Policy` and the
:class:`ReferencePolicy` (a frozen copy, or the PEFT policy with its adapters disabled).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from transformers import TopKLogitsWarper, TopPLogitsWarper


def position_ids(mask: Tensor) -> Tensor:
    """Position ids that count real tokens only: ``cumsum(mask) - 1``, 0 on left padding.

    Left padding shifts every token; models with absolute positions (GPT-2) are off by ~0.4 nats
    without this, and rotary models differ slightly. ``mask`` is ``[N, L]`` 0/1 (or bool).
    """
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Run without dropout, then restore each submodule's own mode (they may differ)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability of ``model`` to 0, so train-mode forwards match eval-mode ones."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0  # Llama-style attention reads a float, not a module


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (the one owning ``generation_config``)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """Apply top-k then top-p exactly as ``generate`` does (same HF warpers, same order)."""
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])  # the warpers expect [batch, vocab]
    if top_k > 0:
        flat = TopKLogitsWarper(top_k=top_k)(None, flat)
    if top_p < 1.0:
        flat = TopPLogitsWarper(top_p=top_p)(None, flat)
    return flat.reshape(shape)


def keep_logits(model: nn.Module, keep: int) -> dict[str, int]:
    """``{"logits_to_keep": keep}`` for models whose forward takes it (every causal LM of ``transformers``
    5), else ``{}``: spread into a forward call so the LM head runs on the last ``keep`` positions only."""
    params = inspect.signature(base_model(model).forward).parameters
    return {"logits_to_keep": keep} if "logits_to_keep" in params else {}


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute ``model``'s activations in backward (a ``transformers`` model, or PEFT around one).

    Non-reentrant, so inputs that need no gradient (frozen embeddings under PEFT) still give gradients to
    the layers after them. ``transformers`` 5.23 renamed the method to ``activation_checkpointing_enable``
    (the old name warns from then on); 5.0-5.22 have only ``gradient_checkpointing_enable``.
    """
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_gradient_checkpointing(model: nn.Module) -> bool:
    """Whether activation (gradient) checkpointing is on anywhere in ``model``.

    Reads the ``gradient_checkpointing`` flag that ``transformers`` sets on its layers (what both
    ``is_activation_checkpointing``, 5.23+, and the older ``is_gradient_checkpointing`` read), so it
    needs no version branch and does not warn.
    """
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


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


def cache_argument(model: nn.Module) -> str:
    """The name under which ``model`` takes a KV cache: ``cache`` (``transformers`` 5.24+, where
    ``past_key_values`` is a deprecated alias) or ``past_key_values`` (5.0-5.23)."""
    named = "cache" in inspect.signature(base_model(model).forward).parameters
    return "cache" if named else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The KV cache of a model output, under either name (see :func:`cache_argument`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


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
) -> tuple[Tensor, Tensor | None]:
    """``token_logprobs`` with each distinct prompt run once and the output layer (and the softmax over
    the vocabulary) applied only at the completion's real tokens, not at its padding.

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
    logits = head(hidden[valid]).float() / temperature
    if top_k > 0 or top_p < 1.0:
        logits = filter_logits(logits, top_k, top_p)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.new_zeros(valid.shape).masked_scatter(
        valid, logp_all.gather(-1, completion_ids[valid].unsqueeze(-1)).squeeze(-1))
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
    return logp, logp_all.new_zeros(valid.shape).masked_scatter(valid, entropy)


class TokenScorer(nn.Module):
    """Scores completion tokens with ``self._scoring()``'s model; shared by policy and reference.

    ``share_prompts``: run each distinct prompt once per forward and reuse its keys and values for all the
    rows that repeat it (a group's samples), instead of once per row; same log-probs and gradients.
    """

    share_prompts: bool = False

    def _scoring(self) -> tuple[nn.Module, AbstractContextManager]:
        raise NotImplementedError

    def token_logprobs(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        with_entropy: bool = False,
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
        split = split_head(model) if self.share_prompts else None
        if split is not None:
            with context:
                return _valid_position_logprobs(split, prompt_ids, prompt_mask, completion_ids,
                                                completion_mask, temperature, top_k, top_p, with_entropy)
        with context:
            shared = shared_prompts(prompt_ids, prompt_mask) if self.share_prompts else None
            if shared is not None:
                logits = _prefix_shared_logits(model, prompt_ids, prompt_mask, completion_ids,
                                               completion_mask, *shared)
            else:
                logits = _completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
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
