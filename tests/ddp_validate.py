"""Greedy validation of the embedded model on 5 held-out rows, on 1 process or on 2 gloo ranks.

    python tests/ddp_validate.py OUT.json DEVICES

Rank 0 writes the validation metrics and the rows each rank scored. Used by tests/test_distributed.py:
with an odd number of rows (3 + 2: the short rank needs a placeholder batch), every row must be scored
exactly once and the metric must be the mean over the 5 rows whatever the world size.
"""

from __future__ import annotations

import json
import sys

import lightning as L
import torch
import torch.distributed as dist

from lightning_rl.algorithms import GRPO
from lightning_rl.algorithms.options import PolicyOptions
from lightning_rl.algorithms.sampler_options import SamplingOptions
from lightning_rl.data import PromptDataModule


class Recorder(GRPO):
    """GRPO that also records which held-out prompts this rank scored (placeholders included)."""

    def validation_step(self, batch, batch_idx):
        self.seen = getattr(self, "seen", []) + [
            (p, w) for p, w in zip(batch["prompt"], batch.get("_weight", [1.0] * len(batch["prompt"])),
                                   strict=True)
        ]
        super().validation_step(batch, batch_idx)


def main() -> None:
    torch.set_num_threads(1)
    out, devices = sys.argv[1], int(sys.argv[2])
    module = Recorder(policy=PolicyOptions(model="builtin:tiny-sort", max_prompt_length=16),
                      sampling=SamplingOptions(max_new_tokens=8, num_generations=2))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    (metrics,) = trainer.validate(module, PromptDataModule(max_val_rows=5, val_batch_size=2), verbose=False)
    seen = [module.seen]
    if devices > 1:
        seen = [None] * devices
        dist.all_gather_object(seen, module.seen)
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"metrics": metrics, "seen": seen}, f)


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
