"""GRPO (or on-policy distillation) on multi-turn episodes whose turn counts differ by rank, on 2 gloo ranks
(DDP or FSDP2).

    python tests/episodes_fit.py OUT_DIR STRATEGY [ALGORITHM]  (ddp | fsdp2; grpo | distill)

Rank 0's episodes end after one model turn, rank 1's take three (the environment answers twice), so each
turn after the first has unfinished episodes on rank 1 only: under FSDP2 generation is a collective and
rank 0 must keep generating for a placeholder row, and every rank makes the per-turn all-reduce. Two
optimiser steps with greedy validation on uneven held-out rows (3 rows, batches of 1). Rank 0 saves each
rank's model turns per episode (from the rollouts' ``model_mask``) and the logged metrics to
``OUT_DIR/result.pt``. With ``distill`` (``OnPolicyDistillation`` from ``builtin:tiny-sort-teacher``, whole
on each rank) it also saves, per rank and step, the sum and count of ``student - teacher`` log-probs over the
loss tokens, how far the advantages are from ``teacher - student`` there and from 0 on observation tokens, and
whether the teacher's forwards are collectives.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_rl.algorithms import GRPO, OnPolicyDistillation
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.data import PromptDataModule
from lightning_rl.episodes.environments import Environment, StepResult
from lightning_rl.models.sharding import collective_forward


class Uneven(Environment):
    """One model turn on rank 0, three on rank 1; reward 1 per step."""

    def reset(self, row):
        self.n = 0
        self.needed = 1 if not dist.is_initialized() or dist.get_rank() == 0 else 3

    def step(self, turn):
        self.n += 1
        done = self.n >= self.needed
        return StepResult(observation=None if done else "=", reward=1.0, done=done)


def model_turns(model_mask: torch.Tensor) -> list[int]:
    """Runs of sampled tokens per row: the number of model turns of each episode."""
    starts = model_mask[:, :1] + (model_mask[:, 1:] - model_mask[:, :-1]).clamp_min(0).sum(-1, keepdim=True)
    return starts.squeeze(1).tolist()


class Record(RLCallback):
    def __init__(self) -> None:
        self.turns: list[list[int]] = []
        self.distill: list[dict] = []
        self.logged: list[float] = []  # distill/reverse_kl as logged each step

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.turns.append(model_turns(rollout.model_mask))
        teacher = rollout.frozen_logp.get("teacher")
        if teacher is None:
            return
        loss = rollout.loss_mask.bool()
        observation = rollout.attention_mask.bool() & ~loss
        student = rollout.old_logp if rollout.old_logp is not None else rollout.rollout_logp
        gap = student - teacher
        self.distill.append({
            "gap_sum": float(gap[loss].sum()), "count": int(loss.sum()),
            "advantage_error": float((rollout.advantages + gap)[loss].abs().max()) if loss.any() else 0.0,
            "observation_advantage": float(rollout.advantages[observation].abs().max())
            if observation.any() else 0.0, "observations": int(observation.sum())})

    def on_train_batch_end(self, trainer, pl_module, *_):
        if "distill/reverse_kl" in trainer.logged_metrics:
            self.logged.append(float(trainer.logged_metrics["distill/reverse_kl"]))


def main() -> None:
    torch.set_num_threads(1)
    out, strategy_name = sys.argv[1], sys.argv[2]
    algorithm = sys.argv[3] if len(sys.argv) > 3 else "grpo"
    os.makedirs(out, exist_ok=True)
    L.seed_everything(0, verbose=False)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) \
        if strategy_name == "fsdp2" else "ddp"
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=out, callbacks=[record], val_check_interval=2,
                        check_val_every_n_epoch=None, num_sanity_val_steps=1)
    common = dict(policy={"model": "builtin:tiny-sort", "max_prompt_length": 16},
                  sampling={"max_new_tokens": 8, "num_generations": 2},
                  episodes={"environment": Uneven(), "max_turns": 3}, update={"micro_batch_size": 3},
                  optimizer=partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.0))
    if algorithm == "distill":
        module = OnPolicyDistillation.configured(**common)
    else:
        module = GRPO.configured(objective={"kl_coef": 0.1}, **common)
    trainer.fit(module, PromptDataModule(batch_size=2, max_val_rows=3, val_batch_size=1))
    per_rank = [None, None]
    dist.all_gather_object(per_rank, (record.turns, record.distill))
    if trainer.global_rank == 0:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        teacher = getattr(module, "teacher", None)
        torch.save({"turns": [turns for turns, _ in per_rank], "distill": [d for _, d in per_rank],
                    "metrics": metrics, "global_step": trainer.global_step,
                    "logged": record.logged,
                    "teacher_collective": teacher is not None and collective_forward(teacher.model)},
                   os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
