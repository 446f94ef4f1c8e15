"""What :class:`~lightning_rl.algorithms.online.OnlineRL` hands the asynchronous sampler
(``model.sampling.max_staleness >= 1``, :mod:`lightning_rl.episodes.async_source`) when it starts: its
engine, the trained parameters' names, the frozen models it scores (the reference, a distillation teacher)
and the DataModule's prompt streams."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lightning_rl.models.adapters import named_trainable_parameters
from lightning_rl.models.sharding import is_sharded


def worker_kind(module: Any) -> str:
    """``model.sampling.worker`` resolved: ``auto`` is a process on CPU, a thread on other devices (a CUDA
    context cannot be forked)."""
    kind, device = module.rollouts.worker, module.device.type
    if kind == "auto":
        return "process" if device == "cpu" else "thread"
    if kind == "process" and device != "cpu":
        raise ValueError(f"`model.sampling.worker: process` forks the learner's process, which a {device} "
                         "context does not survive: use `thread` (or `auto`)")
    return kind


def start_worker(module: Any) -> None:
    """Start ``module``'s sampler worker at the start of training (after a checkpoint's weights loaded)."""
    trainer, dm = module.trainer, module.trainer.datamodule
    thread = worker_kind(module) == "thread"
    if not hasattr(dm, "train_batches"):
        raise ValueError("`model.sampling.max_staleness` >= 1 reads the training prompts ahead of the "
                         "learner: it needs a DataModule with `train_batches(start)` (PromptDataModule), "
                         f"not {type(dm).__name__}")
    io = module.policy_io()  # the engine attached (and a CopyEngine's copy built) before the fork
    engine = module.engine
    frozen = module.frozen.all()
    shared = "reference" in frozen and frozen["reference"].shares_weights
    if shared and (thread or is_sharded(module.policy.model)):
        del frozen["reference"]  # LoRA: the trained model with adapters off: the learner scores it
    model = engine.sampling_model()
    if model is not None and is_sharded(model):
        raise ValueError("`model.sampling.max_staleness` >= 1 under FSDP2 needs a whole copy of the weights "
                         "to sample with: set `model.engine.class_path: lightning_rl.step.engine.CopyEngine` "
                         "(`init_args.dtype: float32` for full precision)")
    if thread:  # beside the learner: its own weights, while the module's engine keeps serving validation
        engine = engine.worker_copy()
        io = replace(io, generate=engine.generate, synced=False)
    names = list(named_trainable_parameters(module.policy.model))
    module.rollouts.start(io=io, engine=engine, names=names,
                          batches=dm.train_batches, refills=getattr(dm, "refill_batches", None),
                          step=trainer.fit_loop.epoch_loop.batch_progress.total.processed,
                          batch_index=dm.batches_consumed, rank=trainer.global_rank,
                          refills_start=getattr(dm, "refills_consumed", 0),
                          frozen=frozen,
                          scoring=(module.sampling.temperature, module.updater.micro_batch_size),
                          thread=thread, device=module.device)
