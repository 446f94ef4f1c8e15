"""What :class:`~lightning_rl.algorithms.online.OnlineRL` hands the asynchronous sampler
(``model.sampling.max_staleness >= 1``, :mod:`lightning_rl.episodes.async_source`) when it starts: its
engine, the trained parameters' names, the frozen reference and the DataModule's prompt streams."""

from __future__ import annotations

from typing import Any

from lightning_rl.models.adapters import named_trainable_parameters
from lightning_rl.models.sharding import is_sharded


def start_worker(module: Any) -> None:
    """Fork ``module``'s sampler worker at the start of training (after a checkpoint's weights loaded)."""
    trainer, dm = module.trainer, module.trainer.datamodule
    if module.device.type != "cpu":
        raise ValueError("`model.sampling.max_staleness` >= 1 forks a CPU sampler worker; on "
                         f"{module.device.type} devices sample synchronously (`max_staleness: 0`)")
    if not hasattr(dm, "train_batches"):
        raise ValueError("`model.sampling.max_staleness` >= 1 reads the training prompts ahead of the "
                         "learner: it needs a DataModule with `train_batches(start)` (PromptDataModule), "
                         f"not {type(dm).__name__}")
    io = module.policy_io()  # the engine attached (and a CopyEngine's copy built) before the fork
    reference = module.reference_policy()
    if getattr(reference, "shares_weights", False) and is_sharded(module.policy.model):
        reference = None  # LoRA under FSDP2: the reference runs the sharded base, so the learner scores it
    if is_sharded(module.engine.sampling_model()):
        raise ValueError("`model.sampling.max_staleness` >= 1 under FSDP2 needs a whole copy of the weights "
                         "to sample with: set `model.engine.class_path: lightning_rl.step.engine.CopyEngine` "
                         "(`init_args.dtype: float32` for full precision)")
    names = list(named_trainable_parameters(module.policy.model))
    module.rollouts.start(io=io, engine=module.engine, names=names,
                          batches=dm.train_batches, refills=getattr(dm, "refill_batches", None),
                          step=trainer.fit_loop.epoch_loop.batch_progress.total.processed,
                          batch_index=dm.batches_consumed, rank=trainer.global_rank,
                          refills_start=getattr(dm, "refills_consumed", 0),
                          reference=reference,
                          scoring=(module.sampling.temperature, module.updater.micro_batch_size))
