"""Scalar reward models: loading, tokenising and scoring, shared by training and online RL.

A reward model is a Hugging Face ``AutoModelForSequenceClassification`` with one label, plus its
tokenizer. :class:`RewardNetwork` is the trainable pair (``RewardModel`` in
``lightning_rl.algorithms.reward_model`` trains one); :class:`RewardModelScorer` is a frozen one for
online RL, kept out of the LightningModule's module tree (so out of checkpoints and optimisers).

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from lightning_rl.models.loading import build_char_tokenizer, load_pretrained, tiny_llama_config, torch_dtype
from lightning_rl.models.scoring import position_ids
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
    name_or_path: str,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    *,
    new_head: bool = True,
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
        tokenizer = build_char_tokenizer()
        config = tiny_llama_config(tokenizer)
        config.num_labels = 1
        _refuse_new_head(new_head, name_or_path, "freshly initialised", key)
        model = AutoModelForSequenceClassification.from_config(config)
        return RewardNetwork(model.to(dtype_arg) if dtype_arg != "auto" else model, tokenizer)

    def load(source: str, offline: bool) -> tuple[Any, PreTrainedModel, dict[str, Any], Any]:
        kwargs = {"trust_remote_code": trust_remote_code, "local_files_only": offline}
        config = AutoConfig.from_pretrained(source, **kwargs)
        _check_labels(config, name_or_path, key)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            source, num_labels=1, output_loading_info=True, dtype=dtype_arg, **kwargs
        )
        return config, model, info, AutoTokenizer.from_pretrained(source, **kwargs)

    config, model, info, tokenizer = load_pretrained(
        name_or_path, load, key=key, local_hint="a local reward-model folder"
    )
    _check_loaded(model, info, name_or_path, new_head, config, key)
    return RewardNetwork(model, tokenizer)


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


# -------------------------------------------------------------------------------------------- scorer
class RewardModelScorer:
    """A frozen reward model that scores completions for online RL.

    A plain object, not an ``nn.Module``: stored on a LightningModule it stays out of the module tree, so
    out of checkpoints, optimisers, precision casts and device moves; call :meth:`to` yourself.

    Args:
        name_or_path: a reward-model folder (e.g. ``<log_dir>/reward_model`` written by ``RewardModel``)
            or hub id: a one-label ``AutoModelForSequenceClassification`` checkpoint with its tokenizer. A
            causal LM folder is refused (its head would be random); ``builtin:`` names are accepted with a
            warning, for smoke tests only (``builtin:tiny-sort`` is a causal LM: its head is random).
        dtype: ``float32``, ``bfloat16``, ``float16``, ``auto`` or None (float32).
        trust_remote_code: allow model code from the hub.
        batch_size: rows per forward pass.
        max_length: tokens kept per row (prompt + completion); longer rows keep their last ``max_length``.
        key: the config key named in errors.

    Raises:
        See :func:`load_reward_network`; errors name ``key`` (``model.rewards.model``).
    """

    def __init__(
        self,
        name_or_path: str,
        dtype: str | None = None,
        trust_remote_code: bool = False,
        batch_size: int = 64,
        max_length: int = 1024,
        *,
        key: str = SCORER_KEY,
    ) -> None:
        if batch_size < 1 or max_length < 1:
            raise ValueError(
                f"`{key}`: batch_size and max_length must be >= 1, got {batch_size}, {max_length}"
            )
        builtin = name_or_path.startswith("builtin:")
        self.network = load_reward_network(name_or_path, dtype, trust_remote_code, new_head=builtin, key=key)
        if builtin:
            rank_zero_warn(f"`{key}`: {name_or_path} has an untrained (random) reward head: smoke tests only")
        self.network.requires_grad_(False)
        self.network.eval()
        self.batch_size, self.max_length = batch_size, max_length
        self.last_truncated = 0  # rows cut by `max_length` in the last `score` call

    @property
    def tokenizer(self) -> Any:
        return self.network.tokenizer

    @property
    def device(self) -> torch.device:
        return self.network.device

    def to(self, device: torch.device | str) -> RewardModelScorer:
        """Move the model to ``device`` (in place); returns ``self``."""
        self.network.to(device)
        return self

    @torch.no_grad()
    def score_ids(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``[N]`` float32 scores on the model's device of ids in this tokenizer's vocabulary (padded on
        either side), ``batch_size`` rows per forward pass."""
        chunks = [
            self.network(input_ids[i : i + self.batch_size].to(self.device),
                         attention_mask[i : i + self.batch_size].to(self.device))
            for i in range(0, input_ids.shape[0], self.batch_size)
        ]
        return torch.cat(chunks) if chunks else torch.zeros(0, device=self.device)

    def score(
        self, prompt_texts: list[str], completion_texts: list[str], *, add_special_tokens: bool = True
    ) -> Tensor:
        """``[N]`` float32 scores on the model's device of ``prompt_texts[i] + completion_texts[i]``.

        Args:
            prompt_texts: rendered prompts (chat template already applied, if any).
            completion_texts: the completions as text.
            add_special_tokens: add the tokenizer's specials (e.g. BOS); False when the prompt text comes
                from a chat template that already holds them.
        """
        if len(prompt_texts) != len(completion_texts):
            raise ValueError(f"{len(prompt_texts)} prompts but {len(completion_texts)} completions")
        texts = [p + c for p, c in zip(prompt_texts, completion_texts, strict=True)]
        scores, self.last_truncated = [], 0
        for start in range(0, len(texts), self.batch_size):
            enc = self.network.encode(texts[start : start + self.batch_size], max_length=self.max_length,
                                      add_special_tokens=add_special_tokens)
            self.last_truncated += enc.truncated
            scores.append(self.score_ids(enc.input_ids, enc.attention_mask))
        return torch.cat(scores) if scores else torch.zeros(0, device=self.device)
