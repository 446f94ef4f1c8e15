"""A half-precision ``CopyEngine`` under DDP or FSDP2 on 2 gloo ranks: after every sync (each step, before
sampling) the engine's weights equal the trained weights cast to its dtype, gathered one parameter at a time.

    python tests/engine_sync.py OUT_DIR ddp|fsdp2 [bfloat16|float16]

The dtype defaults to bfloat16 (tests/rank_jobs.py runs DDP with bf16 and FSDP2 with fp16, so both dtypes run
under a multi-process strategy). Rank 0 writes ``OUT_DIR/result.json``: per step, the largest difference
between the engine's weights and the (gathered) trained weights cast to the engine's dtype, the number of
parameters compared, the dtype, and the logged metrics.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_rl.algorithms import GRPO
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.data import PromptDataModule
from lightning_rl.models.sharding import full_value
from lightning_rl.step.engine import CopyEngine


class Compare(RLCallback):
    """At the end of each rollout (after this step's sync, before its updates): engine vs trained."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_rollout_end(self, trainer, pl_module, rollout):
        mine = dict(pl_module.engine.copy.model.named_parameters())
        diff, count = 0.0, 0
        for name, param in pl_module.policy.model.named_parameters():  # every rank gathers each, in order
            full = full_value(param.detach()).to(pl_module.engine.dtype)
            diff = max(diff, (mine[name].detach().cpu().float() - full.cpu().float()).abs().max().item())
            count += 1
        self.steps.append({"diff": diff, "count": count, "dtype": str(next(iter(mine.values())).dtype)})

    def on_step_end(self, trainer, pl_module, stats):
        self.steps[-1]["stats"] = {k: float(v) for k, v in stats.items() if k.startswith("rollout/")}


def main() -> None:
    torch.set_num_threads(1)
    out, kind = sys.argv[1], sys.argv[2]
    dtype = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
    strategy = "ddp"
    if kind == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    compare = Compare()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=out,
                        callbacks=[compare])
    module = GRPO.configured(
        policy={"model": "builtin:tiny-sort", "max_prompt_length": 16},
        sampling={"max_new_tokens": 8, "num_generations": 4}, engine=CopyEngine(dtype),
        objective={"kl_coef": 0.0}, optimizer=partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0))
    trainer.fit(module, PromptDataModule(batch_size=2))
    if trainer.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(compare.steps, f)


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
