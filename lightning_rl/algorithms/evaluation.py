"""Greedy validation and predict, shared by every algorithm: :class:`EvaluationSteps` is the mixin of
:class:`~lightning_rl.algorithms.base.PolicyModule` that scores held-out prompts into ``val/*`` metrics (exact
means over the held-out rows on any world size) and writes scored predictions (``lightning-rl predict``).

It reads what ``PolicyModule`` sets up: ``complete`` (the engine's completions, or whole episodes),
``sampling_params``, ``correctness_fn`` / ``accuracy_name``, ``reward_pipeline`` (RL modules), and the
LightningModule's ``log`` and ``trainer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_rl.text.keys import VAL_WEIGHT_KEY
from lightning_rl.text.prompts import batch_columns, real_rows


@dataclass
class Completions:
    """Completions of a batch: ``texts`` (an episode's final model turn), ``lengths`` in tokens (EOS
    included; an episode's every token after the prompt), and each episode's ``turns`` as messages (``None``
    for single-turn completions)."""

    texts: list[str]
    lengths: list[int]
    turns: list[list[dict[str, str]]] | None = None
    returns: list[float] | None = None  # each episode's environment rewards (step + final)
    failed: list[bool] | None = None  # episodes whose environment failed (`on_error: zero`): reward 0


class EvaluationSteps:
    """Mixin for :class:`~lightning_rl.algorithms.base.PolicyModule`: validation and predict steps, and the
    exact validation means (see the module docstring)."""

    accuracy_fn: Any
    accuracy_name: str
    correctness_fn: Any  # what decides `val/accuracy` and predictions' `correct` (``accuracy_fn`` unless set)
    reward_pipeline: Any = None  # RL modules: their rewards (a ``RewardPipeline``); else correctness is shown

    def validation_step(self, batch: dict[str, list], batch_idx: int) -> dict[str, Any]:
        """Greedy completions of the batch's held-out prompts, scored into ``val/accuracy`` (and the
        subclass's ``validation_extra``). Returns what callbacks may show (``LogSamples``): the real rows'
        ``prompts``, ``completions``, ``lengths``, ``correct`` and other data ``columns``."""
        batch, weight = real_rows(batch)
        done = self.complete(batch, sampling=self.sampling_params(do_sample=False))
        completions, lengths, columns = done.texts, done.lengths, batch_columns(batch)
        if done.turns is not None:
            columns = {**columns, "turns": done.turns}
        scores = correct_unless_failed(self.correct(batch["prompt"], completions, columns), done.failed)
        acc = torch.tensor([float(s) for s in scores], device=self.device)
        self.log_val_mean("val/accuracy", acc.mean(), weight)
        self.validation_extra(batch, done, columns, weight)
        return {"prompts": batch["prompt"], "completions": completions, "lengths": lengths, "correct": scores,
                "columns": columns, "returns": done.returns, "failed": done.failed}

    def correct(self, prompts: Sequence[Any], completions: list[str], columns: dict[str, list]) -> list[Any]:
        """Per-completion correctness, whose mean is ``val/accuracy``: ``correctness_fn``."""
        return self.correctness_fn(prompts=prompts, completions=completions, **columns)

    def validation_extra(self, batch: dict[str, list], done: Completions, columns: dict[str, list],
                         weight: float) -> None:
        """``val/reward_mean`` for modules with rewards (the same greedy completions' rewards)."""
        if self.reward_pipeline is not None:
            rewards = self.sample_rewards(batch["prompt"], done.texts, done.lengths, columns, done.returns,
                                          done.failed)
            self.log_val_mean("val/reward_mean", torch.tensor(rewards).mean(), weight)

    def sample_rewards(self, prompts: Sequence[Any], completions: list[str], lengths: list[int],
                       columns: dict[str, list], returns: Sequence[float] | None = None,
                       failed: Sequence[bool] | None = None) -> list[float]:
        """The reward of each completion, for ``val/reward_mean``, predictions and sample tables: the rewards
        pipeline's, unshaped (functions, reward model, an episode's ``returns``) in RL modules, else
        correctness as a reward (DPO, SFT); 0 for an episode whose environment ``failed``, as in training."""
        if self.reward_pipeline is not None:
            rewards, _ = self.reward_pipeline.score(prompts, completions, lengths, columns, returns=returns,
                                                    failed=failed)
            return rewards.tolist()
        return [float(s) for s in self.correct(prompts, completions, columns)]

    # ---- predict: completions of held-out prompts, scored (``lightning-rl predict``) -------------------
    def predict_sampling(self) -> tuple[int, Any]:
        """``(samples per prompt, sampling parameters)`` for predict, as the ``WritePredictions`` callback
        asks (a default one where the trainer has none): greedy, or ``num_generations`` samples each at its
        ``temperature`` (else the trained sampling's), with the trained ``top_p`` and ``top_k``."""
        from lightning_rl.callbacks.predictions import WritePredictions

        writer = next((cb for cb in self.trainer.callbacks if isinstance(cb, WritePredictions)), None)
        writer = writer or WritePredictions()
        n, temperature = writer.num_generations, writer.temperature
        sample = n > 1 or temperature is not None
        temperature = temperature if temperature is not None else getattr(
            getattr(self, "sampling", None), "temperature", 1.0)
        trained = getattr(self, "sampling", None) or self.sampling_params()
        return n, self.sampling_params(temperature, trained.top_p, trained.top_k, do_sample=sample)

    def predict_step(self, batch: dict[str, list], batch_idx: int) -> list[dict[str, Any]]:
        """Generate for the batch's prompts as the ``WritePredictions`` callback asks (greedy, or
        ``num_generations`` samples each at its temperature), score each sample with ``sample_rewards`` and
        ``correct``, and return one row per sample of a real prompt (placeholder rows, which only give every
        rank as many batches, are generated for, then left out). See ``WritePredictions`` for the fields.
        """
        from lightning_rl.text.keys import ROW_INDEX_KEY

        if not hasattr(self, "engine"):
            raise ValueError(f"`predict` generates completions: {type(self).__name__} has no policy to run")
        n, sampling = self.predict_sampling()
        done = self.complete(batch, num_samples=n, sampling=sampling)
        completions, lengths = done.texts, done.lengths
        data = {k: v for k, v in batch_columns(batch).items() if k != ROW_INDEX_KEY}
        prompts = [p for p in batch["prompt"] for _ in range(n)]
        columns = {k: [v for v in values for _ in range(n)] for k, values in data.items()}
        if done.turns is not None:
            columns["turns"] = done.turns
        rewards = self.sample_rewards(prompts, completions, lengths, columns, done.returns, done.failed)
        correct = correct_unless_failed(self.correct(prompts, completions, columns), done.failed)
        weights = batch.get(VAL_WEIGHT_KEY) or [1.0] * len(batch["prompt"])
        index = batch.get(ROW_INDEX_KEY) or [None] * len(batch["prompt"])  # None: not from our DataModules
        rows = []
        for i in range(len(completions)):
            row_idx = i // n
            if weights[row_idx] <= 0:
                continue
            answer = {"answer": columns["answer"][i]} if "answer" in columns else {}
            turns = {"turns": done.turns[i]} if done.turns is not None else {}
            rows.append({"index": index[row_idx], "sample": i % n, "prompt": prompts[i], **answer,
                         "completion": completions[i], **turns, "reward": rewards[i],
                         "correct": bool(correct[i]), "length": int(lengths[i])})
        return rows



def correct_unless_failed(correct: Sequence[Any], failed: Sequence[bool] | None) -> list[Any]:
    """``correct`` with False where the episode's environment ``failed`` (``None``: none did), as the
    rewards pipeline scores such an episode."""
    if failed is None:
        return list(correct)
    return [False if f else c for c, f in zip(correct, failed, strict=True)]
