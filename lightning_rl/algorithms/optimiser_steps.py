"""The strategy-specific half of manual optimisation: :class:`OptimiserSteps`, the :class:`Companion`s
(models trained beside the policy with their own optimiser) it steps, and the optimisers Lightning is given
(:func:`lightning_optimisers`).

The updater (``lightning_rl.step.update``) decides what to accumulate and when to step; this supplies the
rest as its :class:`~lightning_rl.step.update.UpdateHooks`: the gradient-sync context of a micro-batch (DDP
``no_sync``, FSDP2 ``set_requires_gradient_sync``, DeepSpeed's accumulation boundary), the optimiser step
and its LR schedulers, and the clipping that the LightningModule's ``on_before_optimizer_step`` asks for
(after the precision plugin unscaled), with the gradient norm of the model being stepped. One trainer step
is one policy update: a second optimiser steps through the strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_rl.models.sharding import (
    deepspeed_engine,
    full_value,
    is_sharded,
    no_gradient_sync,
    start_deepspeed_micro_batch,
)
from lightning_rl.step.metrics import StepMetrics
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


def lightning_optimisers(optimizer: Any, scheduler_factory: Any, companions: Sequence[Companion]) -> Any:
    """What ``configure_optimizers`` returns: the policy's ``optimizer`` and the scheduler
    ``scheduler_factory`` builds for it (stepped per optimiser step), then each companion's own optimiser
    and scheduler."""
    if not companions:
        if scheduler_factory is None:
            return optimizer
        scheduler = scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
    pairs = [(scheduler_factory, optimizer)]
    pairs += [(c.lr_scheduler, c.optimizer(c.module.parameters())) for c in companions]
    schedulers = [{"scheduler": make(opt), "interval": "step"} for make, opt in pairs if make is not None]
    return [opt for _, opt in pairs], schedulers


@dataclass
class OptimiserSteps:
    """Backward, accumulation, clipping and stepping under the running strategy (see the module docstring).

    Args:
        module: the LightningModule trained manually (its ``trainer``, ``device``, ``policy``,
            ``manual_backward`` and ``clip_gradients``).
        metrics: where the gradient norms go (``<name>/grad_norm``).
        max_grad_norm: clip by global norm (``None``: no clipping; DeepSpeed clips in its engine).
        companions: the models trained beside the policy, by name (``Companion``), whose norms are named so.
    """

    module: Any
    metrics: StepMetrics
    max_grad_norm: float | None
    companions: dict[str, Any]

    def hooks(self) -> UpdateHooks:
        return UpdateHooks(backward=self.module.manual_backward, accumulating=self.accumulating,
                           step=self.step)

    def accumulating(self, roots: list[Any], last: bool) -> Any:
        """The context of one micro-batch's backward: gradients are reduced over ranks only for the last."""
        trainer = self.module.trainer
        engine = deepspeed_engine(trainer)
        if engine is not None:  # its no_sync refuses ZeRO-2/3, which reduce partitions in every backward
            start_deepspeed_micro_batch(engine, boundary=last)
            return contextlib.nullcontext()
        if last:
            return contextlib.nullcontext()
        if is_sharded(self.module.policy.model):  # FSDP2: no wrapper; each trained model is a sharded root
            stack = contextlib.ExitStack()
            for root in roots:
                stack.enter_context(no_gradient_sync(root))
            return stack
        wrapped = getattr(trainer.strategy, "model", None)
        if wrapped is self.module or not hasattr(wrapped, "no_sync"):  # single device
            return contextlib.nullcontext()
        return wrapped.no_sync()

    def step(self, trained: TrainedModel) -> None:
        """Step one trained model's optimiser, then its LR scheduler (DeepSpeed: the engine does both)."""
        trainer, opt = self.module.trainer, trained.optimizer
        if trained.counts_as_step:
            opt.step()
        else:
            trainer.strategy.optimizer_step(opt.optimizer, closure=lambda: None, model=self.module)
        engine = deepspeed_engine(trainer)
        if engine is not None:
            norm = engine.get_global_grad_norm()
            if norm is not None:
                self.metrics.add(self.module.device, {f"{trained.name}/grad_norm": float(norm)})
            return
        for config in trainer.lr_scheduler_configs:
            if config.scheduler.optimizer is opt.optimizer:
                config.scheduler.step()

    def clip(self, optimizer: Any) -> None:
        """Clip by global norm through Lightning (right under AMP, FSDP2) and log the norm before clipping
        as ``<name>/grad_norm`` of the model whose optimiser this is."""
        module, max_norm = self.module, self.max_grad_norm
        if max_norm is None or deepspeed_engine(module.trainer) is not None:
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=module.device)
        norm = full_value(norm)  # FSDP2: a DTensor of partial norms; the global norm on every rank
        if is_sharded(module.policy.model):  # clip_grad_norm_ reduces the DTensor norm over the mesh itself
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            module.clip_gradients(optimizer, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")
        owned = {id(p): name for name, c in self.companions.items() for p in c.module.parameters()}
        name = next((owned[id(p)] for p in params if id(p) in owned), "policy")
        self.metrics.add(module.device, {f"{name}/grad_norm": norm.detach()})
