"""What every trained module shares, whatever it trains (a policy, a reward model): :class:`TrainedModule`.

Its optimiser and scheduler, FSDP2 sharding and DeepSpeed defaults, RNG states in checkpoints, the callbacks
every run gets, the learning rate in the logs, exact validation means over held-out rows on any world size,
and the export. The trained network is ``self.policy`` (a :class:`~lightning_rl.models.policy.Policy` in
:class:`~lightning_rl.algorithms.base.PolicyModule`, a reward network in
:class:`~lightning_rl.algorithms.reward_model.RewardModel`): it has ``.model`` (the transformers module),
``train()`` and ``save_pretrained(path)``. The CLI accepts any subclass as ``model.class_path``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_rl.algorithms.input_checks import warn_if_lr_is_zero
from lightning_rl.algorithms.presets import with_changes
from lightning_rl.errors import InputError
from lightning_rl.models.adapters import is_peft_model, trainable_parameters
from lightning_rl.models.sharding import refuse_fsdp1, shard_policy_model, strategy_is
from lightning_rl.step.rng import collect_rng_states, restore_rng_states


class TrainedModule(L.LightningModule):
    """Base of every LightningModule here (see the module docstring). Subclasses set ``policy``,
    ``optimizer_factory`` and ``scheduler_factory`` in their ``__init__``."""

    policy: Any
    optimizer_factory: Any
    scheduler_factory: Any = None
    fsdp_cpu_offload: bool = False  # FSDP2 settings (PolicyModule reads them from `policy` options)
    fsdp_param_dtype: str | None = None
    fsdp_reduce_dtype: str | None = None
    export_merged: bool = False

    @classmethod
    def configured(cls, **changes: Any) -> Any:
        """This class with some fields of its option groups changed, as a YAML would:
        ``DAPO.configured(sampling={"num_generations": 4})`` keeps DAPO's other defaults (a group given whole
        replaces the default; anything else is passed as is)."""
        return cls(**with_changes(cls, changes))

    # ---- setup -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """FSDP2: ``fully_shard`` each decoder layer, then the policy's model, on the data-parallel mesh.

        Only under ``ModelParallelStrategy`` (which sets ``device_mesh``); idempotent. The frozen reference
        stays whole on each rank (see ``lightning_rl.models.sharding``). Lightning's FSDP1 strategy is
        refused.
        """
        refuse_fsdp1(self.trainer.strategy)
        mesh = self.device_mesh
        if mesh is None:
            return
        shard_policy_model(self.policy.model, mesh, cpu_offload=self.fsdp_cpu_offload,
                           param_dtype=self.fsdp_param_dtype, reduce_dtype=self.fsdp_reduce_dtype)

    reference_stages: tuple[str, ...] = ()  # trainer stages (fit, validate) that use a frozen reference

    def companions(self) -> dict[str, Any]:
        """Models trained beside the policy, by name, as ``stepping.Companion`` (PPO: its value model)."""
        return {}

    def reference_policy(self) -> Any:
        """The frozen reference, built on first use (``None`` for modules without one)."""
        return None

    def setup(self, stage: str) -> None:
        """The one setup of every module: refuse DeepSpeed for modules with companions, fill the DeepSpeed
        config's keys this module decides (``deepspeed_defaults``), and build the frozen reference of the
        stages that use one, before Lightning loads a resumed checkpoint's trained weights.

        Runs before the strategy formats its config. A key the user's DeepSpeed config sets wins (a warning
        says so when it differs). Without ``train_micro_batch_size_per_gpu`` Lightning reads it from the
        train loader's batch sampler, which our streamed prompt loaders do not have (it is only used for
        DeepSpeed's throughput logs).
        """
        strategy = self.trainer.strategy
        deepspeed = strategy_is(strategy, ("DeepSpeedStrategy",))
        if self.companions() and deepspeed:
            raise ValueError(f"{type(self).__name__} trains two models with two optimisers and Lightning's "
                             "DeepSpeed strategy takes one: use DDP or FSDP2 (configs/strategy/fsdp2.yaml)")
        if stage in self.reference_stages:
            self.reference_policy()
        config = getattr(strategy, "config", None)
        if not deepspeed or not isinstance(config, dict):
            return
        for key, value in self.deepspeed_defaults().items():
            if key in config and config[key] != value and key != "train_micro_batch_size_per_gpu":
                rank_zero_warn(f"the DeepSpeed config sets `{key}: {config[key]}`, used instead of {value} "
                               "from the model's settings")
            config.setdefault(key, value)

    def deepspeed_defaults(self) -> dict[str, Any]:
        """DeepSpeed config entries implied by this module's settings (see ``setup``)."""
        return {"train_micro_batch_size_per_gpu": 1}

    def on_fit_start(self) -> None:
        """Before any validation or training step: the trained network in train mode (HF models load in
        eval mode and Lightning keeps it), and a warning when the learning rate is 0."""
        self.policy.train()
        warn_if_lr_is_zero(self.trainer.optimizers,
                           [config.scheduler for config in self.trainer.lr_scheduler_configs])

    # ---- checkpoints: RNG states travel with the weights, optimiser and data position -------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """This rank's RNG states, and with several ranks every rank's (``rng_states_by_rank``): Lightning
        writes the checkpoint rank 0 built (one metadata file under sharded checkpoints too), so the other
        ranks' states are gathered into it (every rank builds the checkpoint, so all join the gather)."""
        checkpoint["rng_states"] = collect_rng_states()
        checkpoint["policy_peft"] = is_peft_model(self.policy.model)  # what `on_load_checkpoint` checks
        trainer = self._trainer
        if trainer is not None and trainer.world_size > 1 and torch.distributed.is_initialized():
            by_rank: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(by_rank, checkpoint["rng_states"])
            checkpoint["rng_states_by_rank"] = by_rank

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Each rank restores its own RNG states when resumed on the same world size; otherwise the saved
        rank's (rank 0's). A checkpoint of LoRA adapters resumed without ``model.policy.peft`` (or of a full
        model resumed with it) is refused in one line, before its weights are loaded."""
        trainer = self._trainer
        saved = checkpoint.get("policy_peft", saved_with_adapters(checkpoint.get("state_dict")))
        mismatch = adapters_mismatch(saved, is_peft_model(self.policy.model))
        if mismatch is not None:
            path = getattr(trainer, "ckpt_path", None) if trainer is not None else None
            raise InputError(f"the checkpoint{f' {path}' if path else ''} {mismatch}")
        by_rank = checkpoint.get("rng_states_by_rank")
        if by_rank and trainer is not None and len(by_rank) == trainer.world_size:
            self._rng_states = by_rank[trainer.global_rank]
        else:
            self._rng_states = checkpoint.get("rng_states")

    def on_train_start(self) -> None:
        if getattr(self, "_rng_states", None) is not None:  # after sanity validation, so it can't shift them
            restore_rng_states(self._rng_states)
            self._rng_states = None

    def configure_callbacks(self) -> list[L.Callback]:
        """What every run gets unless the user configured the same callback: the final policy's export, a
        checkpoint on Ctrl-C / SIGTERM, logging at optimiser steps, and Lightning's stock progress bar and
        checkpoint callback swapped for one that counts optimiser steps and for :class:`Checkpoints` (one
        ``last.ckpt``; a checkpoint callback or progress bar configured by the user is left alone)."""
        from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

        from lightning_rl import callbacks as cbs
        from lightning_rl.callbacks.checkpoints import is_stock_model_checkpoint

        wanted = [cbs.ExportPolicy(), cbs.CheckpointOnInterrupt(), cbs.LogAtOptimizerStep()]
        wanted.append(cbs.BatchGeometry())  # a resume with another batch size / G / world size is refused
        if self.trainer.predicting:  # predict writes its rows (the CLI adds one, set by `--predictions.*`)
            wanted.append(cbs.WritePredictions())
        callbacks = [cb for cb in wanted if not has_callback(self.trainer, type(cb))]
        stock = [cb for cb in self.trainer.checkpoint_callbacks if is_stock_model_checkpoint(cb)]
        if stock and len(self.trainer.checkpoint_callbacks) == 1:  # Lightning's default: our policy instead
            self.trainer.callbacks.remove(stock[0])
            callbacks.append(cbs.Checkpoints())
        bar = self.trainer.progress_bar_callback
        if type(bar) in (TQDMProgressBar, RichProgressBar):
            # removed here rather than overridden by type, which only covers subclasses (Rich is the default)
            self.trainer.callbacks.remove(bar)
            # TQDM's refresh rate counts batches; Rich's counts redraws per second (default 100), which as a
            # batch count would freeze the bar for 100 steps: a Rich bar becomes one refresh per step
            rate = bar.refresh_rate if isinstance(bar, TQDMProgressBar) else int(bar.refresh_rate > 0)
            callbacks.append(cbs.StepProgressBar(refresh_rate=rate))
        return callbacks

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(trainable_parameters(self.policy))
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.trainer.optimizers[0] if self.trainer.optimizers else None
        if optimizer is not None:  # the learning rate this step's (first) optimiser step uses
            self.log("optim/lr", float(optimizer.param_groups[0]["lr"]), on_step=True, on_epoch=False,
                     batch_size=1)

    # ---- validation metrics: exact means over held-out rows on any world size ---------------------
    def on_validation_epoch_start(self) -> None:
        self._val_sums: dict[str, torch.Tensor] = {}

    def log_val_mean(self, name: str, value: torch.Tensor | float, weight: float) -> None:
        """Add ``value``, a mean over ``weight`` held-out rows, to this validation's mean of ``name``.

        Sums and counts are all-reduced once at the end of validation, so the logged value is the mean
        over every held-out row exactly once (Lightning's ``sync_dist`` averages per-rank means instead).
        """
        sums = self._val_sums.setdefault(name, torch.zeros(2, device=self.device))
        value = torch.as_tensor(value, dtype=torch.float32, device=self.device).detach()
        sums += torch.stack([value * weight, value.new_tensor(weight)])

    def on_validation_epoch_end(self) -> None:
        results = {}
        for name in sorted(self._val_sums):  # the same names on every rank: every rank ran >= 1 batch
            total, count = self.trainer.strategy.reduce(self._val_sums[name].clone(), reduce_op="sum")
            results[name] = total / count.clamp_min(1)
            self.log(name, results[name], prog_bar=name in self.val_prog_bar)
        if self.trainer.sanity_checking and results:
            # Lightning logs nothing during the sanity pass: record it as the starting point of every curve
            for logger in self.loggers:
                logger.log_metrics({k: float(v) for k, v in results.items()}, step=self.global_step)
        shown = [f"{k} = {float(results[k]):.3f}" for k in self.val_prog_bar if k in results]
        if shown and not getattr(self, "_said_accuracy", False) and "val/accuracy" in results:
            rank_zero_info(f"val/accuracy: the mean of {self.accuracy_name} on greedy completions")
            self._said_accuracy = True
        if shown:
            rank_zero_info(f"step {self.global_step}: " + ", ".join(shown))

    val_prog_bar: tuple[str, ...] = ("val/accuracy",)  # validation metrics on the progress bar and printed

    def save_pretrained(self, path: str) -> None:
        """Write the policy and tokenizer as a folder that ``transformers`` loads directly (with adapters: the
        adapter folder, or the merged weights when ``export_merged``)."""
        if self.export_merged:
            self.policy.save_pretrained(path, merged=True)
        else:
            self.policy.save_pretrained(path)


def saved_with_adapters(state_dict: dict[str, Any] | None) -> bool | None:
    """Whether a checkpoint's weights are a PEFT policy's (named ``policy.model.base_model...``), for
    checkpoints older than its ``policy_peft`` entry; None when it holds no policy weights (a sharded
    folder's, which the strategy loads itself)."""
    names = [k for k in state_dict or () if k.startswith("policy.model.")]
    return any(k.startswith("policy.model.base_model.") for k in names) if names else None


def adapters_mismatch(saved_peft: bool | None, peft_now: bool) -> str | None:
    """Why a checkpoint saved with (``saved_peft``) or without PEFT adapters does not fit this policy, with
    (``peft_now``) or without them; None when it fits or is not known."""
    if saved_peft is None or saved_peft == peft_now:
        return None
    if saved_peft:
        return ("holds PEFT (LoRA) adapters, saved by a run with `model.policy.peft`, but this config has no "
                "`model.policy.peft`: resume it with the `model.policy.peft` of the run that saved it")
    return ("holds a full model's weights, saved by a run without `model.policy.peft`, but this config sets "
            "`model.policy.peft`: resume it without `model.policy.peft` (to train adapters on these "
            "weights, start a new run from its exported policy folder)")


def has_callback(trainer: L.Trainer, kind: type) -> bool:
    return any(isinstance(cb, kind) for cb in trainer.callbacks)
