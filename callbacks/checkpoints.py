"""The default checkpoint policy: one ``last.ckpt`` per run, rewritten on a step schedule and at the end.

Lightning's stock ``ModelCheckpoint`` writes a full checkpoint after every validation (1.6 GB every 10 steps
for a 135M model with its Adam state). :class:`Checkpoints` replaces it in every run that did not configure
a checkpoint callback of its own (``PolicyModule.configure_callbacks``); ``trainer.enable_checkpointing:
false`` still turns checkpoints off.

Every checkpoint a run writes is written atomically (:func:`write_atomically`): a kill while ``last.ckpt`` is
replaced leaves the previous one whole.
"""

from __future__ import annotations

import difflib
import functools
import os
import shutil
from typing import Any, Literal

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import Strategy

from lightning_rl.errors import InputError

PARTIAL = ".partial"  # suffix of a checkpoint being written (`--ckpt_path last` never picks it)
PREVIOUS = ".previous"  # suffix of the folder checkpoint a new one replaces, for the moment between renames


def write_atomically(strategy: Strategy) -> None:
    """From now on ``strategy.save_checkpoint`` writes each checkpoint under a temporary name in its own
    folder (``last.ckpt.partial``), flushes it to disk (fsync) and renames it into place (``os.replace``):
    a kill leaves the previous checkpoint intact. Idempotent.

    Lightning's own save is not atomic when the temporary folder is on another filesystem than the run (a
    tmpfs ``/tmp``, a run on a mounted volume): fsspec writes the file there and ``shutil.move`` then
    *copies* it over the destination, so a kill mid-copy truncates the run's only ``last.ckpt``.

    A sharded checkpoint (FSDP2's distributed checkpoint, DeepSpeed's) is a folder: written whole under
    the temporary name by every rank, then swapped in by rank 0 with two renames (the old folder to
    ``<name>.previous``, the new one into place, the old one removed); ``--ckpt_path last`` also finds a
    ``.previous`` left by a kill between the two. Remote paths (``s3://...``) are written as before.
    """
    save = strategy.save_checkpoint
    if getattr(save, "writes_atomically", False):
        return

    @functools.wraps(save)
    def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, *args: Any, **kwargs: Any) -> None:
        path = str(filepath)
        if "://" in path:
            return save(checkpoint, filepath, *args, **kwargs)
        partial = path + PARTIAL
        if strategy.is_global_zero:
            remove(partial)  # left by a kill during an earlier save
        strategy.barrier("lightning_rl.checkpoints.partial")
        try:
            save(checkpoint, partial, *args, **kwargs)
        except BaseException:
            if strategy.is_global_zero:
                remove(partial)
            raise
        strategy.barrier("lightning_rl.checkpoints.written")  # every rank's shards are in the folder
        if strategy.is_global_zero:
            flush_to_disk(partial)
            move_into_place(partial, path)

    save_checkpoint.writes_atomically = True  # type: ignore[attr-defined]
    strategy.save_checkpoint = save_checkpoint  # type: ignore[method-assign]


def remove(path: str) -> None:
    """Remove the file or folder ``path`` if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def flush_to_disk(path: str) -> None:
    """fsync the file ``path``, or every file under the folder ``path``."""
    if not os.path.isdir(path):
        files = [path]
    else:
        files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def move_into_place(partial: str, path: str) -> None:
    """Rename the finished checkpoint ``partial`` to ``path``, then fsync their folder so that the rename
    itself is on disk. A file replaces a file in one ``os.replace``; where either is a folder, the old one
    is first renamed to ``<path>.previous`` and removed once the new one is in place."""
    if os.path.isdir(partial) or (os.path.isdir(path) and not os.path.islink(path)):
        previous = path + PREVIOUS
        remove(previous)
        if os.path.lexists(path):
            os.replace(path, previous)
        os.replace(partial, path)
        remove(previous)
    else:
        os.replace(partial, path)
    if hasattr(os, "O_DIRECTORY"):  # POSIX: a folder can be opened and synced
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Checkpoints(ModelCheckpoint):
    """Keep the last checkpoint (and, if asked, the best one) in the run's ``checkpoints/`` folder.

    * ``last.ckpt`` is written every ``every_n_steps`` optimiser steps and after the run's last batch (or
      its last epoch under ``max_epochs``), each time replacing the one before: a run holds one, whatever
      its length. ``--ckpt_path last`` resumes it.
    * With ``keep_best``, ``best.ckpt`` too: written after a validation whose ``monitor`` beats every
      earlier one (``mode`` ``max``: higher is better), replacing the previous best. ``monitor`` is checked
      before the first training step against what the sanity check's validation logged (a run with
      ``num_sanity_val_steps: 0`` validates one batch for it): a misspelt name fails there, naming the
      metrics validation logs, not after the steps before the first validation are spent.
    * Each write goes to a temporary name in the same folder, is flushed and renamed into place
      (:func:`write_atomically`): a kill while ``last.ckpt`` is replaced leaves the previous one whole.
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

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Atomic writes; with ``keep_best``, at least one validation batch in the sanity check (which
        checks ``monitor``)."""
        super().setup(trainer, pl_module, stage)
        write_atomically(trainer.strategy)
        fit = stage == "fit" and not trainer.fast_dev_run
        if self.keep_best and fit and trainer.num_sanity_val_steps == 0:
            trainer.num_sanity_val_steps = 1

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """``monitor`` among the metrics the sanity check's validation logged, before any training step."""
        if self.keep_best and trainer.state.fn == "fit" and not trainer.fast_dev_run:
            self._check_monitor(sorted(trainer.callback_metrics), "before the first training step")

    def _check_monitor(self, logged: list[str], when: str) -> None:
        if self.monitor in logged:
            return
        logged = [k for k in logged if k not in ("step", "epoch")]  # Lightning's counters, not metrics
        close = difflib.get_close_matches(str(self.monitor), logged, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise InputError(f"Checkpoints(keep_best=true): `monitor` {self.monitor!r} is not logged by "
                         f"validation (checked {when}); it logs {logged}{hint}: set `monitor` of "
                         "lightning_rl.callbacks.Checkpoints in `trainer.callbacks` to one of them")

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
        if self.monitor not in candidates:  # a resumed run skips the sanity check
            self._check_monitor(sorted(k for k in candidates if k.startswith("val/")), "after a validation")
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
