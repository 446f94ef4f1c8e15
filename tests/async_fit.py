"""Asynchronous sampling (``max_staleness: 1``) on 2 gloo ranks under DDP or FSDP2, with uneven sampler
speeds: rank 1's reward sleeps, so its worker is the slow one. Every rank makes the same collectives every
step whatever its worker did, each step trains on the rollout of its own batch sampled one version back,
and, the lag being fixed, DDP and FSDP2 sample the same tokens and compute the same gradients and weights
(up to the order of their reductions; SGD with momentum, whose weights follow the gradients linearly).

    python tests/async_fit.py OUT_DIR ddp|fsdp2 [CKPT_EVERY | RESUME_CKPT]

With a number, a checkpoint every that many steps under ``OUT_DIR/ckpt``; with a path, the run resumes from
it (DDP): each rank's rollouts sampled ahead travel in rank 0's file and return to their own rank.

Under FSDP2 the worker samples with a whole float32 ``CopyEngine`` (the sharded policy cannot sample alone);
weights reach it gathered one parameter at a time. Rank 0 writes ``OUT_DIR/result.pt``: the trained
weights (gathered), each step's whole gradient, and per rank and step the rollout's versions and tokens and
the logged staleness.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_rl.algorithms import GRPO
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.data import PromptDataModule
from lightning_rl.models.sharding import full_state_dict
from lightning_rl.step.engine import CopyEngine


def uneven_reward(prompts, completions, answer, **_):
    """Exact match; slow on rank 1 (its worker inherits the rank in the environment)."""
    if os.environ.get("RANK") == "1":
        time.sleep(0.3)
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer, strict=True)]


class Record(RLCallback):
    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.grads: list[dict[str, torch.Tensor]] = []  # rank 0: each step's whole gradient

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.steps.append({"step": trainer.fit_loop.total_batch_idx, "versions": rollout.versions.tolist(),
                           "tokens": rollout.completion_ids.tolist()})

    def on_step_end(self, trainer, pl_module, stats):
        self.steps[-1]["staleness"] = stats["rollout/staleness_max"]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        """The step's gradient as the optimiser gets it (reduced over ranks), whole: under FSDP2 each shard
        is gathered (every rank joins); rank 0 keeps it."""
        grads = {}
        for name, p in pl_module.policy.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().cpu().clone()
        if trainer.global_rank == 0:
            self.grads.append(grads)


# SGD with momentum, not Adam: the weights are then a linear function of the gradients, so DDP's and FSDP2's
# differ by about what their gradients do (tests/episodes/test_async_sampling.py derives the bound); Adam
# turns reduction-order noise in near-zero gradients into steps of about `lr` either way. Momentum keeps an
# optimiser state for the resumed run to restore.
LR, MOMENTUM = 1e-2, 0.9


def checkpoints(out: str, every: int | None) -> list:
    if every is None:
        return []
    return [ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=every, save_top_k=-1)]


def main() -> None:
    torch.set_num_threads(1)
    out, kind = sys.argv[1], sys.argv[2]
    extra = sys.argv[3] if len(sys.argv) > 3 else None
    every, resume = (int(extra), None) if extra and extra.isdigit() else (None, extra)
    strategy: object = "ddp"
    engine = None
    if kind == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        engine = CopyEngine("float32")
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=4, logger=False,
                        enable_checkpointing=every is not None, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        default_root_dir=out, callbacks=[record, *checkpoints(out, every)])
    module = GRPO.configured(
        policy={"model": "builtin:tiny-sort", "max_prompt_length": 16},
        sampling={"max_new_tokens": 8, "num_generations": 4, "max_staleness": 1}, engine=engine,
        rewards={"functions": ["async_fit:uneven_reward"]}, update={"max_grad_norm": None},
        optimizer=partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM))
    trainer.fit(module, PromptDataModule(batch_size=2), ckpt_path=resume)
    weights = full_state_dict(module.policy.model)  # every rank joins the gathers
    steps: list = [None, None]
    dist.all_gather_object(steps, record.steps)
    if trainer.global_rank == 0:
        torch.save({"weights": weights, "steps": steps, "grads": record.grads,
                    "worker": module.rollouts.process}, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
