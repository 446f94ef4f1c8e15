"""Lightning glue of the online step: manual optimisation of the policy and of any companion (a model
trained beside it with its own optimiser, such as PPO's value model), their setup, sharding, clipping,
checkpointed state and callbacks.

The updater (``lightning_rl.step.update``) decides what to accumulate and when to step; this mixin supplies
the strategy-specific parts as :class:`~lightning_rl.step.update.UpdateHooks`: the gradient-sync context of a
micro-batch (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``, DeepSpeed's accumulation boundary),
the optimiser step (clipping in ``on_before_optimizer_step``, after the precision plugin unscaled) and the
LR schedulers. One trainer step is one policy update: a second optimiser steps through the strategy.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_rl.algorithms.ahead import WorkerSpec, start_worker
from lightning_rl.models.adapters import trainable_parameters
from lightning_rl.models.sharding import (
    deepspeed_engine,
    full_value,
    is_sharded,
    no_gradient_sync,
    prompt_sharing,
    shard_policy_model,
    start_deepspeed_micro_batch,
)
from lightning_rl.step.filters import DynamicSampling
from lightning_rl.step.metrics import StepMetrics
from lightning_rl.step.rollout import Rollout, rollout_stats
from lightning_rl.step.update import TrainedModel, UpdateHooks


@dataclass
class Companion:
    """A model trained beside the policy, with its own optimiser and scheduler.

    Args:
        module: the model (registered on the LightningModule, so checkpointed with it); it has
            ``.model`` (the transformers module that FSDP2 shards), ``parameters()`` and ``train()``.
        optimizer, lr_scheduler: its optimiser and scheduler factories.
    """

    module: Any
    optimizer: Any
    lr_scheduler: Any = None


class ManualSteps:
    """Mixin for :class:`~lightning_rl.algorithms.online.OnlineRL` (see the module docstring)."""

    @property
    def step_metrics(self) -> StepMetrics:
        if "_step_metrics" not in self.__dict__:
            self.__dict__["_step_metrics"] = StepMetrics()
        return self.__dict__["_step_metrics"]

    def rl_callbacks(self) -> list:
        from lightning_rl.callbacks.base import RLCallback

        return [cb for cb in self.trainer.callbacks if isinstance(cb, RLCallback)]

    # ---- setup ----------------------------------------------------------------------------------
    def deepspeed_defaults(self) -> dict[str, Any]:
        """Under DeepSpeed the engine clips (after unscaling, on its partitions): ``max_grad_norm`` goes
        there."""
        return {**super().deepspeed_defaults(), "gradient_clipping": self.updater.max_grad_norm or 0.0}

    def configure_model(self) -> None:
        """FSDP2: each companion is sharded like the policy (each decoder layer, then the root)."""
        super().configure_model()
        for companion in self.companions().values() if self.device_mesh is not None else ():
            shard_policy_model(companion.module.model, self.device_mesh, cpu_offload=self.fsdp_cpu_offload,
                               param_dtype=self.fsdp_param_dtype, reduce_dtype=self.fsdp_reduce_dtype)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.policy.disable_dropout()  # log-probs must match what sampling saw
        for companion in self.companions().values():
            companion.module.train()
        share = prompt_sharing(self.share_prompt_prefix, self.policy.model)
        self.policy.share_prompts = share
        for frozen in self.frozen.all().values():  # the reference, a teacher: scored like the policy
            frozen.share_prompts, frozen.logprob_chunk = share, self.policy.logprob_chunk
            frozen.packing = self.policy.packing
            frozen.to(self.device)
        if self.policy.packing:
            self.policy.check_packing()  # every rank at once, before the first step
        if self.reward_pipeline.reward_model is not None:
            self.reward_pipeline.reward_model.to(self.device)
        filters = getattr(self.rollouts, "source", self.rollouts).filters
        if any(isinstance(f, DynamicSampling) for f in filters):
            rank_zero_info("dynamic sampling keeps the groups whose samples' outcomes differ; the outcome: "
                           f"{self.reward_pipeline.outcome_name()}")

    def on_train_start(self) -> None:
        super().on_train_start()  # after a resumed checkpoint's weights and RNG: the worker starts from them
        if self.rollouts.max_staleness:
            start_worker(self.worker_spec(), self.rollouts, self.trainer)

    def worker_spec(self) -> WorkerSpec:
        """What the worker sampling ahead is handed (``policy_io`` attaches the engine and builds a
        ``CopyEngine``'s copy before the fork)."""
        return WorkerSpec(io=self.policy_io(), engine=self.engine, model=self.policy.model,
                          frozen=self.frozen.all(), micro_batch_size=self.updater.micro_batch_size,
                          kind=self.rollouts.worker, device=self.device)

    def teardown(self, stage: str) -> None:
        self.rollouts.close()  # a worker sampling ahead stops with the run, however it ends
        super().teardown(stage)

    def compact_sampling_allowed(self) -> bool:
        return self.share_prompt_prefix

    def extra_exports(self) -> dict[str, Any]:
        """Written by ``ExportPolicy`` next to the policy folder: one folder per companion, by its name."""
        return {name: companion.module for name, companion in self.companions().items()}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.kl_reward is not None:
            checkpoint["kl_coef_value"] = self.kl_reward.value  # the adaptive controller's state
        if self.rollouts.max_staleness:  # the rollouts sampled ahead, trained on after a resume
            next_step = self.trainer.fit_loop.epoch_loop.batch_progress.total.processed
            mine = self.rollouts.state_dict(next_step)
            checkpoint["rollouts_ahead"] = mine
            trainer = self.trainer  # rank 0 writes the file: every rank's rollouts travel in it
            if trainer.world_size > 1 and torch.distributed.is_initialized():
                by_rank: list[Any] = [None] * trainer.world_size
                torch.distributed.all_gather_object(by_rank, mine)
                checkpoint["rollouts_ahead_by_rank"] = by_rank

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.kl_reward is not None and "kl_coef_value" in checkpoint:
            self.kl_reward.value = checkpoint["kl_coef_value"]
        by_rank = checkpoint.get("rollouts_ahead_by_rank")
        if by_rank and len(by_rank) == self.trainer.world_size:
            self.rollouts.load_state_dict(by_rank[self.trainer.global_rank])
        elif "rollouts_ahead" in checkpoint and not by_rank:
            self.rollouts.load_state_dict(checkpoint["rollouts_ahead"])

    def configure_optimizers(self) -> Any:
        """The policy's optimiser (and scheduler); each companion's own optimiser and scheduler after it."""
        companions = list(self.companions().values())
        if not companions:
            return super().configure_optimizers()
        pairs = [(self.scheduler_factory, self.optimizer_factory(trainable_parameters(self.policy)))]
        pairs += [(c.lr_scheduler, c.optimizer(c.module.parameters())) for c in companions]
        schedulers = [{"scheduler": make(opt), "interval": "step"} for make, opt in pairs if make is not None]
        return [opt for _, opt in pairs], schedulers

    # ---- the updater's hooks -------------------------------------------------------------------------
    def update_hooks(self) -> UpdateHooks:
        return UpdateHooks(backward=self.manual_backward, accumulating=self.accumulating,
                           step=self.step_trained)

    def accumulating(self, roots: list[Any], last: bool) -> Any:
        """The context of one micro-batch's backward: gradients are reduced over ranks only for the last."""
        engine = deepspeed_engine(self.trainer)
        if engine is not None:  # its no_sync refuses ZeRO-2/3, which reduce partitions in every backward
            start_deepspeed_micro_batch(engine, boundary=last)
            return contextlib.nullcontext()
        if last:
            return contextlib.nullcontext()
        if is_sharded(self.policy.model):  # FSDP2: no wrapper; each trained model is a sharded root
            stack = contextlib.ExitStack()
            for root in roots:
                stack.enter_context(no_gradient_sync(root))
            return stack
        wrapped = getattr(self.trainer.strategy, "model", None)
        if wrapped is self or not hasattr(wrapped, "no_sync"):  # single device
            return contextlib.nullcontext()
        return wrapped.no_sync()

    def step_trained(self, trained: TrainedModel) -> None:
        """Step one trained model's optimiser, then its LR scheduler (DeepSpeed: the engine does both)."""
        opt = trained.optimizer
        if trained.counts_as_step:
            opt.step()
        else:
            self.trainer.strategy.optimizer_step(opt.optimizer, closure=lambda: None, model=self)
        engine = deepspeed_engine(self.trainer)
        if engine is not None:
            norm = engine.get_global_grad_norm()
            if norm is not None:
                self.step_metrics.add(self.device, {f"{trained.name}/grad_norm": float(norm)})
            return
        for config in self.trainer.lr_scheduler_configs:
            if config.scheduler.optimizer is opt.optimizer:
                config.scheduler.step()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Clip by global norm through Lightning (right under AMP, FSDP2) and log the norm before clipping
        as ``<name>/grad_norm`` of the model whose optimiser this is."""
        max_norm = self.updater.max_grad_norm
        if max_norm is None or deepspeed_engine(self.trainer) is not None:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        norm = full_value(norm)  # FSDP2: a DTensor of partial norms; the global norm on every rank
        if is_sharded(self.policy.model):  # clip_grad_norm_ reduces the DTensor norm over the mesh itself
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            self.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")
        owned = {id(p): name for name, c in self.companions().items() for p in c.module.parameters()}
        name = next((owned[id(p)] for p in params if id(p) in owned), "policy")
        self.step_metrics.add(self.device, {f"{name}/grad_norm": norm.detach()})

    # ---- observing: stages return numbers, this module logs them, callbacks read them ----------
    def observe(self, rollout: Rollout) -> None:
        if len(rollout):
            for name, (value, weight) in rollout_stats(rollout).items():
                self.step_metrics.add(self.device, {name: value}, weight)
        for cb in self.rl_callbacks():
            cb.on_rollout_end(self.trainer, self, rollout)

    def end_step(self, stats: dict[str, float]) -> None:
        self.step_metrics.add_stats(self.device, stats)
        self.step_metrics.log(self.device, lambda name, value: self.log(
            name, value, on_step=True, on_epoch=False, batch_size=1, prog_bar=name == "rollout/reward_mean"))
        for cb in self.rl_callbacks():
            cb.on_step_end(self.trainer, self, MappingProxyType(stats))
