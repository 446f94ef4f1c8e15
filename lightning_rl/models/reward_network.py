"""Scalar reward models: loading, tokenising and scoring, shared by training and online RL.

A reward model is a Hugging Face ``AutoModelForSequenceClassification`` with one label, plus its
tokenizer. :class:`RewardNetwork` is the trainable pair (``RewardModel`` in
``lightning_rl.algorithms.reward_model`` trains one); :func:`load_reward_network` loads one.
:class:`~lightning_rl.models.reward_model.RewardModelScorer` is a frozen one for online RL, kept out of
the LightningModule's module tree (so out of checkpoints and optimisers).

What is scored: the rendered prompt text followed by the completion text, tokenised as one string (with
the tokenizer's special tokens for plain text, without them for chat-template text; no EOS is appended),
so ``tokenizer(prompt + completion)`` in plain ``transformers`` gives the same ids. Rows longer than
``max_length`` tokens keep their last ``max_length`` tokens: the score is read at the last token, so the
end of the completion must survive.

Which token is read: this module gathers the scalar head's output at the last position whose
``attention_mask`` is 1, and passes ``position_ids = cumsum(mask) - 1``, so left or right padding and a pad
token equal to EOS give the same scores as each row alone. ``transformers``' own pooling instead takes the
last token that is not ``config.pad_token_id`` (set here from the tokenizer) and does not shift positions
under left padding; exported folders write a right-padding tokenizer, with which plain
``AutoModelForSequenceClassification`` gives the same scores as this module whenever a row's last token is
not the pad token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from lightning_rl.models.builtin import build_char_tokenizer, tiny_llama_config
from lightning_rl.models.loading import load_pretrained, torch_dtype
from lightning_rl.models.model_utils import position_ids
from lightning_rl.text.pairs import pad_rows, render_pair

SCORER_KEY = "model.rewards.model"


# ----------------------------------------------------------------------------------------- pure helpers
def last_token_index(attention_mask: Tensor) -> Tensor:
    """``[N]`` long: the last position of each row whose mask is 1 (0 for an all-padding row).

    Works for left and right padding alike: ``argmax(arange(T) * mask)``.
    """
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


def gather_last(values: Tensor, attention_mask: Tensor) -> Tensor:
    """``values[i, last_token_index(mask)[i]]``: ``[N, T]`` -> ``[N]``."""
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, last_token_index(attention_mask).to(values.device)]


@dataclass
class EncodedTexts:
    """Tokenised texts, right-padded.

    Attributes:
        input_ids: ``[N, T]`` long, the pad token after each row's tokens.
        attention_mask: ``[N, T]`` long 0/1, 1 on real tokens.
        truncated: rows that lost tokens on the left (``max_length``).
    """

    input_ids: Tensor
    attention_mask: Tensor
    truncated: int


def encode_texts(
    tokenizer: Any, texts: Sequence[str], *, max_length: int, add_special_tokens: bool | Sequence[bool] = True
) -> EncodedTexts:
    """Tokenise ``texts`` one by one, keep each row's last ``max_length`` tokens and right-pad them.

    Raises:
        ValueError: naming the row, for a text with no tokens.
    """
    flags = [add_special_tokens] * len(texts) if isinstance(add_special_tokens, bool) else add_special_tokens
    rows, cut = [], 0
    for i, (text, flag) in enumerate(zip(texts, flags, strict=True)):
        ids = tokenizer(text, add_special_tokens=flag)["input_ids"]
        if not ids:
            raise ValueError(f"text {i} has no tokens: nothing to score")
        cut += len(ids) > max_length
        rows.append(ids[-max_length:])
    ids, mask = pad_rows(rows, tokenizer.pad_token_id, left=False)
    return EncodedTexts(ids, mask, cut)


def pair_texts(
    tokenizer: Any,
    prompts: Sequence[Any],
    chosen: Sequence[Any],
    rejected: Sequence[Any],
    chat_template: bool,
) -> tuple[list[str], list[bool]]:
    """The ``2B`` texts of ``B`` preference pairs (chosen rows first) and their ``add_special_tokens``
    flags: prompt + completion rendered as in DPO (:func:`~lightning_rl.text.pairs.render_pair`).
    """
    texts, flags = [], []
    for side in (chosen, rejected):
        for prompt, completion in zip(prompts, side, strict=True):
            p_text, c_text, templated = render_pair(tokenizer, prompt, completion, chat_template)
            texts.append(p_text + c_text)
            flags.append(not templated)
    return texts, flags


# ----------------------------------------------------------------------------------------------- model
class RewardNetwork(nn.Module):
    """A one-label sequence-classification model and its tokenizer; its score is the head's output at the
    last real token.

    Args:
        model: an ``AutoModelForSequenceClassification`` model with ``num_labels == 1``.
        tokenizer: its tokenizer. A missing pad token falls back to EOS (with a warning, as ``Policy``
            does); ``model.config.pad_token_id`` is set from it; it is switched to right padding, which is
            what plain ``transformers`` needs to score a padded batch of an exported folder (this class
            pads by itself and does not depend on it).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: Any) -> None:
        super().__init__()
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("the reward model's tokenizer has neither a pad nor an eos token")
            rank_zero_warn(f"The tokenizer has no pad token: padding with EOS {tokenizer.eos_token!r}.")
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # what composite configs pool by
        tokenizer.padding_side = "right"
        self.export_padding_side = "right"  # what sharded export (save_full_pretrained) writes back
        self.model, self.tokenizer = model, tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``[N]`` float32 scores of ``[N, T]`` ids (padded on either side), read at each row's last token.

        The head's per-position outputs are captured from the model's own forward pass (a hook on its
        ``score`` layer, so wrappers such as FSDP2 or PEFT still run their forward hooks) and gathered at
        the last position whose mask is 1. A model without a ``score`` layer falls back to its own pooled
        output (``transformers``' rule: the last token that is not the pad token).
        """
        mask = attention_mask.long()
        kwargs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids(mask),
                  "use_cache": False}
        head = getattr(self.model, "score", None)
        if not isinstance(head, nn.Module):
            return self.model(**kwargs).logits[:, 0].float()
        captured: list[Tensor] = []
        handle = head.register_forward_hook(lambda _module, _args, out: captured.append(out))
        try:
            self.model(**kwargs)
        finally:
            handle.remove()
        return gather_last(captured[-1][..., 0], mask).float()

    def encode(
        self, texts: Sequence[str], *, max_length: int, add_special_tokens: bool | Sequence[bool] = True
    ) -> EncodedTexts:
        """:func:`encode_texts` with this tokenizer, onto this model's device."""
        enc = encode_texts(self.tokenizer, texts, max_length=max_length,
                           add_special_tokens=add_special_tokens)
        return EncodedTexts(enc.input_ids.to(self.device), enc.attention_mask.to(self.device), enc.truncated)

    def save_pretrained(self, path: str) -> None:
        """Write model and tokenizer (right padding) as a folder ``AutoModelForSequenceClassification`` /
        ``AutoTokenizer`` load directly."""
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)


# --------------------------------------------------------------------------------------------- loading
def _check_labels(config: Any, name_or_path: str, key: str) -> None:
    """A sequence-classification checkpoint must have exactly one label (a scalar reward)."""
    archs = getattr(config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in archs) and config.num_labels != 1:
        raise ValueError(
            f"`{key}`: {name_or_path} is a sequence-classification checkpoint with {config.num_labels} "
            "labels; a reward model has exactly one (a scalar score)"
        )


def load_reward_network(
    name_or_path: str, dtype: str | None = None, trust_remote_code: bool = False, *, new_head: bool = True,
    key: str = SCORER_KEY,
) -> RewardNetwork:
    """Load a one-label ``AutoModelForSequenceClassification`` and its tokenizer (``AutoTokenizer``, same
    folder).

    ``name_or_path`` is a reward-model folder or hub id, or a causal LM one (``builtin:tiny-sort`` is the
    embedded causal LM): the backbone weights come from it and the scalar head is fresh (initialised by
    ``transformers``). ``builtin:tiny-scratch`` is the same architecture with every weight fresh.

    Args:
        name_or_path: as above.
        dtype: ``float32``, ``bfloat16``, ``float16``, ``auto`` or None (float32).
        trust_remote_code: allow model code from the hub.
        new_head: allow a fresh head (training does); False refuses anything but a trained reward model.
        key: the config key named in errors.

    Raises:
        FileNotFoundError / NotADirectoryError: a local path that is missing or not a model folder.
        ConnectionError: a hub id while the hub is unreachable and the id is not cached.
        ValueError: an unknown dtype or ``builtin:`` name; more than one label; a fresh head when
            ``new_head`` is False; backbone weights that did not load (an architecture mismatch).
    """
    dtype_arg = torch_dtype(dtype, key)
    if name_or_path == "builtin:tiny-scratch":
        return _scratch_network(name_or_path, dtype_arg, new_head, key)
    load = _checkpoint_loader(name_or_path, dtype_arg, trust_remote_code, key)
    config, model, info, tokenizer = load_pretrained(
        name_or_path, load, key=key, local_hint="a local reward-model folder"
    )
    _check_loaded(model, info, name_or_path, new_head, config, key)
    return RewardNetwork(model, tokenizer)


def _scratch_network(
    name_or_path: str, dtype_arg: torch.dtype | str, new_head: bool, key: str
) -> RewardNetwork:
    """``builtin:tiny-scratch``: the embedded architecture with one label, every weight fresh (refused
    unless ``new_head``)."""
    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(tokenizer)
    config.num_labels = 1
    _refuse_new_head(new_head, name_or_path, "freshly initialised", key)
    model = AutoModelForSequenceClassification.from_config(config)
    return RewardNetwork(model.to(dtype_arg) if dtype_arg != "auto" else model, tokenizer)


def _checkpoint_loader(
    name_or_path: str, dtype_arg: torch.dtype | str, trust_remote_code: bool, key: str
) -> Callable[[str, bool], tuple[Any, PreTrainedModel, dict[str, Any], Any]]:
    """The ``load(source, offline)`` that :func:`~lightning_rl.models.loading.load_pretrained` calls: the
    config (its labels checked), the one-label model with its loading info, and the tokenizer."""

    def load(source: str, offline: bool) -> tuple[Any, PreTrainedModel, dict[str, Any], Any]:
        kwargs = {"trust_remote_code": trust_remote_code, "local_files_only": offline}
        config = AutoConfig.from_pretrained(source, **kwargs)
        _check_labels(config, name_or_path, key)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            source, num_labels=1, output_loading_info=True, dtype=dtype_arg, **kwargs
        )
        return config, model, info, AutoTokenizer.from_pretrained(source, **kwargs)

    return load


def _refuse_new_head(new_head: bool, name_or_path: str, arch: str, key: str) -> None:
    if not new_head:
        raise ValueError(
            f"`{key}`: {name_or_path} is not a reward model but a {arch} checkpoint: a "
            "sequence-classification head on it would be random. Train one (`lightning-rl fit --config "
            f"configs/reward_model.yaml`) and set `{key}` to its export folder (<log_dir>/reward_model)"
        )


def _check_loaded(
    model: PreTrainedModel, info: dict[str, Any], name_or_path: str, new_head: bool, config: Any, key: str
) -> None:
    """Only the head (weights outside the backbone, ``base_model_prefix``) may be missing from the
    checkpoint, and only when ``new_head``."""
    missing = set(info.get("missing_keys") or ())
    backbone = sorted(k for k in missing if k.startswith(f"{model.base_model_prefix}."))
    if backbone:
        raise ValueError(
            f"`{key}`: {name_or_path} did not provide the backbone weights of {type(model).__name__} "
            f"(missing {backbone[:5]}{' ...' if len(backbone) > 5 else ''})"
        )
    if missing:
        archs = getattr(config, "architectures", None) or ["unknown"]
        _refuse_new_head(new_head, name_or_path, archs[0], key)
        rank_zero_info(
            f"reward model: backbone from {name_or_path}, fresh scalar head ({type(model).__name__})"
        )
