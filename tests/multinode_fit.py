"""A short GRPO fit through the real CLI under DDP; every rank records where it ran, rank 0 the final weights.

    python tests/multinode_fit.py OUT_DIR [CLI overrides...]

Runs ``lightning-rl fit --config configs/grpo.yaml --config configs/strategy/ddp.yaml`` cut to 2 steps
(4 prompts x 4 samples per rank, no validation or checkpoints), logging to ``OUT_DIR``. Launch it as a
launcher would: directly (Lightning starts the local ranks), with ``NODE_RANK``/``MASTER_ADDR``/
``MASTER_PORT`` per node, or under ``torchrun``. Writes ``OUT_DIR/rank<global rank>.json`` (ranks, world
size, cluster environment) and, on rank 0, ``OUT_DIR/weights.pt``. Used by tests/cli/test_multinode.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_rl.cli.main import LightningRLCLI

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHORT = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
         "--trainer.num_sanity_val_steps", "0",
         "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_model_summary", "false", "--data.init_args.batch_size", "4",
         "--model.init_args.sampling.num_generations", "4"]


def main() -> None:
    torch.set_num_threads(1)
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    args = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", str(CONFIGS / "strategy" / "ddp.yaml"),
            *SHORT, "--trainer.logger.init_args.save_dir", str(out), *overrides]
    cli = LightningRLCLI(args=args)
    trainer = cli.trainer
    env = trainer.strategy.cluster_environment
    info = {"global_rank": trainer.global_rank, "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "world_size": trainer.world_size, "num_nodes": trainer.num_nodes, "devices": trainer.num_devices,
            "environment": type(env).__name__, "global_step": trainer.global_step,
            "NODE_RANK": os.environ.get("NODE_RANK"), "GROUP_RANK": os.environ.get("GROUP_RANK")}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(info))
    if trainer.global_rank == 0:
        weights = {k: v.detach().cpu().clone() for k, v in cli.model.policy.model.state_dict().items()}
        torch.save(weights, out / "weights.pt")


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
