"""Four RL updates on a fixed rollout, on 1 process or under DeepSpeed ZeRO on 2 gloo CPU ranks.

    python tests/deepspeed_update.py OUT.pt DEVICES STAGE MICRO_BATCH_SIZE [SPLIT]

The rollout of tests/ddp_update.py; ranks take rows ``rank::world`` (``SPLIT=rank0``: rank 0 rows ``0::2``,
rank 1 none, and one process rows ``0::2``). One SGD step (lr 1, gradients clipped to ``max_grad_norm``)
per aggregation mode, so each update moves the weights by exactly the clipped gradient. ZeRO-2/3 keep
gradients in partitions, not in ``p.grad``: rank 0 saves the full weights after each update (gathered from
the ZeRO-3 partitions) and the ``policy/grad_norm`` of each (the engine's, as handed to the step's metrics).
"""

from __future__ import annotations

import os
import sys
from functools import partial

import lightning as L
import torch
import torch.distributed as dist

from lightning_rl.algorithms import GRPO
from lightning_rl.data import PromptDataModule
from lightning_rl.maths.trust_regions import Clip
from lightning_rl.models.sharding import full_state_dict, zero3_partitioned

sys.path.insert(0, os.path.dirname(__file__))
from ddp_update import MODES, fixed_rollout, for_mode, update  # noqa: E402
from deepspeed_cpu import CPUDeepSpeedStrategy  # noqa: E402
from fsdp2_update import record_norms  # noqa: E402

SPLIT = sys.argv[5] if len(sys.argv) > 5 else "strided"


class Probe(GRPO):
    def training_step(self, batch, batch_idx):
        recorder = record_norms(self)
        rollout = fixed_rollout(self)
        world, rank = self.trainer.world_size, self.global_rank
        weights = []
        for mode in MODES:
            step_rollout = for_mode(self, rollout, mode)
            if SPLIT == "rank0":
                rows = torch.arange(0, len(rollout), 2) if rank == 0 else torch.arange(0)
            else:
                rows = torch.arange(rank, len(rollout), world)
            update(self, step_rollout.select(rows))
            full = full_state_dict(self.policy.model) if world > 1 else self.policy.model.state_dict()
            weights.append({k: v.detach().clone() for k, v in full.items()})  # CPU state dicts alias weights
        if rank == 0:
            result = {"weights": weights, "norms": recorder.norms,
                      "zero3": zero3_partitioned(self.policy.model)}
            torch.save(result, sys.argv[1])


def main() -> None:
    torch.set_num_threads(1)
    out, devices, stage, micro = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    module = Probe.configured(
        policy={"model": "builtin:tiny-sort", "max_prompt_length": 16},
        sampling={"max_new_tokens": 8, "num_generations": 4},
        update={"micro_batch_size": None if micro == "none" else int(micro), "max_grad_norm": 0.05},
        objective={"trust_region": Clip(0.2, 0.28), "kl_coef": 0.1},
        optimizer=partial(torch.optim.SGD, lr=1.0))
    strategy = CPUDeepSpeedStrategy(stage=stage) if devices > 1 else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        default_root_dir=os.path.dirname(out))
    trainer.fit(module, PromptDataModule(batch_size=2))


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
