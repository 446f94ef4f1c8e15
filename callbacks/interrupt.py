"""Ctrl-C or SIGTERM: finish the current step, save a checkpoint that resumes exactly, stop."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info


class CheckpointOnInterrupt(L.Callback):
    """Turn Ctrl-C (SIGINT) and SIGTERM into a stop at the end of the current training step, with a
    checkpoint saved there (``<checkpoint folder>/interrupted-step=N.ckpt``) and its path printed.

    The checkpoint is taken where Lightning's ``ModelCheckpoint`` takes its step checkpoints, so it resumes
    exactly (``fit --ckpt_path last`` finds it); an exception in the middle of a step would leave some of
    its optimiser steps done and its data position behind. A second Ctrl-C stops at once without one
    (Python's ``KeyboardInterrupt``). Lightning catches SIGTERM itself and raises at the end of the step;
    this callback stops a little earlier, before a validation that would be due (a SIGTERM that arrives
    during a validation of several batches is Lightning's: it stops there, unsaved). The process exits with
    status 128 + the signal's number (130, 143), like a process the signal killed. Every rank stops at the
    same step (the request is all-reduced once per step). Nothing is saved when checkpointing is off.
    """

    def __init__(self) -> None:
        self.requested: int | None = None  # the signal received, until handled
        self._previous: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.requested = None
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.requested = signum
        self._restore()  # the next Ctrl-C raises KeyboardInterrupt
        rank_zero_info("\nCtrl-C: saving a checkpoint at the end of this step (Ctrl-C again to stop now)")

    def _restore(self) -> None:
        if self._previous is not None and signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, self._previous)
        self._previous = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        signum = self.requested or (signal.SIGTERM if trainer.received_sigterm else None)
        if not trainer.strategy.reduce_boolean_decision(signum is not None, all=False):
            return
        signum = signum or signal.SIGTERM  # another rank got it
        name = signal.Signals(signum).name
        if trainer.checkpoint_callback is None:
            rank_zero_info(f"{name}: stopped at step {trainer.global_step} (checkpointing is off: not saved)")
        else:
            folder = trainer.checkpoint_callback.dirpath or os.path.join(trainer.default_root_dir,
                                                                         "checkpoints")
            path = os.path.join(folder, f"interrupted-step={trainer.global_step}.ckpt")
            trainer.save_checkpoint(path)
            rank_zero_info(f"{name}: stopped at step {trainer.global_step}; checkpoint saved to {path} "
                           "(resume with `--ckpt_path last`)")
        self.requested = None
        raise SystemExit(128 + signum)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, err: BaseException) -> None:
        self._restore()
