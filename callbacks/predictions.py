"""``lightning-rl predict``: completions of a prompt file, scored, written as JSONL with a summary.

``PolicyModule.predict_step`` generates and scores; this callback holds the settings of a predict run
(samples per prompt, temperature, output file) and writes every rank's rows once, from rank 0.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info

# the prompt loader is a streamed shard (no batch sampler to take indices from); rows carry their own index
warnings.filterwarnings("ignore", message=r"Couldn't infer the batch indices fetched from your dataloader")

FIELDS = ("index", "sample", "prompt", "completion", "reward", "correct", "length")


class WritePredictions(BasePredictionWriter):
    """Write ``predict``'s rows to a JSONL file and their summary to a JSON file, from rank 0.

    Each line is one sample: ``index`` (the prompt's row in the predict data), ``sample`` (0 to
    ``num_generations - 1``), ``prompt``, ``answer`` (when the data has one), ``completion``, ``reward``,
    ``correct`` and ``length`` (completion tokens, EOS included), ordered by ``index`` then ``sample``.
    Batches from a loader other than the DataModules' ``predict_dataloader`` carry no row index: their
    ``index`` is ``null`` and their lines follow, in the order the ranks gave them. The summary
    (``<output stem>_summary.json``, also printed as one line) holds ``prompts``, ``samples``,
    ``accuracy`` (fraction correct), ``reward_mean`` and ``length_mean`` over all lines.

    Every rank's rows are gathered to rank 0 (``all_gather_object``); the placeholder rows that give ranks
    equal batch counts were already left out by ``predict_step``, so each prompt appears once per sample
    on any world size. The CLI adds this callback to ``lightning-rl predict`` as ``--predictions.*``;
    ``PolicyModule`` adds one with the defaults to a ``trainer.predict`` that has none.

    Args:
        output: the JSONL file; ``None`` writes ``<trainer.log_dir>/predictions.jsonl`` (the run folder).
        num_generations: samples per prompt. ``1`` (with ``temperature`` unset) decodes greedily, as
            validation does; more are sampled.
        temperature: sampling temperature; ``None``: the module's own (online RL modules sample rollouts at
            ``model.sampling.temperature``, with their ``top_p`` / ``top_k``), 1.0 for the others. ``0``:
            greedy.
    """

    def __init__(
        self, output: str | None = None, num_generations: int = 1, temperature: float | None = None
    ) -> None:
        super().__init__(write_interval="epoch")
        if num_generations < 1:
            raise ValueError(f"`predictions.num_generations` must be >= 1, got {num_generations}")
        if temperature is not None and temperature < 0:
            raise ValueError(f"`predictions.temperature` must be >= 0 or null, got {temperature}")
        self.output, self.num_generations, self.temperature = output, num_generations, temperature
        self.summary: dict[str, Any] | None = None  # the last run's, on rank 0

    def target(self, trainer: L.Trainer) -> str:
        if self.output is not None:
            return self.output
        return os.path.join(trainer.log_dir or trainer.default_root_dir, "predictions.jsonl")

    def write_on_epoch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        rows = [row for batch in predictions for row in (batch or [])]
        path = self.target(trainer)  # trainer.log_dir is broadcast from rank 0: every rank asks
        rows = gather_rows(rows)  # placeholder rows never got here: predict_step leaves them out
        if not trainer.is_global_zero:
            return
        rows.sort(key=lambda row: (row["index"] is None, row["index"] or 0, row["sample"]))
        self.summary = summarize(rows, path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        with open(summary_path(path), "w") as f:
            json.dump(self.summary, f, indent=2)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "predict" and trainer.is_global_zero and self.summary is not None:
            rank_zero_info(summary_line(self.summary))  # after the progress bar has closed


def gather_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's rows on every rank (one ``all_gather_object``; ``rows`` alone on one process)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return rows
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    return [row for part in gathered for row in part]


def summary_path(path: str) -> str:
    """``out/predictions.jsonl`` -> ``out/predictions_summary.json``."""
    stem, _ = os.path.splitext(path)
    return f"{stem}_summary.json"


def summarize(rows: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """Means over the written lines: ``accuracy`` (fraction correct), ``reward_mean``, ``length_mean``."""
    n = max(len(rows), 1)
    return {
        "prompts": sum(row["sample"] == 0 for row in rows),
        "samples": len(rows),
        "accuracy": sum(bool(row["correct"]) for row in rows) / n,
        "reward_mean": sum(float(row["reward"]) for row in rows) / n,
        "length_mean": sum(int(row["length"]) for row in rows) / n,
        "predictions": path,
    }


def summary_line(summary: dict[str, Any]) -> str:
    return (f"predict: {summary['prompts']} prompts, {summary['samples']} samples: "
            f"accuracy = {summary['accuracy']:.3f}, reward_mean = {summary['reward_mean']:.3f}, "
            f"length_mean = {summary['length_mean']:.2f} tokens -> {summary['predictions']}")
