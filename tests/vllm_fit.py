"""GRPO sampled by vLLM on 2 gloo ranks, 3 steps.

    python tests/vllm_fit.py OUT_DIR fsdp2|ddp-server

``fsdp2``: FSDP2, each rank its own colocated engine; every weight push gathers one parameter at a time on
both ranks. ``ddp-server``: DDP, both ranks share one vLLM server that rank 0 starts on port ``VLLM_PORT``
before the fit (``server.url``); rank 0 alone pushes the weights, and both ranks wait for the push. Rank 0
writes ``OUT_DIR/result.json``: per rank and step, the largest gap between the engine's log-probs and the
trainer's recomputed ones (0 up to rounding only if the engine held that step's weights when the rank
sampled), the rank's pushes, the engine versions, and each rank's first completion.
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
from lightning_rl.step.vllm_engine import VLLMEngine
from lightning_rl.step.vllm_server import VLLMServerOptions


class Record(RLCallback):
    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_rollout_end(self, trainer, pl_module, rollout):
        from lightning_rl.step.collectives import Collectives
        from lightning_rl.step.logprobs import score_rollout

        # the trained weights that were pushed before this rollout (every rank scores: FSDP2 forwards gather)
        mine = score_rollout(pl_module.policy, rollout, micro_batch_size=None,
                             collectives=Collectives(trainer), joiner=pl_module.policy)
        mask = rollout.loss_mask.bool()
        gap = (rollout.rollout_logp - mine)[mask].abs().max().item()
        self.steps.append({"gap": gap, "version": pl_module.engine.version,
                           "first": rollout.completion_ids[0].tolist()})


def main() -> None:
    torch.set_num_threads(1)
    out, kind = sys.argv[1], sys.argv[2]
    options = {"kv_cache_gib": 1.0}
    launcher = None
    if kind == "ddp-server":
        port = int(os.environ["VLLM_PORT"])
        options = {**options, "mode": "server", "server": VLLMServerOptions(url=f"http://127.0.0.1:{port}")}
        if int(os.environ["RANK"]) == 0:  # one server for both ranks, started before the fit
            from lightning_rl.models.loading import load_policy

            launcher = VLLMEngine(mode="server", kv_cache_gib=1.0, server=VLLMServerOptions(port=port))
            launcher.attach(load_policy("builtin:tiny-sort"))
            launcher.start()
    fsdp2 = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    strategy = fsdp2 if kind == "fsdp2" else "ddp"
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=out, callbacks=[record])
    engine = VLLMEngine(**options)
    module = GRPO.configured(
        policy={"model": "builtin:tiny-sort", "max_prompt_length": 16},
        sampling={"max_new_tokens": 8, "num_generations": 4}, engine=engine,
        objective={"kl_coef": 0.0}, optimizer=partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0))
    trainer.fit(module, PromptDataModule(batch_size=2))
    mine = {"steps": record.steps, "loads": engine.loads, "closed": engine.backend is None}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if launcher is not None:
        launcher.close()
    if trainer.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(everyone, f)


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
