"""Reward-model training: a one-label sequence classifier fitted to preference pairs (Bradley-Terry).

Each step scores the chosen and the rejected texts of a batch of pairs in one forward pass (the two
halves concatenated on the batch dimension; see :mod:`lightning_rl.models.reward_network` for what is scored
and which token is read) and minimises :func:`~lightning_rl.maths.preference_losses.reward_model_loss`. At the
end of ``fit`` the model and its tokenizer are written to ``<log_dir>/reward_model``, a folder that plain
``AutoModelForSequenceClassification`` and :class:`~lightning_rl.models.reward_model.RewardModelScorer` load.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_rl.algorithms.trained import TrainedModule
from lightning_rl.maths.preference_losses import reward_model_loss
from lightning_rl.models.model_utils import disable_dropout as zero_dropout
from lightning_rl.models.model_utils import enable_gradient_checkpointing
from lightning_rl.models.reward_network import load_reward_network, pair_texts
from lightning_rl.text.prompts import real_rows


class ExportRewardModel(L.Callback):
    """At the end of ``fit``, write the reward model and its tokenizer as
    :class:`~lightning_rl.callbacks.ExportPolicy` writes a policy (which it runs), to ``dirpath`` or by
    default ``<trainer.log_dir>/reward_model``.

    Not a subclass of ``ExportPolicy``: the core imports nothing from ``lightning_rl.callbacks`` when it is
    imported, only when a callback runs.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath

    def target(self, trainer: L.Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        return os.path.join(trainer.log_dir or trainer.default_root_dir, "reward_model")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lightning_rl.callbacks import ExportPolicy

        ExportPolicy(self.target(trainer)).on_train_end(trainer, pl_module)


class RewardModel(TrainedModule):
    """A scalar reward model trained on ``PreferenceDataModule`` pairs (``prompt``, ``chosen``, ``rejected``).

    Logs ``rm/loss``, ``rm/accuracy`` (pairs with chosen scored above rejected, strictly), ``rm/margin``
    (mean ``r_c - r_r``), ``rm/chosen`` / ``rm/rejected`` (mean rewards) and ``data/truncated`` (texts cut
    this step); the ``rm/*`` metrics also under ``val/`` on the held-out pairs, exact means over all of them.

    Its base is :class:`~lightning_rl.algorithms.trained.TrainedModule` (optimiser and scheduler, exact
    validation means, RNG states in checkpoints, callbacks, FSDP2 ``configure_model``), not ``PolicyModule``,
    which loads a causal LM and generates: ``self.policy`` here is the
    :class:`~lightning_rl.models.reward_network.RewardNetwork` being trained. Tested on one process; the
    multi-process (DDP / FSDP2) paths are TrainedModule's, not yet run for this module.

    Args:
        model: where the weights start: a causal LM folder or hub id (backbone; the scalar head is fresh),
            ``builtin:tiny-sort`` (the embedded model), ``builtin:tiny-scratch``, or a reward-model folder
            to keep training.
        dtype: weights dtype (``float32``, ``bfloat16``, ``float16``, ``auto``); ``None``: float32.
        trust_remote_code: allow model code from the hub.
        gradient_checkpointing: trade compute for memory in the forward pass.
        chat_template: render plain-string prompts with the tokenizer's chat template (message rows always
            are), as DPO does.
        max_length: tokens kept per scored text (prompt + completion); longer ones keep their last
            ``max_length`` tokens (the score is read at the last one) and are counted in ``data/truncated``.
        center_rewards_coefficient: weight of ``mean((r_c + r_r)^2)`` in the loss (TRL's name); 0: off.
        margin_column: a data column of per-pair margins subtracted inside the sigmoid
            (``-log sigmoid(r_c - r_r - m)``, Llama 2); every train and held-out row must have it.
            ``None``: no margin.
        disable_dropout: set dropout to 0 (as TRL's ``RewardConfig`` does by default).
        optimizer: optimiser factory (YAML ``class_path`` + ``init_args``); AdamW by default.
        lr_scheduler: optional LR scheduler factory, stepped once per optimiser step.
    """

    def __init__(
        self,
        model: str = "builtin:tiny-sort",
        dtype: str | None = None,
        trust_remote_code: bool = False,
        gradient_checkpointing: bool = False,
        chat_template: bool = False,
        max_length: int = 512,
        center_rewards_coefficient: float = 0.0,
        margin_column: str | None = None,
        disable_dropout: bool = True,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        if max_length < 1:
            raise ValueError(f"`model.max_length` must be >= 1, got {max_length}")
        if not center_rewards_coefficient >= 0:
            raise ValueError(
                f"`model.center_rewards_coefficient` must be >= 0, got {center_rewards_coefficient}"
            )
        self.policy = load_reward_network(model, dtype, trust_remote_code, new_head=True, key="model.model")
        if gradient_checkpointing:
            enable_gradient_checkpointing(self.policy.model)
        if disable_dropout:
            zero_dropout(self.policy.model)  # the argument shadows the function's name
        self.chat_template, self.max_length = chat_template, max_length
        self.center_rewards_coefficient, self.margin_column = center_rewards_coefficient, margin_column
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    # ---- setup -------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        """``TrainedModule``'s checks, then the margins. Texts longer than ``max_length`` are cut on the left
        (and counted), not refused."""
        super().on_fit_start()
        self.check_margins()

    def check_margins(self) -> None:
        """Fail before the first step unless every train / held-out row holds a number in ``margin_column``
        (when it is set)."""
        if self.margin_column is None:
            return
        dm = getattr(self.trainer, "datamodule", None)
        for split in ("train", "val"):
            for i, row in enumerate(getattr(dm, f"{split}_rows", None) or []):
                _margin_value(row.get(self.margin_column), self.margin_column, f"{split} row {i}")

    def configure_callbacks(self) -> list[L.Callback]:
        """``TrainedModule``'s, with the export writing ``<log_dir>/reward_model`` (unless the trainer already
        has an ``ExportRewardModel``, e.g. one with its own ``dirpath``)."""
        from lightning_rl.callbacks import ExportPolicy
        from lightning_rl.callbacks.defaults import has_callback

        export = [] if has_callback(self.trainer, ExportRewardModel) else [ExportRewardModel()]
        callbacks = super().configure_callbacks()
        return [new for cb in callbacks for new in (export if type(cb) is ExportPolicy else [cb])]

    # ---- the loss ----------------------------------------------------------------------------
    def pair_loss(self, batch: dict[str, list]) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """The loss of a batch of pairs, its metrics (``rm/*``) and how many of its texts were cut."""
        texts, specials = pair_texts(self.tokenizer, batch["prompt"], batch["chosen"], batch["rejected"],
                                     self.chat_template)
        enc = self.policy.encode(texts, max_length=self.max_length, add_special_tokens=specials)
        scores = self.policy(enc.input_ids, enc.attention_mask)
        n = len(batch["prompt"])
        loss, metrics = reward_model_loss(scores[:n], scores[n:], self.margins(batch),
                                          center_coef=self.center_rewards_coefficient)
        return loss, metrics, enc.truncated

    def margins(self, batch: dict[str, list]) -> torch.Tensor | None:
        """``[B]`` float32 margins from ``margin_column``, or ``None`` when it is off."""
        if self.margin_column is None:
            return None
        values = batch.get(self.margin_column) or [None] * len(batch["prompt"])
        margins = [_margin_value(v, self.margin_column, f"batch row {i}") for i, v in enumerate(values)]
        return torch.tensor(margins, dtype=torch.float32, device=self.device)

    # ---- loop hooks --------------------------------------------------------------------------
    def training_step(self, batch: dict[str, list], batch_idx: int) -> torch.Tensor:
        """One step. Metrics are means over ranks (``sync_dist``; every rank holds ``batch_size`` pairs)."""
        loss, metrics, truncated = self.pair_loss(batch)
        values = {"rm/loss": loss.detach(), **metrics, "data/truncated": float(truncated)}
        for name, value in values.items():
            self.log(name, value, batch_size=len(batch["prompt"]), sync_dist=True,
                     prog_bar=name in ("rm/loss", "rm/accuracy"))
        return loss

    val_prog_bar = ("val/rm/accuracy",)

    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        batch, weight = real_rows(batch)
        loss, metrics, _ = self.pair_loss(batch)
        self.log_val_mean("val/rm/loss", loss, weight)
        for name, value in metrics.items():
            self.log_val_mean(f"val/{name}", value, weight)


def _margin_value(value: Any, column: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"{where}: column `{column}` (model.margin_column) must hold a number, got {value!r}"
        )
    return float(value)
