"""One PPO update (policy and critic) on a fixed rollout: 1 process, or 2 gloo ranks under DDP or FSDP2.

    python tests/ppo_update.py OUT.pt DEVICES STRATEGY MICRO_BATCH_SIZE

The rollout of tests/ddp_update.py, plus critic targets: rollout-time values (the critic's, perturbed) and
returns, and per-token advantages. Ranks take rows ``rank::world`` (different token counts). SGD at lr 0,
so the weights stay put; rank 0 saves every policy and critic gradient (FSDP2's gathered with
``full_tensor``) and the metrics the updater yields for each micro-batch.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_rl.algorithms import PPO
from lightning_rl.data import PromptDataModule
from lightning_rl.models.sharding import full_value, is_sharded
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.logprobs import score_values

sys.path.insert(0, os.path.dirname(__file__))
from ddp_update import fixed_rollout, update  # noqa: E402


class Probe(PPO):
    def training_step(self, batch, batch_idx):
        rollout = fixed_rollout(self)
        g = torch.Generator().manual_seed(2)
        mask = rollout.loss_mask.bool()  # advantages and value targets: 0 outside the loss
        values = score_values(self.critic, rollout, self.updater.micro_batch_size, Collectives(self.trainer))
        rollout.values = torch.where(mask, values + 0.1 * torch.randn(values.shape, generator=g), 0.0)
        rollout.returns = torch.where(mask, torch.randn(values.shape, generator=g), 0.0)
        rollout.advantages = torch.where(mask, torch.randn(values.shape, generator=g), 0.0)
        world, rank = self.trainer.world_size, self.global_rank
        yielded = update(self, rollout.select(torch.arange(rank, len(rollout), world)))
        metrics = [{k: float(v) for k, v in m.items()} for m, _ in yielded]
        grads = {f"{name}.{n}": full_value(p.grad).detach().clone()
                 for name, model in (("policy", self.policy), ("critic", self.critic))
                 for n, p in model.named_parameters() if p.grad is not None}
        if rank == 0:
            torch.save({"grads": grads, "metrics": metrics,
                        "sharded": is_sharded(self.critic.model)}, sys.argv[1])


def main() -> None:
    torch.set_num_threads(1)
    out, devices, strategy, micro = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    L.seed_everything(0, verbose=False)  # the critic's fresh head is drawn from the global RNG
    module = Probe.configured(
        policy={"model": "builtin:tiny-sort", "max_prompt_length": 16},
        sampling={"max_new_tokens": 8, "num_generations": 4},
        update={"micro_batch_size": None if micro == "none" else int(micro), "max_grad_norm": None},
        objective={"kl_in_reward": None, "kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01},
        critic={"value_clip": 0.05, "optimizer": partial(torch.optim.SGD, lr=0.0)},
        optimizer=partial(torch.optim.SGD, lr=0.0))
    if strategy == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=os.path.dirname(out))
    trainer.fit(module, PromptDataModule(batch_size=2))


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
