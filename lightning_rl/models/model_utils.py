"""Helpers around a ``transformers`` model's forward pass, shared by scoring, sampling and generation.

Position ids under left padding, dropout and train / eval modes, the model under a PEFT wrapper, the
``logits_to_keep`` and KV-cache argument names across ``transformers`` versions, generate's top-k / top-p
filter, and gradient checkpointing.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import TopKLogitsWarper, TopPLogitsWarper

# the one table from a config's dtype name to torch's (``from_pretrained`` also takes ``auto``, the
# checkpoint's own: ``lightning_rl.models.loading.FROM_PRETRAINED_DTYPES``)
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}


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


def cache_argument(model: nn.Module) -> str:
    """The name under which ``model`` takes a KV cache: ``cache`` (``transformers`` 5.24+, where
    ``past_key_values`` is a deprecated alias) or ``past_key_values`` (5.0-5.23)."""
    named = "cache" in inspect.signature(base_model(model).forward).parameters
    return "cache" if named else "past_key_values"


def returned_cache(out: Any) -> Any:
    """The KV cache of a model output, under either name (see :func:`cache_argument`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
