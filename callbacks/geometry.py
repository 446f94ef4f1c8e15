"""The batch geometry a checkpoint was saved with, and a resume that would change it refused."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn

from lightning_rl.errors import ConfigError

ALLOW_ENV = "LRL_ALLOW_GEOMETRY_CHANGE"  # set to 1 to resume with another geometry anyway
CHECKPOINT_KEY = "batch_geometry"
# checkpoint key -> what the user sets
NAMES = {"batch_size": "`data.batch_size`", "num_generations": "`model.sampling.num_generations`",
         "world_size": "the world size (`trainer.devices` x `trainer.num_nodes`)"}


def batch_geometry(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int]:
    """Prompts per rank and step (``data.batch_size``), samples per prompt
    (``model.sampling.num_generations``, RL modules) and the number of ranks: what a checkpoint's data
    position and per-rank states count in."""
    geometry = {}
    batch_size = getattr(getattr(trainer, "datamodule", None), "batch_size", None)
    if isinstance(batch_size, int):
        geometry["batch_size"] = batch_size
    num_generations = getattr(pl_module, "num_generations", None)
    if isinstance(num_generations, int):
        geometry["num_generations"] = num_generations
    geometry["world_size"] = trainer.world_size
    return geometry


def geometry_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``"`data.batch_size` 4 in the checkpoint, 2 now"`` for each key both know and that differs."""
    return [f"{NAMES.get(key, key)} {saved[key]} in the checkpoint, {now[key]} now"
            for key in saved if key in now and saved[key] != now[key]]


class BatchGeometry(L.Callback):
    """Save the batch geometry in every checkpoint; refuse a resume whose geometry differs.

    A checkpoint's data position counts batches of ``data.batch_size`` prompts on each of its ranks, and
    its per-rank states (refill positions, RNG) belong to its world size: resumed with another batch
    size, number of samples per prompt or world size, the run would continue on other rows than the
    interrupted one, silently. The resume stops before training, naming the keys and both values, unless
    ``allow_change`` (or the environment variable ``LRL_ALLOW_GEOMETRY_CHANGE=1``): then it warns.
    Checkpoints saved without a geometry (older ones) are resumed as they are.

    Args:
        allow_change: resume with another geometry anyway (a warning names what changed).
    """

    def __init__(self, allow_change: bool = False) -> None:
        self.allow_change = allow_change

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = batch_geometry(trainer, pl_module)

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if not isinstance(saved, dict) or trainer.state.fn != "fit":
            return
        changes = geometry_changes(saved, batch_geometry(trainer, pl_module))
        if not changes:
            return
        where = f"`--ckpt_path` {trainer.ckpt_path}" if trainer.ckpt_path else "the checkpoint"
        what = f"{where} was saved with another batch geometry: {'; '.join(changes)}"
        if self.allow_change or os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes"):
            rank_zero_warn(f"{what}. Resuming anyway ({ALLOW_ENV}): the data position and the per-rank "
                           "states now point at other rows than the interrupted run's")
            return
        raise ConfigError(f"{what}. Its data position counts batches of the old geometry, so the run would "
                          "continue on other rows: resume with the checkpoint's values, or set "
                          f"{ALLOW_ENV}=1 to resume anyway")
