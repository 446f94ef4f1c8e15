"""Policy: a Hugging Face causal LM plus its tokenizer, with batched sampling and per-token log-probs.

Shapes used throughout: ``N`` rows (prompts x samples), ``P`` prompt length (left-padded), ``C``
completion length (right-padded), ``V`` vocabulary size.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lightning_rl.models.adapters import is_peft_model
from lightning_rl.models.generation import Generation, SamplingParams, completion_mask, hf_generate
from lightning_rl.models.loading import FROM_PRETRAINED_DTYPES
from lightning_rl.models.model_utils import disable_dropout, enable_gradient_checkpointing
from lightning_rl.models.scoring import ReferencePolicy, TokenScorer

__all__ = ["Generation", "Policy", "completion_mask"]

def _model_kwargs(
    dtype: str | None, trust_remote_code: bool, revision: str | None, attn_implementation: str | None,
    local_files_only: bool,
) -> dict[str, Any]:
    """``AutoModelForCausalLM.from_pretrained``'s keyword arguments for :meth:`Policy.from_pretrained`.

    Raises:
        ValueError: on an unknown ``dtype``.
    """
    if dtype is not None and dtype not in FROM_PRETRAINED_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(FROM_PRETRAINED_DTYPES)} or None, got {dtype!r}")
    kwargs = {"dtype": FROM_PRETRAINED_DTYPES[dtype or "float32"], "trust_remote_code": trust_remote_code,
              "local_files_only": local_files_only}
    if revision is not None:
        kwargs["revision"] = revision
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if local_files_only:  # transformers does not pass it on to its PEFT adapter lookup (which retries)
        kwargs["adapter_kwargs"] = {"local_files_only": True}
    return kwargs


class Policy(TokenScorer):
    """A Hugging Face causal LM plus its tokenizer.

    Args:
        model: the causal LM (a ``PreTrainedModel``, or a ``peft.PeftModel`` around one).
        tokenizer: its tokenizer. It is switched to left padding (generation appends on the right);
            :meth:`save_pretrained` writes its original ``padding_side`` back. A missing pad token falls
            back to the EOS token (with a warning).

    Raises:
        ValueError: if the tokenizer has no EOS token (generation could never stop).
    """

    # `generate` samples with lightning_rl.models.sampling's loop (prefill once per prompt, finished rows
    # leave the
    # batch) instead of transformers' generate
    compact_sampling: bool = False

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__()
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token: set one so that generation can stop")
        if tokenizer.pad_token_id is None:
            rank_zero_warn(f"The tokenizer has no pad token: padding with EOS {tokenizer.eos_token!r}.")
            tokenizer.pad_token = tokenizer.eos_token
        # The user's padding side, written back by save_pretrained; kept on the tokenizer too, so a Policy
        # rebuilt around this tokenizer (e.g. after wrapping the model with PEFT) still knows it.
        self.export_padding_side = getattr(tokenizer, "_export_padding_side", tokenizer.padding_side)
        tokenizer._export_padding_side = self.export_padding_side
        tokenizer.padding_side = "left"  # generation appends on the right
        self.model = model
        self.tokenizer = tokenizer
        # transformers loads models in eval mode; follow the nn.Module convention instead.
        self.train()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        dtype: str | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
        tokenizer_name_or_path: str | None = None,
        attn_implementation: str | None = None,
        local_files_only: bool = False,
    ) -> Policy:
        """Load a hub id or a local folder with ``AutoModelForCausalLM`` and ``AutoTokenizer``.

        This is the plain ``transformers`` call; ``lightning_rl.models.loading.load_policy`` adds the checks
        for missing folders and an unreachable hub.

        Args:
            name_or_path: hub id or local folder.
            dtype: ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"`` (the checkpoint's dtype),
                or None for float32 (transformers 5 alone would default to ``"auto"``).
            trust_remote_code: allow custom modelling code from the checkpoint.
            revision: branch, tag or commit of the checkpoint (and of its tokenizer).
            tokenizer_name_or_path: load the tokenizer from elsewhere.
            attn_implementation: e.g. ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``.
            local_files_only: use only local folders and the hub cache, never the network.

        Raises:
            ValueError: on an unknown ``dtype``.
        """
        kwargs = _model_kwargs(dtype, trust_remote_code, revision, attn_implementation, local_files_only)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
        tok_kwargs = {"trust_remote_code": trust_remote_code, "local_files_only": local_files_only}
        if tokenizer_name_or_path is None and revision is not None:
            tok_kwargs["revision"] = revision
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name_or_path or name_or_path, **tok_kwargs)
        return cls(model, tokenizer)

    @classmethod
    def from_config(cls, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> Policy:
        """A randomly initialised model of the given config (tests, from-scratch runs)."""
        return cls(AutoModelForCausalLM.from_config(config), tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model takes (``max_position_embeddings``), when its config says."""
        config = getattr(self.model, "config", None)
        value = getattr(config, "max_position_embeddings", None)
        return value if isinstance(value, int) else None

    def enable_gradient_checkpointing(self) -> None:
        """Recompute activations in backward (non-reentrant: frozen PEFT inputs work)."""
        enable_gradient_checkpointing(self.model)

    def disable_dropout(self) -> None:
        """Set every dropout probability to 0, so train-mode log-probs match sampling-time ones."""
        disable_dropout(self.model)

    def encode_prompts(
        self,
        prompts: list[str],
        max_prompt_length: int | None = None,
        *,
        add_special_tokens: bool | Sequence[bool] = True,
    ) -> tuple[Tensor, Tensor]:
        """Tokenise and left-pad prompts onto the model's device; ``add_special_tokens`` for all or per row.

        Returns:
            ``(prompt_ids, prompt_mask)``, both ``[len(prompts), P]`` long.

        Raises:
            ValueError: naming the row, for an empty prompt or one longer than ``max_prompt_length``
                tokens (prompts are never truncated silently).
        """
        flags = add_special_tokens
        if isinstance(flags, bool):
            flags = [flags] * len(prompts)
        pairs = zip(prompts, flags, strict=True)
        rows = [self.tokenizer(p, add_special_tokens=f)["input_ids"] for p, f in pairs]
        enc = self.tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
        for row, length in enumerate(enc["attention_mask"].sum(-1).tolist()):
            if length == 0 or not prompts[row]:
                raise ValueError(f"prompt {row} is empty")
            if max_prompt_length is not None and length > max_prompt_length:
                raise ValueError(
                    f"prompt {row} has {length} tokens, more than max_prompt_length={max_prompt_length}"
                )
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    def generate(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        num_samples: int = 1,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        do_sample: bool = True,
        synced_gpus: bool = False,
        return_logits: bool = False,
    ) -> Generation:
        """Sample ``num_samples`` completions per prompt with this model (a convenience for scripts and
        tests; training, validation and predict sample through the module's rollout engine).

        Greedy when ``do_sample`` is False or ``temperature`` is 0. Only temperature, top-k and top-p shape
        the distribution (the checkpoint's generation config is ignored), so ``token_logprobs`` with the
        same settings scores exactly what was sampled. ``synced_gpus``: keep stepping until every rank is
        done (sharded weights). ``return_logits``: also the raw logits (``N*C*V`` floats). The samples of
        prompt ``i`` are rows ``i*G .. i*G+G-1``. See :func:`lightning_rl.models.generation.hf_generate`.
        """
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  top_k=top_k, do_sample=do_sample)
        return hf_generate(self, prompt_ids, prompt_mask, num_samples=num_samples, sampling=sampling,
                           compact=self.compact_sampling, synced_gpus=synced_gpus,
                           return_logits=return_logits)

    def _scoring(self) -> tuple[nn.Module, AbstractContextManager]:
        return self.model, nullcontext()

    def reference(self) -> ReferencePolicy:
        """A frozen reference: the PEFT model with adapters disabled, else a deep copy of the model."""
        if is_peft_model(self.model):
            return ReferencePolicy(self.model, shares_weights=True)
        return ReferencePolicy(copy.deepcopy(self.model), shares_weights=False)

    def save_pretrained(self, path: str, *, merged: bool = False) -> None:
        """Write model and tokenizer to ``path`` (loadable with the Auto classes or ``from_pretrained``).

        A PEFT model writes its adapter only (peft's format: ``PeftModel.from_pretrained`` on the base
        model, or ``AutoPeftModelForCausalLM``), or with ``merged`` the weights with the adapters merged in, a
        plain folder for ``AutoModelForCausalLM``. The tokenizer is written with the ``padding_side`` it came
        with (left padding is only what generation here needs).
        """
        if merged and is_peft_model(self.model):
            from lightning_rl.models.adapters import merged_model

            merged_model(self.model, self.model.state_dict()).save_pretrained(path)
        else:
            self.model.save_pretrained(path)
        self.tokenizer.padding_side = self.export_padding_side
        try:
            self.tokenizer.save_pretrained(path)
        finally:
            self.tokenizer.padding_side = "left"
