"""GRPO ``fit`` under FSDP2 on 2 gloo ranks: validation with uneven ranks, then the export.

    python tests/fsdp2_fit.py OUT_DIR

3 optimiser steps (2 micro-batches each, KL to the reference on), greedy validation on 3 held-out rows in
batches of 1 (rank 0 scores 2 rows, rank 1 one row and a placeholder; their completion lengths differ),
then ``ExportPolicy`` writes ``OUT_DIR/policy``. Rank 0 saves the trained weights (gathered on every
rank), what each rank held, and the logged metrics to ``OUT_DIR/result.pt``.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_rl.algorithms import GRPO
from lightning_rl.callbacks import ExportPolicy
from lightning_rl.data import PromptDataModule
from lightning_rl.sharding import full_state_dict, is_sharded


def nbytes(tensors) -> int:
    return sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes for t in tensors)


def main() -> None:
    torch.set_num_threads(1)
    out = sys.argv[1]
    module = GRPO(model="builtin:tiny-sort", max_new_tokens=8, max_prompt_length=16, num_generations=4,
                  micro_batch_size=4, kl_coef=0.1, max_grad_norm=0.5, temperature=1.0,
                  fsdp_param_dtype=None)
    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                        max_steps=3, val_check_interval=2, check_val_every_n_epoch=None, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=1, default_root_dir=out,
                        callbacks=[ExportPolicy(os.path.join(out, "policy"))])
    trainer.fit(module, PromptDataModule(batch_size=2, max_val_rows=3, val_batch_size=1))
    weights = full_state_dict(module.policy.model)  # every rank joins
    held = {
        "policy_local_bytes": nbytes(module.policy.parameters()),
        "reference_bytes": nbytes(module._reference.parameters()),
        "sharded": is_sharded(module.policy.model),
        "reference_sharded": is_sharded(module._reference),
    }
    per_rank = [None, None]
    dist.all_gather_object(per_rank, held)
    if trainer.global_rank == 0:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        torch.save({"weights": weights, "ranks": per_rank, "metrics": metrics,
                    "global_step": trainer.global_step}, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
