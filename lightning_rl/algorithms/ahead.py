"""What :class:`~lightning_rl.algorithms.online.OnlineRL` hands the asynchronous sampler
(``model.sampling.max_staleness >= 1``, :mod:`lightning_rl.episodes.async_source`) when it starts: a typed
:class:`WorkerSpec` (its engine and how it reaches the policy, the trained model, the frozen models it scores,
how it scores them) and the DataModule's prompt streams. The worker reads nothing of the module."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_rl.episodes.sampler import PolicyIO
from lightning_rl.episodes.source import PromptBatches
from lightning_rl.models.adapters import named_trainable_parameters
from lightning_rl.models.sharding import is_sharded
from lightning_rl.step.engine import RolloutEngine


@dataclass(frozen=True)
class WorkerSpec:
    """The module's side of a worker sampling ahead.

    Args:
        io: how the sampler reaches the policy (the engine attached, a ``CopyEngine``'s copy built).
        engine: the module's rollout engine.
        model: the trained transformers model (its trainable parameters' names are what the learner
            publishes; a sharded one cannot be sampled from in the worker).
        frozen: the frozen models the worker scores where it samples (the reference, a teacher), at each
            rollout's own temperature.
        micro_batch_size: rows per scoring forward.
        kind: ``model.sampling.worker`` (``auto``, ``process``, ``thread``).
        device: the module's device.
    """

    io: PolicyIO
    engine: RolloutEngine
    model: torch.nn.Module
    frozen: dict[str, Any]
    micro_batch_size: int | None
    kind: str
    device: torch.device


def worker_kind(kind: str, device: torch.device) -> str:
    """``model.sampling.worker`` resolved: ``auto`` is a process on CPU, a thread on other devices (a CUDA
    context cannot be forked)."""
    if kind == "auto":
        return "process" if device.type == "cpu" else "thread"
    if kind == "process" and device.type != "cpu":
        raise ValueError(f"`model.sampling.worker: process` forks the learner's process, which a "
                         f"{device.type} context does not survive: use `thread` (or `auto`)")
    return kind


def start_worker(spec: WorkerSpec, rollouts: Any, trainer: Any) -> None:
    """Start the sampler worker of ``rollouts`` (``AsyncRollouts``) at the start of training, after a
    checkpoint's weights loaded, reading the trainer's DataModule streams from its position."""
    dm = trainer.datamodule
    thread = worker_kind(spec.kind, spec.device) == "thread"
    if not hasattr(dm, "train_batches"):
        raise ValueError("`model.sampling.max_staleness` >= 1 reads the training prompts ahead of the "
                         "learner: it needs a DataModule with `train_batches(start)` (PromptDataModule), "
                         f"not {type(dm).__name__}")
    io, engine, frozen = spec.io, spec.engine, dict(spec.frozen)
    shared = "reference" in frozen and frozen["reference"].shares_weights
    if shared and (thread or is_sharded(spec.model)):
        del frozen["reference"]  # LoRA: the trained model with adapters off: the learner scores it
    model = engine.sampling_model()
    if model is not None and is_sharded(model):
        raise ValueError("`model.sampling.max_staleness` >= 1 under FSDP2 needs a whole copy of the weights "
                         "to sample with: set `model.engine.class_path: lightning_rl.step.engine.CopyEngine` "
                         "(`init_args.dtype: float32` for full precision)")
    if thread:  # beside the learner: its own weights, while the module's engine keeps serving validation
        engine = engine.worker_copy()
        io = replace(io, generate=engine.generate, synced=False)
    rollouts.start(io=io, engine=engine, names=list(named_trainable_parameters(spec.model)),
                   batches=lambda start: PromptBatches.of(dm.train_batches(start)),
                   refills=getattr(dm, "refill_batches", None),
                   step=trainer.fit_loop.epoch_loop.batch_progress.total.processed,
                   batch_index=dm.batches_consumed, rank=trainer.global_rank,
                   refills_start=getattr(dm, "refills_consumed", 0), frozen=frozen,
                   micro_batch_size=spec.micro_batch_size, thread=thread, device=spec.device)
