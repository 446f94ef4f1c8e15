"""Supervised fine-tuning on (prompt, answer) rows: the warm start for RL.

The loss is the negative log-likelihood of the answer tokens (plus EOS) only; prompt tokens are
context, not targets. It is a token mean over the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_rl.algorithms.base import PolicyModule
from lightning_rl.maths.aggregation import aggregate
from lightning_rl.text.pairs import pad_rows


class SFT(PolicyModule):
    """Supervised fine-tuning on the ``answer`` column of a ``PromptDataModule``.

    Args:
        max_completion_length: longest target in tokens (EOS included); longer targets are cut on
            the right, and the count of cut rows is logged as ``train/truncated_frac``.
        **base: see ``PolicyModule`` (model, optimizer, generation and validation settings).

    Training data without reference answers (``data.answer_column: null``) fails at setup, naming the key.
    """

    def __init__(self, *args: Any, max_completion_length: int = 64, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_completion_length = max_completion_length

    def on_fit_start(self) -> None:
        """Fail before training when the data has no reference answers (SFT's targets)."""
        super().on_fit_start()
        dm = getattr(self.trainer, "datamodule", None)
        if dm is None:
            return
        rows = getattr(dm, "train_rows", None) or []
        if getattr(dm, "answer_column", "answer") is None or (rows and "answer" not in rows[0]):
            raise ValueError(missing_answers(dm))

    def encode_targets(self, answers: list[str]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Right-padded target ids with EOS appended, their mask, and the fraction cut."""
        eos, pad = self.policy.eos_token_id, self.policy.pad_token_id
        rows = [ids + [eos] for ids in self.tokenizer(list(answers), add_special_tokens=False)["input_ids"]]
        cut = sum(len(r) > self.max_completion_length for r in rows) / len(rows)
        ids, mask = pad_rows([r[: self.max_completion_length] for r in rows], pad, left=False)
        return ids.to(self.device), mask.to(self.device), cut

    def training_step(self, batch: dict[str, list], batch_idx: int) -> torch.Tensor:
        if "answer" not in batch:  # data that did not come from a PromptDataModule
            raise ValueError(missing_answers(getattr(self.trainer, "datamodule", None)))
        prompt_ids, prompt_mask = self.codec.encode(batch["prompt"])
        target_ids, target_mask, cut = self.encode_targets([str(a) for a in batch["answer"]])
        logp, _ = self.policy.token_logprobs(prompt_ids, prompt_mask, target_ids, target_mask)
        loss = -aggregate(logp, target_mask, "token-mean")
        n = len(batch["prompt"])
        self.log("train/loss", loss, batch_size=n, prog_bar=True)
        self.log("train/truncated_frac", cut, batch_size=n)
        return loss


def missing_answers(dm: Any) -> str:
    """The message for training data without an ``answer`` column, naming ``data.answer_column``."""
    column = getattr(dm, "answer_column", None)
    if column is None:
        return "SFT trains on reference answers but `data.answer_column` is null: set it to the answer column"
    return f"SFT trains on reference answers but the batches have none (`data.answer_column`={column!r})"
