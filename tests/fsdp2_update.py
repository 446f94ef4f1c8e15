"""One RL update on a fixed rollout, on 1 process or under FSDP2 on 2 gloo ranks; rank 0 saves the gradients.

    python tests/fsdp2_update.py OUT.pt DEVICES MICRO_BATCH_SIZE [SPLIT]

The rollout of tests/ddp_update.py (16 rows, ranks take rows ``rank::world`` so they hold different
numbers of tokens). ``SPLIT=rank0``: rank 0 takes rows ``0::2`` and rank 1 none (its empty micro-batch
must still join the reduce-scatter); one process then takes rows ``0::2``. Under FSDP2 the sharded
gradients are gathered with ``full_tensor()`` (on every rank, in the same order). Gradients are clipped
(``max_grad_norm``), so the global norm is checked too; the ``policy/grad_norm`` of each update, as handed
to the step's metrics (``module.step_metrics``), is saved with its type.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_rl.algorithms import GRPO
from lightning_rl.data import PromptDataModule
from lightning_rl.maths.trust_regions import Clip
from lightning_rl.models.sharding import full_value, is_sharded
from lightning_rl.step.metrics import StepMetrics

sys.path.insert(0, os.path.dirname(__file__))
from ddp_update import MODES, fixed_rollout, for_mode, update  # noqa: E402

SPLIT = sys.argv[4] if len(sys.argv) > 4 else "strided"


class NormRecorder(StepMetrics):
    """The step's metrics, recording every ``policy/grad_norm`` added (its type and value) on the way."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[tuple[str, float]] = []

    def add(self, device, values, weight=1.0) -> None:
        if "policy/grad_norm" in values:
            norm = values["policy/grad_norm"]
            self.norms.append((type(norm).__name__, float(norm)))
        super().add(device, values, weight)


def record_norms(module) -> NormRecorder:
    """Swap the module's step metrics for a recording one."""
    if not isinstance(module.step_metrics, NormRecorder):
        module.step_metrics = NormRecorder()
    return module.step_metrics


class Probe(GRPO):
    def training_step(self, batch, batch_idx):
        recorder = record_norms(self)
        rollout = fixed_rollout(self)
        world, rank = self.trainer.world_size, self.global_rank
        grads = {}
        for mode in MODES:
            step_rollout = for_mode(self, rollout, mode)
            if SPLIT == "rank0":
                rows = torch.arange(0, len(rollout), 2) if rank == 0 else torch.arange(0)
            else:
                rows = torch.arange(rank, len(rollout), world)
            update(self, step_rollout.select(rows))
            grads[mode] = {n: full_value(p.grad).detach().clone() for n, p in self.policy.named_parameters()}
        if rank == 0:
            result = {"grads": grads, "norms": recorder.norms, "sharded": is_sharded(self.policy.model)}
            torch.save(result, sys.argv[1])


def main() -> None:
    torch.set_num_threads(1)
    out, devices, micro = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    module = Probe.configured(
        policy={"model": "builtin:tiny-sort", "max_prompt_length": 16},
        sampling={"max_new_tokens": 8, "num_generations": 4},
        update={"micro_batch_size": None if micro == "none" else int(micro), "max_grad_norm": 0.05},
        objective={"trust_region": Clip(0.2, 0.28), "kl_coef": 0.1},
        optimizer=partial(torch.optim.SGD, lr=0.0))
    strategy = "auto"
    if devices > 1:
        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        default_root_dir=os.path.dirname(out))
    trainer.fit(module, PromptDataModule(batch_size=2))


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
