"""Prompts with their completions, rewards and correctness, as Markdown tables in TensorBoard's Text tab.

``samples/train`` comes from the rollout a training step already generated, ``samples/val`` from the greedy
completions of the first validation batch (what ``PolicyModule.validation_step`` returns): nothing is
generated for the tables. Only rank 0 writes, and only to a ``TensorBoardLogger``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

from lightning_rl.callbacks.base import RLCallback
from lightning_rl.step.rollout import Rollout

HEADER = "| prompt | completion | reward | correct |\n|---|---|---|---|"
# Markdown and HTML characters that would change how a cell renders (a `|` ends the cell, `<think>` is
# swallowed as an unknown tag, `*` / `_` / backticks start emphasis or code); `&` first so escapes survive
ESCAPES = [("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("\\", "\\\\"), ("|", "\\|"), ("*", "\\*"),
           ("_", "\\_"), ("`", "\\`"), ("[", "\\["), ("]", "\\]"), ("#", "\\#")]


def shorten(text: str, max_chars: int) -> str:
    """``text`` in at most ``max_chars`` characters: its start and its end, ``…`` standing for the middle
    (a chat prompt's question and a long completion's final answer are at the end). Applied before
    escaping, so an escape sequence is never split."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head - 1
    return text[:head] + "…" + (text[-tail:] if tail > 0 else "")


def escape_cell(text: str) -> str:
    """``text`` as one Markdown table cell that shows literally: pipes, HTML and emphasis characters
    escaped, newlines as ``<br>`` (the only HTML written)."""
    for char, escaped in ESCAPES:
        text = text.replace(char, escaped)
    return text.replace("\r\n", "\n").replace("\n", "<br>")


def turns_cell(turns: Sequence[Mapping[str, str]], max_chars: int) -> str:
    """An episode as one cell: each turn on its own line after its role in bold (``**assistant:**``,
    ``**tool:**``), each turn's text shortened to ``max_chars`` and escaped."""
    cells = [f"**{t['role']}:** " + escape_cell(shorten(str(t["content"]), max_chars)) for t in turns]
    return "<br>".join(cells)


def markdown_table(
    prompts: Sequence[Any], completions: Sequence[str], rewards: Sequence[float], correct: Sequence[Any],
    max_chars: int = 200, turns: Sequence[Sequence[Mapping[str, str]]] | None = None,
) -> str:
    """A Markdown table with one row per sample: prompt, completion (each shortened to ``max_chars`` and
    escaped; an episode's ``turns`` one per line instead), reward (3 decimals) and correctness."""
    lines = [HEADER]
    for i, (p, c, r, ok) in enumerate(zip(prompts, completions, rewards, correct, strict=True)):
        shown = turns_cell(turns[i], max_chars) if turns is not None else escape_cell(shorten(c, max_chars))
        cells = [escape_cell(shorten(str(p), max_chars)), shown, f"{float(r):.3f}",
                 "yes" if bool(ok) else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def episode_turns(tokenizer: Any, ids: torch.Tensor, mask: torch.Tensor,
                  model_mask: torch.Tensor) -> list[dict[str, str]]:
    """An episode's completion split into its runs of sampled (``model``) and observation tokens, decoded."""
    ids, model = ids[mask.bool()].tolist(), model_mask[mask.bool()].tolist()
    turns: list[dict[str, str]] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or model[end] != model[start]:
            text = tokenizer.decode(ids[start:end], skip_special_tokens=True)
            turns.append({"role": "model" if model[start] else "observation", "content": text})
            start = end
    return turns


def spread_rows(group_ids: torch.Tensor, k: int) -> list[int]:
    """``k`` row indices, one per group first (the first sample of each prompt), then the second samples..."""
    groups = group_ids.tolist()
    seen: dict[int, int] = {}
    rank_in_group = []
    for g in groups:
        rank_in_group.append(seen.get(g, 0))
        seen[g] = rank_in_group[-1] + 1
    order = sorted(range(len(groups)), key=lambda i: (rank_in_group[i], i))
    return order[:k]


def tensorboard_writers(trainer: L.Trainer) -> list[Any]:
    """The ``SummaryWriter`` of every ``TensorBoardLogger`` of the trainer (none for other loggers)."""
    return [lg.experiment for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]


class LogSamples(RLCallback):
    """Write a few samples as a Markdown table to TensorBoard's Text tab: ``samples/train`` every
    ``log_samples_every_n_steps`` rollouts (the first one included), ``samples/val`` at each validation.

    Prompts show as the model saw them in both tables: rendered through the chat template (when the
    module uses one) and decoded without special tokens.

    Train rows come from the step's rollout (one sample per prompt first, so different prompts show),
    with the rollout's rewards (shaped, as trained on) and correctness. Validation rows are the first
    ``num_samples`` greedy completions of the first validation batch, scored with the module's
    ``evaluator.sample_rewards`` (its rewards pipeline's, unshaped, an episode's returns included;
    correctness for modules without rewards) and ``correct``; modules whose ``validation_step`` returns no
    completions (DPO, reward models) get no validation table. Both tables are logged at
    ``trainer.global_step``.

    Only rank 0 writes, and only through a ``TensorBoardLogger`` (``logger.experiment.add_text``); with
    any other logger, or none, the callback does nothing (a log line says so once).

    Args:
        log_samples_every_n_steps: rollouts between two train tables (training steps, not optimiser
            steps); ``0`` turns the train table off.
        num_samples: rows per table.
        max_chars: prompts and completions longer than this keep their start and end (``…`` between).
    """

    def __init__(
        self, log_samples_every_n_steps: int = 50, num_samples: int = 4, max_chars: int = 200
    ) -> None:
        if log_samples_every_n_steps < 0 or num_samples < 1 or max_chars < 1:
            raise ValueError(
                "LogSamples: `log_samples_every_n_steps` must be >= 0, `num_samples` and `max_chars` >= 1; "
                f"got {log_samples_every_n_steps}, {num_samples}, {max_chars}"
            )
        self.every, self.num_samples, self.max_chars = log_samples_every_n_steps, num_samples, max_chars

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage in ("fit", "validate") and not tensorboard_writers(trainer):
            rank_zero_info("LogSamples writes to a TensorBoardLogger only; this run has none, so no samples")

    def write(self, trainer: L.Trainer, tag: str, table: str) -> None:
        for writer in tensorboard_writers(trainer):
            writer.add_text(tag, table, global_step=trainer.global_step)

    def on_rollout_end(self, trainer: L.Trainer, pl_module: Any, rollout: Rollout) -> None:
        step = trainer.fit_loop.total_batch_idx  # rollouts so far: the training step's batch index
        if not (trainer.is_global_zero and self.every and step % self.every == 0 and len(rollout)):
            return
        if not tensorboard_writers(trainer):
            return
        rows = torch.tensor(spread_rows(rollout.group_ids, self.num_samples), device=rollout.lengths.device)
        part = rollout.select(rows)
        # every token in the context (EOS included), even where the loss mask is off (`mask_truncated`)
        prompts = pl_module.decode(part.prompt_ids, part.prompt_mask)
        completions = pl_module.decode(part.completion_ids, part.attention_mask)
        turns = None if part.model_mask is None else [
            episode_turns(pl_module.tokenizer, ids, mask, model) for ids, mask, model
            in zip(part.completion_ids, part.attention_mask, part.model_mask, strict=True)]
        table = markdown_table(prompts, completions, part.rewards.tolist(), part.correct.tolist(),
                               self.max_chars, turns)
        self.write(trainer, "samples/train", table)

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if batch_idx != 0 or dataloader_idx != 0 or not trainer.is_global_zero:
            return
        if not (isinstance(outputs, Mapping) and "completions" in outputs and tensorboard_writers(trainer)):
            return
        k = self.num_samples
        prompts, completions = list(outputs["prompts"][:k]), list(outputs["completions"][:k])
        columns = {name: list(values[:k]) for name, values in outputs["columns"].items()}
        returns = outputs.get("returns")  # episodes: the environment's rewards, which the reward includes
        failed = outputs.get("failed")
        rewards = pl_module.evaluator.sample_rewards(
            prompts, completions, list(outputs["lengths"][:k]), columns,
            None if returns is None else list(returns[:k]), None if failed is None else list(failed[:k]))
        table = markdown_table(pl_module.codec.shown(prompts), completions, rewards,
                               list(outputs["correct"][:k]), self.max_chars, columns.get("turns"))
        self.write(trainer, "samples/val", table)
