"""The default checkpoint policy: one ``last.ckpt`` per run, rewritten on a step schedule and at the end.

Lightning's stock ``ModelCheckpoint`` writes a full checkpoint after every validation (1.6 GB every 10 steps
for a 135M model with its Adam state). :class:`Checkpoints` replaces it in every run that did not configure
a checkpoint callback of its own (``PolicyModule.configure_callbacks``); ``trainer.enable_checkpointing:
false`` still turns checkpoints off.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class Checkpoints(ModelCheckpoint):
    """Keep the last checkpoint (and, if asked, the best one) in the run's ``checkpoints/`` folder.

    * ``last.ckpt`` is written every ``every_n_steps`` optimiser steps and after the run's last batch (or
      its last epoch under ``max_epochs``), each time replacing the one before: a run holds one, whatever
      its length. ``--ckpt_path last`` resumes it.
    * With ``keep_best``, ``best.ckpt`` too: written after a validation whose ``monitor`` beats every
      earlier one (``mode`` ``max``: higher is better), replacing the previous best.
    * A checkpoint holds what resuming needs: the trainable weights (the adapters only under LoRA), the
      optimiser and scheduler, the data position and the RNG states. ``ExportPolicy`` writes the final
      policy as a plain ``transformers`` folder separately; Ctrl-C / SIGTERM save ``interrupted-step=N.ckpt``.

    Args:
        every_n_steps: optimiser steps between two writes of ``last.ckpt`` (``null``: only at the end).
        keep_best: also keep ``best.ckpt``, the checkpoint of the best validation.
        monitor: the logged metric ``keep_best`` ranks validations by.
        mode: ``max`` when a higher ``monitor`` is better, ``min`` when lower is.
        dirpath: the folder; by default ``<log_dir>/checkpoints``, as Lightning lays it out.
    """

    def __init__(self, every_n_steps: int | None = 100, keep_best: bool = False,
                 monitor: str = "val/accuracy", mode: Literal["max", "min"] = "max",
                 dirpath: str | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"Checkpoints: `every_n_steps` must be >= 1 or null, got {every_n_steps}")
        super().__init__(dirpath=dirpath, filename="best", monitor=monitor if keep_best else None, mode=mode,
                         save_top_k=1 if keep_best else 0, save_last=True, every_n_epochs=0,
                         auto_insert_metric_name=False, enable_version_counter=False)
        self.every_n_steps = every_n_steps
        self.keep_best = keep_best
        self._last_saved_step = 0  # the step last.ckpt holds (0: none yet)

    def _saving(self, trainer: L.Trainer) -> bool:
        return not (trainer.fast_dev_run or trainer.sanity_checking or trainer.state.fn != "fit")

    def _write_last(self, trainer: L.Trainer) -> None:
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        self._last_saved_step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        """``last.ckpt`` when the step count passed a multiple of ``every_n_steps`` (a batch may take
        several optimiser steps, so "passed", not "equals"), and after the run's last batch.

        Written here, not in ``on_train_end``: Lightning's loops resume a checkpoint taken at a batch's end
        exactly (one taken after the loop finished would log the resumed steps one step late)."""
        if not self._saving(trainer) or trainer.global_step == self._last_saved_step:
            return
        every, step = self.every_n_steps, trainer.global_step
        last_batch = trainer.should_stop or 0 < trainer.max_steps <= step
        if last_batch or (every and step // every > self._last_saved_step // every):
            self._write_last(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """``best.ckpt`` when this validation's ``monitor`` is the best so far."""
        if not (self.keep_best and self._saving(trainer)):
            return
        candidates = self._monitor_candidates(trainer)
        if self.monitor not in candidates:
            logged = sorted(k for k in candidates if k.startswith("val/"))
            raise ValueError(f"Checkpoints(keep_best=true): `monitor` {self.monitor!r} was not logged by "
                             f"validation; it logged {logged}")
        self._save_topk_checkpoint(trainer, candidates)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """``last.ckpt`` after the last epoch of a run that ends by ``max_epochs`` (where Lightning writes its
        epoch-end checkpoints); other epochs' ends are left to the step schedule."""
        final = (trainer.max_epochs or 0) > 0 and trainer.current_epoch + 1 >= trainer.max_epochs
        if final and self._saving(trainer) and trainer.global_step > self._last_saved_step:
            self._write_last(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: the run's last batch or epoch wrote ``last.ckpt`` (Lightning's would write it here)."""

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_saved_step": self._last_saved_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._last_saved_step = state_dict.get("last_saved_step", 0)


def is_stock_model_checkpoint(callback: Any) -> bool:
    """Whether ``callback`` is a ``ModelCheckpoint`` with nothing set: the one Lightning adds when a run
    configures none (one configured with its defaults is treated alike)."""
    if type(callback) is not ModelCheckpoint:
        return False
    stock = ModelCheckpoint()
    fields = ("dirpath", "filename", "monitor", "save_last", "save_top_k", "save_weights_only", "mode",
              "_every_n_train_steps", "_every_n_epochs", "_train_time_interval", "_save_on_train_epoch_end",
              "save_on_exception")
    return all(getattr(callback, f, None) == getattr(stock, f, None) for f in fields)
