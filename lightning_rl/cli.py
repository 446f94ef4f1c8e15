"""The ``lightning-rl`` command: LightningCLI over every algorithm and DataModule.

    lightning-rl fit --config configs/grpo.yaml
    lightning-rl fit --config configs/grpo.yaml --trainer.strategy ddp --trainer.devices 2
    lightning-rl fit --config configs/sft.yaml --print_config

Models and DataModules are chosen by ``class_path`` (subclass mode), YAML is parsed with omegaconf so
``${...}`` interpolation works, each run's full config is saved next to its TensorBoard logs (a new
``version_N`` folder per run, so nothing is overwritten), and TensorBoard is the default logger.
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from lightning_rl.algorithms.base import PolicyModule

DEFAULT_LOGGER = {
    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
    "init_args": {"save_dir": "runs", "name": "lightning-rl"},
}


class LightningRLCLI(LightningCLI):
    """LightningCLI with lightning-rl's defaults."""

    def __init__(self, args: list[str] | None = None, run: bool = True) -> None:
        super().__init__(
            model_class=PolicyModule,
            datamodule_class=LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            parser_kwargs={"parser_mode": "omegaconf"},
            trainer_defaults={"logger": DEFAULT_LOGGER},
            args=args,
            run=run,
        )


def main(args: list[str] | None = None) -> None:
    """Console entry point. ``LRL_NUM_THREADS`` sets torch's CPU threads (1 is often fastest for tiny
    models)."""
    threads = os.environ.get("LRL_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    LightningRLCLI(args=args if args is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
