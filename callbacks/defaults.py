"""The callbacks every run gets unless the user configured the same one: :func:`default_callbacks`.

A LightningModule's ``configure_callbacks`` returns them. Lightning's stock checkpoint callback and progress
bar are swapped for ours (a checkpoint callback or progress bar configured by the user is left alone).
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lightning_rl.callbacks.checkpoints import Checkpoints, is_stock_model_checkpoint
from lightning_rl.callbacks.export import ExportPolicy
from lightning_rl.callbacks.geometry import BatchGeometry
from lightning_rl.callbacks.interrupt import CheckpointOnInterrupt
from lightning_rl.callbacks.predictions import WritePredictions
from lightning_rl.callbacks.steps import LogAtOptimizerStep, StepProgressBar


def default_callbacks(trainer: L.Trainer) -> list[L.Callback]:
    """The final policy's export, a checkpoint on Ctrl-C / SIGTERM, logging at optimiser steps, the batch
    geometry check (a resume with another batch size / G / world size is refused), the predictions' writer
    when predicting; Lightning's stock checkpoint callback replaced by :class:`Checkpoints` (one
    ``last.ckpt``) and its stock progress bar by one that counts optimiser steps. Removes the stock ones from
    ``trainer.callbacks``."""
    wanted = [ExportPolicy(), CheckpointOnInterrupt(), LogAtOptimizerStep(), BatchGeometry()]
    if trainer.predicting:  # predict writes its rows (the CLI adds one, set by `--predictions.*`)
        wanted.append(WritePredictions())
    callbacks = [cb for cb in wanted if not has_callback(trainer, type(cb))]
    stock = [cb for cb in trainer.checkpoint_callbacks if is_stock_model_checkpoint(cb)]
    if stock and len(trainer.checkpoint_callbacks) == 1:  # Lightning's default: our policy instead
        trainer.callbacks.remove(stock[0])
        callbacks.append(Checkpoints())
    bar = trainer.progress_bar_callback
    if type(bar) in (TQDMProgressBar, RichProgressBar):
        # removed here rather than overridden by type, which only covers subclasses (Rich is the default)
        trainer.callbacks.remove(bar)
        # TQDM's refresh rate counts batches; Rich's counts redraws per second (default 100), which as a
        # batch count would freeze the bar for 100 steps: a Rich bar becomes one refresh per step
        rate = bar.refresh_rate if isinstance(bar, TQDMProgressBar) else int(bar.refresh_rate > 0)
        callbacks.append(StepProgressBar(refresh_rate=rate))
    return callbacks


def has_callback(trainer: L.Trainer, kind: type) -> bool:
    return any(isinstance(cb, kind) for cb in trainer.callbacks)
