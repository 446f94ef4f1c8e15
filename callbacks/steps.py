"""A step is one optimiser step everywhere: in ``max_steps``, on the logger's x-axis and on the progress bar.

With manual optimisation (the online RL modules) one trainer batch is one rollout that may take several
optimiser steps (``update.epochs * update.num_minibatches``); Lightning logs such runs at the batch count
and its progress bar counts batches, while ``max_steps`` and ``trainer.global_step`` count optimiser steps.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

# progress-bar names of the metrics the modules log with ``prog_bar=True``
SHORT_NAMES = {
    "rollout/reward_mean": "reward",
    "val/accuracy": "val_acc",
    "train/loss": "loss",
    "rewards/accuracy": "pref_acc",
    "val/rewards/accuracy": "val_pref_acc",
    "val/logps/accuracy": "val_logp_acc",
}


def short_name(name: str) -> str:
    """``val/accuracy`` -> ``val_acc``; other names keep their last part (``val_`` kept for held-out ones)."""
    if name in SHORT_NAMES:
        return SHORT_NAMES[name]
    last = name.rsplit("/", 1)[-1]
    return f"val_{last}" if name.startswith("val/") and name != last else last


class LogAtOptimizerStep(L.Callback):
    """Log every metric at ``trainer.global_step``, the optimiser steps taken when it is logged.

    Lightning uses a logged ``step`` value as the logger's step. A rollout's metrics land at the step
    its updates reached and ``val/*`` at the step it evaluated, the number printed as
    ``step N: val/accuracy = ...``. Automatic optimisation needs nothing: Lightning already counts
    optimiser steps there.
    """

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
        if not pl_module.automatic_optimization:
            pl_module.log("step", float(trainer.global_step), on_step=True, on_epoch=False, batch_size=1)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # only while fitting: `validate` would also print the value in its table of results
        if not pl_module.automatic_optimization and trainer.state.fn == "fit":
            pl_module.log("step", float(trainer.global_step), batch_size=1)


class StepProgressBar(TQDMProgressBar):
    """The training bar counts optimiser steps up to ``max_steps`` (from the resumed step after a resume)
    and shows the ``prog_bar`` metrics under short names (``reward``, ``val_acc``), without ``v_num``.

    Runs bounded by epochs only (``max_steps: -1``) keep Lightning's bar of batches per epoch.
    """

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        if trainer.max_steps <= 0:
            super().on_train_epoch_start(trainer)
            return
        bar = self.train_progress_bar
        if bar.total != trainer.max_steps:  # the first epoch: one bar for the whole run
            bar.reset(total=trainer.max_steps)
            bar.initial = bar.n = trainer.global_step
            bar.set_description(self.train_description)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.max_steps <= 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        done = trainer.global_step >= trainer.max_steps
        if self.is_enabled and not bar.disable and ((batch_idx + 1) % self.refresh_rate == 0 or done):
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return {short_name(name): value for name, value in items.items()}
