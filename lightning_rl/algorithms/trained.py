"""What every trained module shares, whatever it trains (a policy, a reward model): :class:`TrainedModule`.

Its optimiser and scheduler, FSDP2 sharding and DeepSpeed defaults, and the learning rate in the logs. It
holds what its checkpoints carry beside the weights (``checkpoint_state.CheckpointState``) and the exact
validation means (``validation_means.ValidationMeans``), and returns the default callbacks
(``lightning_rl.callbacks.defaults``). The trained network is ``self.policy`` (a
:class:`~lightning_rl.models.policy.Policy` in :class:`~lightning_rl.algorithms.base.PolicyModule`, a reward
network in :class:`~lightning_rl.algorithms.reward_model.RewardModel`): it has ``.model`` (the transformers
module), ``train()`` and ``save_pretrained(path)``; ``ExportPolicy`` writes it (merged when
``export_merged``) and the companions of ``extra_exports``. The CLI accepts any subclass as
``model.class_path``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_rl.algorithms.checkpoint_state import CheckpointState
from lightning_rl.algorithms.input_checks import warn_if_lr_is_zero
from lightning_rl.algorithms.optimiser_steps import lightning_optimisers
from lightning_rl.algorithms.presets import with_changes
from lightning_rl.algorithms.validation_means import ValidationMeans
from lightning_rl.models.adapters import trainable_parameters
from lightning_rl.models.sharding import FSDPOptions, refuse_fsdp1, shard_policy_model, strategy_is
from lightning_rl.models.strategies import fill_deepspeed_config
from lightning_rl.step.rng import restore_rng_states


class TrainedModule(L.LightningModule):
    """Base of every LightningModule here (see the module docstring). Subclasses set ``policy``,
    ``optimizer_factory`` and ``scheduler_factory`` in their ``__init__``."""

    policy: Any
    optimizer_factory: Any
    scheduler_factory: Any = None
    fsdp: FSDPOptions | None = None  # how FSDP2 holds the weights (PolicyModule's from `policy.fsdp`)
    export_merged: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.val_means = ValidationMeans()  # held beyond one validation: what it says once per run
        self.rng_states: Any = None  # a resumed checkpoint's, restored when training starts

    @classmethod
    def configured(cls, **changes: Any) -> Any:
        """This class with some fields of its option groups changed, as a YAML would:
        ``DAPO.configured(sampling={"num_generations": 4})`` keeps DAPO's other defaults (a group given whole
        replaces the default; anything else is passed as is)."""
        return cls(**with_changes(cls, changes))

    # ---- setup -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """FSDP2: ``fully_shard`` each decoder layer, then the root, of the policy's model and of each
        companion's, on the data-parallel mesh.

        Only under ``ModelParallelStrategy`` (which sets ``device_mesh``); idempotent. The frozen reference
        stays whole on each rank (see ``lightning_rl.models.sharding``). Lightning's FSDP1 strategy is
        refused.
        """
        refuse_fsdp1(self.trainer.strategy)
        mesh = self.device_mesh
        if mesh is None:
            return
        for model in [self.policy.model, *(c.module.model for c in self.companions().values())]:
            shard_policy_model(model, mesh, self.fsdp)

    reference_stages: tuple[str, ...] = ()  # trainer stages (fit, validate) that use a frozen reference

    def companions(self) -> dict[str, Any]:
        """Models trained beside the policy, by name, as ``optimiser_steps.Companion`` (PPO: its value model);
        each is sharded, put in train mode, given its optimiser and exported like the policy."""
        return {}

    def extra_exports(self) -> dict[str, Any]:
        """Written by ``ExportPolicy`` next to the policy folder: one folder per companion, by its name."""
        return {name: companion.module for name, companion in self.companions().items()}

    def reference_policy(self) -> Any:
        """The frozen reference, built on first use (``None`` for modules without one)."""
        return None

    def setup(self, stage: str) -> None:
        """The one setup of every module: refuse DeepSpeed for modules with companions, fill the DeepSpeed
        config's keys this module decides (``deepspeed_defaults``, ``strategies.fill_deepspeed_config``), and
        build the frozen reference of the stages that use one, before Lightning loads a resumed
        checkpoint's trained weights."""
        strategy = self.trainer.strategy
        if self.companions() and strategy_is(strategy, ("DeepSpeedStrategy",)):
            raise ValueError(f"{type(self).__name__} trains two models with two optimisers and Lightning's "
                             "DeepSpeed strategy takes one: use DDP or FSDP2 (configs/strategy/fsdp2.yaml)")
        if stage in self.reference_stages:
            self.reference_policy()
        fill_deepspeed_config(strategy, self.deepspeed_defaults())

    def deepspeed_defaults(self) -> dict[str, Any]:
        """DeepSpeed config entries implied by this module's settings (see ``setup``)."""
        return {"train_micro_batch_size_per_gpu": 1}

    def on_fit_start(self) -> None:
        """Before any validation or training step: the trained network in train mode (HF models load in
        eval mode and Lightning keeps it) and its companions, and a warning when the learning rate is 0."""
        for trained in [self.policy, *(c.module for c in self.companions().values())]:
            trained.train()
        warn_if_lr_is_zero(self.trainer.optimizers,
                           [config.scheduler for config in self.trainer.lr_scheduler_configs])

    # ---- checkpoints: what is saved beside the weights, optimiser and data position ------------------
    def checkpoint_state(self) -> CheckpointState:
        """What this module's checkpoints carry beside the weights (``OnlineRL`` adds its own)."""
        return CheckpointState(self.policy.model)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.checkpoint_state().save(checkpoint, self._trainer)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.rng_states = self.checkpoint_state().load(checkpoint, self._trainer)

    def on_train_start(self) -> None:
        if self.rng_states is not None:  # after sanity validation, so it can't shift them
            restore_rng_states(self.rng_states)
            self.rng_states = None

    def configure_callbacks(self) -> list[L.Callback]:
        """What every run gets unless the user configured the same callback
        (``lightning_rl.callbacks.defaults``)."""
        from lightning_rl.callbacks.defaults import default_callbacks

        return default_callbacks(self.trainer)

    def configure_optimizers(self) -> Any:
        """The policy's optimiser (and scheduler); each companion's own optimiser and scheduler after it."""
        optimizer = self.optimizer_factory(trainable_parameters(self.policy))
        return lightning_optimisers(optimizer, self.scheduler_factory, list(self.companions().values()))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.trainer.optimizers[0] if self.trainer.optimizers else None
        if optimizer is not None:  # the learning rate this step's (first) optimiser step uses
            self.log("optim/lr", float(optimizer.param_groups[0]["lr"]), on_step=True, on_epoch=False,
                     batch_size=1)

    # ---- validation metrics: exact means over held-out rows on any world size ---------------------
    def on_validation_epoch_start(self) -> None:
        self.val_means.start()

    def log_val_mean(self, name: str, value: torch.Tensor | float, weight: float) -> None:
        """Add ``value``, a mean over ``weight`` held-out rows, to this validation's mean of ``name``."""
        self.val_means.add(name, value, weight, self.device)

    def on_validation_epoch_end(self) -> None:
        results = self.val_means.reduce(self.trainer.strategy)
        for name, value in results.items():
            self.log(name, value, prog_bar=name in self.val_prog_bar)
        self.val_means.report(results, shown=self.val_prog_bar, step=self.global_step,
                              sanity_loggers=self.loggers if self.trainer.sanity_checking else [],
                              accuracy_name=getattr(self, "accuracy_name", None))

    val_prog_bar: tuple[str, ...] = ("val/accuracy",)  # validation metrics on the progress bar and printed
