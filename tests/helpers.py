"""Shared test helpers: run the real CLI in-process and read TensorBoard scalars."""

from __future__ import annotations

import glob
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_rl.cli import LightningRLCLI

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def run_cli(*args: str):
    """``lightning-rl <args>`` in this process; returns the LightningCLI object."""
    return LightningRLCLI(args=[str(a) for a in args])


def scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All TensorBoard scalars under ``log_dir``: ``{tag: [(step, value), ...]}``."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out
