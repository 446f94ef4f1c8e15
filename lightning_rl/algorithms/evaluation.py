"""Greedy validation and predict, shared by every algorithm: an :class:`Evaluator` scores held-out prompts
into ``val/*`` means (which :class:`~lightning_rl.algorithms.base.PolicyModule` logs as exact means over the
held-out rows on any world size) and scored predictions (``lightning-rl predict``). It is given what it
uses (how to complete a batch, what decides correctness, the rewards) and reads nothing of the module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_rl.models.generation import SamplingParams
from lightning_rl.text.keys import ROW_INDEX_KEY, VAL_WEIGHT_KEY
from lightning_rl.text.prompts import batch_columns, real_rows

Means = tuple[torch.Tensor, float]  # a mean over real held-out rows, and their number


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


@dataclass
class Evaluator:
    """Greedy validation and predict of a policy, from what it is given: nothing of the LightningModule is
    read. :class:`~lightning_rl.algorithms.base.PolicyModule` builds one per call (``module.evaluator``) and
    logs what it returns.

    Args:
        complete: ``(batch, *, num_samples, sampling, seed) -> Completions`` (the engine's completions, or
            whole episodes).
        correctness_fn: decides ``val/accuracy`` and predictions' ``correct`` (a reward-style function of
            ``prompts``, ``completions`` and the data's columns).
        greedy: the sampling parameters of validation (greedy, the validation token budget).
        rewards: the module's ``RewardPipeline`` (RL modules: ``val/reward_mean`` and predictions'
            ``reward``); ``None``: correctness stands in for the reward.
    """

    complete: Callable[..., Completions]
    correctness_fn: Callable[..., Sequence[Any]]
    greedy: SamplingParams
    rewards: Any = None

    def validate(self, batch: dict[str, list]) -> tuple[dict[str, Means], dict[str, Any]]:
        """Greedy completions of the batch's held-out prompts, scored. Returns the means to log, by name, each
        with the number of real rows it is over (``val/accuracy``; ``val/reward_mean`` with rewards), and
        what callbacks may show (``LogSamples``): the real rows' ``prompts``, ``completions``, ``lengths``,
        ``correct`` and other data ``columns``."""
        batch, weight = real_rows(batch)
        done = self.complete(batch, sampling=self.greedy)
        columns = batch_columns(batch)
        if done.turns is not None:
            columns = {**columns, "turns": done.turns}
        scores = correct_unless_failed(self.correct(batch["prompt"], done.texts, columns), done.failed)
        means = {"val/accuracy": (torch.tensor([float(s) for s in scores]).mean(), weight)}
        if self.rewards is not None:
            rewards = self.sample_rewards(batch["prompt"], done.texts, done.lengths, columns, done.returns,
                                          done.failed)
            means["val/reward_mean"] = (torch.tensor(rewards).mean(), weight)
        return means, {"prompts": batch["prompt"], "completions": done.texts, "lengths": done.lengths,
                       "correct": scores, "columns": columns, "returns": done.returns, "failed": done.failed}

    def correct(self, prompts: Sequence[Any], completions: list[str], columns: dict[str, list]) -> list[Any]:
        """Per-completion correctness, whose mean is ``val/accuracy``: ``correctness_fn``."""
        return list(self.correctness_fn(prompts=prompts, completions=completions, **columns))

    def sample_rewards(self, prompts: Sequence[Any], completions: list[str], lengths: list[int],
                       columns: dict[str, list], returns: Sequence[float] | None = None,
                       failed: Sequence[bool] | None = None) -> list[float]:
        """The reward of each completion, for ``val/reward_mean``, predictions and sample tables: the rewards
        pipeline's, unshaped (functions, reward model, an episode's ``returns``) in RL modules, else
        correctness as a reward (DPO, SFT); 0 for an episode whose environment ``failed``, as in training."""
        if self.rewards is not None:
            rewards, _ = self.rewards.score(prompts, completions, lengths, columns, returns=returns,
                                            failed=failed)
            return rewards.tolist()
        return [float(s) for s in self.correct(prompts, completions, columns)]

    def predict(self, batch: dict[str, list], num_samples: int,
                sampling: SamplingParams) -> list[dict[str, Any]]:
        """``num_samples`` completions of each prompt of ``batch`` with ``sampling``, each scored with
        ``sample_rewards`` and ``correct``: one row per sample of a real prompt (placeholder rows, which only
        give every rank as many batches, are generated for, then left out). See ``WritePredictions`` for the
        fields."""
        n = num_samples
        done = self.complete(batch, num_samples=n, sampling=sampling)
        data = {k: v for k, v in batch_columns(batch).items() if k != ROW_INDEX_KEY}
        prompts = [p for p in batch["prompt"] for _ in range(n)]
        columns = {k: [v for v in values for _ in range(n)] for k, values in data.items()}
        if done.turns is not None:
            columns["turns"] = done.turns
        rewards = self.sample_rewards(prompts, done.texts, done.lengths, columns, done.returns, done.failed)
        correct = correct_unless_failed(self.correct(prompts, done.texts, columns), done.failed)
        weights = batch.get(VAL_WEIGHT_KEY) or [1.0] * len(batch["prompt"])
        index = batch.get(ROW_INDEX_KEY) or [None] * len(batch["prompt"])  # None: not from our DataModules
        rows = []
        for i, completion in enumerate(done.texts):
            if weights[i // n] <= 0:
                continue
            answer = {"answer": columns["answer"][i]} if "answer" in columns else {}
            turns = {"turns": done.turns[i]} if done.turns is not None else {}
            rows.append({"index": index[i // n], "sample": i % n, "prompt": prompts[i], **answer,
                         "completion": completion, **turns, "reward": rewards[i], "correct": bool(correct[i]),
                         "length": int(done.lengths[i])})
        return rows


def predict_sampling(callbacks: Sequence[Any], trained: SamplingParams | None,
                     sampling_params: Callable[..., SamplingParams]) -> tuple[int, SamplingParams]:
    """``(samples per prompt, sampling parameters)`` for predict, as the trainer's ``WritePredictions``
    callback asks (a default one where it has none): greedy, or ``num_generations`` samples each at its
    ``temperature`` (else the ``trained`` sampling's), with the trained ``top_p`` and ``top_k``.
    ``sampling_params(temperature, top_p, top_k, do_sample=...)`` builds them with the module's budget."""
    from lightning_rl.callbacks.predictions import WritePredictions

    writer = next((cb for cb in callbacks if isinstance(cb, WritePredictions)), None) or WritePredictions()
    n, temperature = writer.num_generations, writer.temperature
    sample = n > 1 or temperature is not None
    trained = trained or sampling_params()
    temperature = temperature if temperature is not None else trained.temperature
    return n, sampling_params(temperature, trained.top_p, trained.top_k, do_sample=sample)


def correct_unless_failed(correct: Sequence[Any], failed: Sequence[bool] | None) -> list[Any]:
    """``correct`` with False where the episode's environment ``failed`` (``None``: none did), as the
    rewards pipeline scores such an episode."""
    if failed is None:
        return list(correct)
    return [False if f else c for c, f in zip(correct, failed, strict=True)]
