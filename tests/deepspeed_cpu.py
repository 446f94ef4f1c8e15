"""Lightning's ``DeepSpeedStrategy`` on CPU ranks (gloo), for tests only.

Lightning refuses DeepSpeed on anything but CUDA, and hands DeepSpeed the CUDA device index. DeepSpeed
itself runs on CPU (its CPU accelerator, gloo collectives), so this subclass lifts exactly those two
device checks and keeps everything else of the stock strategy: the engine, ZeRO partitioning, its
gradient reduction, clipping, optimizer and scheduler steps. Users on GPUs select the stock strategy
(``configs/strategy/deepspeed_zero*.yaml``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DeepSpeedStrategy


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    def setup_environment(self) -> None:
        # skip DeepSpeedStrategy's CUDA check, keep DDPStrategy's (which calls setup_distributed)
        super(DeepSpeedStrategy, self).setup_environment()

    def setup_distributed(self) -> None:
        reset_seed()  # as the stock strategy, minus its CUDA device-index validation
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
        import deepspeed

        # the stock strategy passes the CUDA index (None on CPU); DeepSpeed wants the local rank
        engine, optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad], optimizer=optimizer,
            lr_scheduler=lr_scheduler, dist_init_required=False,
        )
        return engine, optimizer
