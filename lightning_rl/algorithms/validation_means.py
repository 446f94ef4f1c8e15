"""Exact validation means over held-out rows on any world size: :class:`ValidationMeans`.

Lightning's ``sync_dist`` averages per-rank means, which weighs a rank with fewer real rows (the last, padded
batch) like the others. Here each value is added as a sum and a count of rows, all-reduced once at the end
of validation, so a logged mean is over every held-out row exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info


class ValidationMeans:
    """The sums and counts of one validation, and what is said about them (see the module docstring)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.said_accuracy = False  # what `val/accuracy` means is said once per run

    def start(self) -> None:
        self.sums = {}

    def add(self, name: str, value: torch.Tensor | float, weight: float, device: torch.device) -> None:
        """Add ``value``, a mean over ``weight`` held-out rows, to this validation's mean of ``name``."""
        sums = self.sums.setdefault(name, torch.zeros(2, device=device))
        value = torch.as_tensor(value, dtype=torch.float32, device=device).detach()
        sums += torch.stack([value * weight, value.new_tensor(weight)])

    def reduce(self, strategy: Any) -> dict[str, torch.Tensor]:
        """Every mean over all ranks' rows, by name (the same names on every rank: every rank ran >= 1 batch,
        so every rank makes the same all-reduces, in sorted order)."""
        results = {}
        for name in sorted(self.sums):
            total, count = strategy.reduce(self.sums[name].clone(), reduce_op="sum")
            results[name] = total / count.clamp_min(1)
        return results

    def report(self, results: dict[str, torch.Tensor], *, shown: Sequence[str], step: int,
               sanity_loggers: Sequence[Any], accuracy_name: str | None) -> None:
        """Record the sanity pass's means as each curve's starting point (Lightning logs nothing then: pass
        its loggers, none otherwise), and print the ``shown`` means (the first time with what ``val/accuracy``
        is the mean of)."""
        if results:
            for logger in sanity_loggers:
                logger.log_metrics({k: float(v) for k, v in results.items()}, step=step)
        shown = [f"{k} = {float(results[k]):.3f}" for k in shown if k in results]
        if shown and not self.said_accuracy and "val/accuracy" in results:
            rank_zero_info(f"val/accuracy: the mean of {accuracy_name} on greedy completions")
            self.said_accuracy = True
        if shown:
            rank_zero_info(f"step {step}: " + ", ".join(shown))
