"""Policy: a Hugging Face causal LM plus its tokenizer, with batched sampling and per-token log-probs.

Shapes used throughout: ``N`` rows (prompts x samples), ``P`` prompt length (left-padded), ``C``
completion length (right-padded), ``V`` vocabulary size.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from packaging.version import Version
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from lightning_rl.sampling import sample_compacting
from lightning_rl.scoring import (
    ReferencePolicy,
    TokenScorer,
    base_model,
    cache_argument,
    disable_dropout,
    eval_mode,
    returned_cache,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
# transformers renamed `torch_dtype` to `dtype` in 4.56; we support older releases too.
_DTYPE_KWARG = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


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
        logits: ``[N, C, V]`` float, the raw (untempered, unfiltered) logits that produced each
            completion token; only when ``Policy.generate(return_logits=True)``, else None.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    logits: Tensor | None = None

    @property
    def lengths(self) -> Tensor:
        """``[N]`` long: number of completion tokens, EOS included."""
        return self.completion_mask.sum(-1)


def completion_mask(completion_ids: Tensor, eos_token_id: int) -> tuple[Tensor, Tensor]:
    """Mask of the tokens up to and including the first EOS of each row.

    Args:
        completion_ids: ``[N, C]`` sampled tokens.
        eos_token_id: the token that ends a completion.

    Returns:
        ``(mask, truncated)``: ``[N, C]`` long 0/1 and ``[N]`` bool (no EOS in the row).
    """
    is_eos = (completion_ids == eos_token_id).long()
    # EOS tokens strictly before each position: zero until just after the first EOS.
    eos_before = is_eos.cumsum(-1) - is_eos
    return (eos_before == 0).long(), is_eos.sum(-1) == 0


def _keep_one(model: nn.Module) -> dict[str, int]:
    """Only the last position's logits, for models whose forward takes ``logits_to_keep``."""
    params = inspect.signature(base_model(model).forward).parameters
    return {name: 1 for name in ("logits_to_keep", "num_logits_to_keep") if name in params}


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


@contextmanager
def _plain_generation_config(model: nn.Module) -> Iterator[None]:
    """Hide the checkpoint's ``generation_config.json`` during ``generate``.

    transformers fills every option we leave unset from it (repetition_penalty, min_p, extra EOS
    ids, ...), which would make sampling differ from the distribution ``token_logprobs`` scores.
    """
    base = base_model(model)
    saved = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


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

    # sample with lightning_rl.sampling's loop (prefill once per prompt, finished rows leave the batch)
    # instead of transformers' generate; OnlineRL turns it on with `share_prompt_prefix`
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

        This is the plain ``transformers`` call; ``lightning_rl.models.load_policy`` adds the checks for
        missing folders and an unreachable hub.

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
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or None, got {dtype!r}")
        kwargs = {_DTYPE_KWARG: _DTYPES[dtype or "float32"], "trust_remote_code": trust_remote_code,
                  "local_files_only": local_files_only}
        if revision is not None:
            kwargs["revision"] = revision
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        if local_files_only:  # transformers does not pass it on to its PEFT adapter lookup (which retries)
            kwargs["adapter_kwargs"] = {"local_files_only": True}
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

    def enable_gradient_checkpointing(self) -> None:
        """Recompute activations in backward. Non-reentrant, so frozen (e.g. PEFT) inputs work."""
        kwargs = {"use_reentrant": False}
        # transformers 5.x renamed the method (the old name warns); older releases only have the old one.
        if hasattr(self.model, "activation_checkpointing_enable"):
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

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

    @torch.no_grad()
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
        """Sample ``num_samples`` completions per prompt in one batched, KV-cached ``generate`` call.

        Greedy when ``do_sample`` is False or ``temperature`` is 0. Only temperature, top-k and
        top-p shape the distribution (the checkpoint's generation config is ignored), so
        ``token_logprobs`` with the same settings scores exactly what was sampled.

        Args:
            prompt_ids: ``[B, P]`` left-padded prompts; ``prompt_mask`` 1 on real tokens.
            num_samples: completions per prompt (``G``); the rows of a prompt are consecutive.
            max_new_tokens: completion length limit.
            temperature: sampling temperature; ``top_p`` (1.0 = off) and ``top_k`` (0 = off) filter.
            do_sample: False for greedy decoding.
            synced_gpus: keep stepping until every rank is done (needed under FSDP / ZeRO-3).
            return_logits: also return the raw logits (``N*C*V`` floats: for tests and debugging).

        Returns:
            A ``Generation`` with ``N = B * num_samples`` rows.
        """
        if num_samples < 1 or max_new_tokens < 1 or temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
            raise ValueError(
                f"invalid sampling settings: num_samples={num_samples}, max_new_tokens={max_new_tokens}, "
                f"temperature={temperature}, top_k={top_k}, top_p={top_p}"
            )
        if self.compact_sampling and not synced_gpus and not return_logits:
            prompt_ids = prompt_ids.repeat_interleave(num_samples, dim=0)
            prompt_mask = prompt_mask.repeat_interleave(num_samples, dim=0)
            with eval_mode(self.model):
                completion_ids = sample_compacting(
                    self.model, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens,
                    eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id, temperature=temperature,
                    top_k=top_k, top_p=top_p, do_sample=do_sample)
            return self._generation(prompt_ids, prompt_mask, completion_ids, None)
        prefix = {}
        if num_samples > 1 and prompt_ids.shape[1] > 1 and self.share_prompts:
            prefix = self._prefilled(prompt_ids, prompt_mask, num_samples)
        prompt_ids = prompt_ids.repeat_interleave(num_samples, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(num_samples, dim=0)
        sampling = {"do_sample": False}
        if do_sample and temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": top_p}
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
            return_dict_in_generate=True,
            output_logits=return_logits,
            **sampling,
        )
        # Eval mode: no dropout while sampling (and gradient checkpointing would turn the cache off).
        with eval_mode(self.model), _plain_generation_config(self.model):
            out = self.model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                generation_config=config,
                synced_gpus=synced_gpus,
                **prefix,
            )
        logits = torch.stack(out.logits, dim=1) if return_logits else None
        return self._generation(prompt_ids, prompt_mask, out.sequences[:, prompt_ids.shape[1] :], logits)

    def _generation(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, logits: Tensor | None
    ) -> Generation:
        mask, truncated = completion_mask(completion_ids, self.eos_token_id)
        return Generation(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask.long(),
            completion_ids=completion_ids.masked_fill(mask == 0, self.pad_token_id),
            completion_mask=mask,
            truncated=truncated,
            logits=logits,
        )

    @torch.no_grad()
    def _prefilled(self, prompt_ids: Tensor, prompt_mask: Tensor, num_samples: int) -> dict[str, Any]:
        """``generate``'s cache argument holding every prompt but its last token, computed once per prompt
        and repeated for its ``num_samples`` rows (``generate`` then runs only the last prompt token, where
        it would otherwise run every prompt ``num_samples`` times)."""
        ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1].long()
        with eval_mode(self.model):
            out = self.model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                             use_cache=True, **_keep_one(self.model))
        cache = returned_cache(out)
        cache.batch_repeat_interleave(num_samples)
        return {cache_argument(self.model): cache}

    def _scoring(self) -> tuple[nn.Module, AbstractContextManager]:
        return self.model, nullcontext()

    def reference(self) -> ReferencePolicy:
        """A frozen reference: the PEFT model with adapters disabled, else a deep copy of the model."""
        if _is_peft(self.model):
            return ReferencePolicy(self.model, shares_weights=True)
        return ReferencePolicy(copy.deepcopy(self.model), shares_weights=False)

    def save_pretrained(self, path: str, *, merged: bool = False) -> None:
        """Write model and tokenizer to ``path`` (loadable with the Auto classes or ``from_pretrained``).

        A PEFT model writes its adapter only (peft's format: ``PeftModel.from_pretrained`` on the base
        model, or ``AutoPeftModelForCausalLM``), or with ``merged`` the weights with the adapters merged in, a
        plain folder for ``AutoModelForCausalLM``. The tokenizer is written with the ``padding_side`` it came
        with (left padding is only what generation here needs).
        """
        if merged and _is_peft(self.model):
            from lightning_rl.adapters import merged_model

            merged_model(self.model, self.model.state_dict()).save_pretrained(path)
        else:
            self.model.save_pretrained(path)
        self.tokenizer.padding_side = self.export_padding_side
        try:
            self.tokenizer.save_pretrained(path)
        finally:
            self.tokenizer.padding_side = "left"
