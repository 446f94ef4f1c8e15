"""The frozen reward model of online RL: :class:`RewardModelScorer` scores prompt + completion texts.

It loads with :func:`~lightning_rl.models.reward_network.load_reward_network` (which module also says what
is scored and which token is read) and stays out of the LightningModule's module tree (so out of
checkpoints and optimisers).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_rl.models.reward_network import SCORER_KEY, load_reward_network


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
