"""``fit`` under FSDP2 on 2 gloo ranks: GRPO / DAPO / DPO with validation on uneven ranks and the export,
and an exactly resumed GRPO run from a sharded (distributed) checkpoint.

    python tests/fsdp2_fit.py OUT_DIR [MODE] [STEPS] [RESUME_CKPT]

With ``STRATEGY=zero2`` or ``zero3`` in the environment the same runs use DeepSpeed ZeRO-2 / ZeRO-3
(``tests/deepspeed_cpu.py``) instead; their checkpoints are DeepSpeed's folders. ``STRATEGY=ddp``: DDP.

MODE:
    grpo    (default) 3 optimiser steps (2 micro-batches each, KL to the reference on), greedy validation on
            3 held-out rows in batches of 1 (rank 0 scores 2 rows, rank 1 one row and a placeholder; their
            completion lengths differ), then ``ExportPolicy`` writes ``OUT_DIR/policy``.
    dapo    DAPO with dynamic sampling where rank 0 keeps every group and rank 1 only some, so the ranks'
            rollouts, refills and micro-batch counts differ; validation and export as in ``grpo``.
    dpo     DPO (automatic optimisation, a whole frozen reference per rank) on 5 training pairs, 1 per rank
            per step; validation on 3 held-out pairs in batches of 1; export.
    lora    ``grpo`` with LoRA adapters (``model.policy.peft``): only they train, the KL reference is the same
            (sharded) weights with the adapters disabled; ``OUT_DIR/policy`` is the adapter folder, and the
            same export with ``export_merged`` writes ``OUT_DIR/merged``. Each rank also records its adapter
            weights when they are not sharded (DDP).
    resume  GRPO for STEPS steps with a sharded checkpoint (``save_distributed_checkpoint``) every 2 steps
            under ``OUT_DIR/ckpt``; RESUME_CKPT resumes from one (``last``: the newest under
            ``OUT_DIR/ckpt``, found as ``lightning-rl fit --ckpt_path last`` finds it). Each rank's RNG is
            seeded differently at the start of ``fit`` and recorded per step, so a resume that restores
            rank 0's RNG on every rank shows.

Rank 0 saves the trained weights (gathered on every rank), what each rank held, the logged metrics and,
per step and rank, the logged metrics, to ``OUT_DIR/result.pt``.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from functools import partial

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_rl.algorithms import DAPO, DPO, GRPO
from lightning_rl.algorithms.options import PolicyOptions, ValidationOptions
from lightning_rl.callbacks import ExportPolicy
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.data import PromptDataModule
from lightning_rl.data.preference import PreferenceDataModule
from lightning_rl.models.sharding import collective_forward, full_state_dict


def nbytes(tensors) -> int:
    """Bytes this rank holds: an FSDP2 shard, a ZeRO-3 partition (``ds_tensor``) or a whole tensor."""
    held = 0
    for t in tensors:
        held += (t.to_local().nbytes if hasattr(t, "to_local") else
                 t.ds_tensor.nbytes if hasattr(t, "ds_tensor") else t.nbytes)
    return held


def make_strategy(name: str, checkpoint: bool):
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                     save_distributed_checkpoint=checkpoint)
    if name == "ddp":
        return "ddp"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from deepspeed_cpu import CPUDeepSpeedStrategy

    return CPUDeepSpeedStrategy(stage={"zero2": 2, "zero3": 3}[name])


def correctness(prompts, completions, **_):
    """Rank 0: every group mixed (every other sample correct); rank 1: only prompts whose digit sum is
    0 mod 4, so rank 1's filter drops most groups and, with 2 rounds at most, trains on fewer (or none)."""
    rank = dist.get_rank()
    keep = [rank == 0 or sum(int(c) for c in p if c.isdigit()) % 4 == 0 for p in prompts]
    return [k and i % 2 == 0 for i, k in enumerate(keep)]


def reward(prompts, completions, **_):
    correct = correctness(prompts, completions)
    return [float(c) + 0.05 * len(t) for c, t in zip(correct, completions, strict=True)]


class Record(RLCallback):
    """Per step: what this rank logged and (RL) how many samples it kept and its refill position."""

    def __init__(self, seed_per_rank: bool) -> None:
        self.steps: list[dict] = []
        self.seed_per_rank = seed_per_rank
        self.kept = 0

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.kept = len(rollout)

    def on_fit_start(self, trainer, pl_module):
        if self.seed_per_rank:  # before the module restores the checkpoint's RNG states (on_train_start)
            torch.manual_seed(1000 + trainer.global_rank)

    def on_train_batch_end(self, trainer, pl_module, *_):
        logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
        step = {"step": trainer.global_step, "logged": logged}
        step["kept"] = self.kept
        # this rank's global torch RNG, unconsumed (rollouts sample from seeded forks; dropout etc. use it)
        step["rng"] = zlib.crc32(torch.get_rng_state().numpy().tobytes())
        step["refills_consumed"] = getattr(trainer.datamodule, "refills_consumed", None)
        self.steps.append(step)


def build(mode: str, out: str):
    here = "fsdp2_fit"
    if mode in ("dapo", "dapo_kl"):
        # dapo_kl: LoRA, a KL reference that runs the sharded weights with adapters off, and 2 minibatches
        # (behaviour log-probs): every scoring pass has a rank-dependent number of rows
        policy = {"model": "builtin:tiny-sort", "max_prompt_length": 16}
        update, objective = {"micro_batch_size": 4}, {}
        if mode == "dapo_kl":
            objective["kl_coef"], update["num_minibatches"] = 0.1, 2
            policy["peft"] = {"class_path": "peft.LoraConfig",
                              "init_args": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
        # mappings change only these fields of DAPO's groups (its objective, filters and rewards stay on)
        module = DAPO.configured(
            policy=policy, sampling={"max_new_tokens": 6, "num_generations": 4, "temperature": 1.0},
            filters={"max_gen_batches": 2}, update=update, objective=objective,
            rewards={"correctness_fn": f"{here}:correctness", "functions": [f"{here}:reward"]},
            optimizer=partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0))
        return module, PromptDataModule(batch_size=2, max_val_rows=3, val_batch_size=1)
    if mode == "dpo":
        rows = [{"prompt": f"{n}=", "chosen": "".join(sorted(str(n))), "rejected": str(n)[::-1] + "7",
                 "answer": "".join(sorted(str(n)))} for n in (312, 9071, 57, 4410, 826, 73, 1902, 648)]
        path = os.path.join(out, "pairs.jsonl")
        tmp = f"{path}.{os.getpid()}"  # before the process group exists: every rank writes, atomically
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(tmp, path)
        module = DPO(policy=PolicyOptions(model="builtin:tiny-sort", max_prompt_length=16),
                     validation=ValidationOptions(max_new_tokens=8), max_completion_length=10,
                     optimizer=partial(torch.optim.SGD, lr=0.1))
        return module, PreferenceDataModule(path=path, batch_size=1, val_batch_size=1, val_fraction=0.375)
    policy, lora = {"model": "builtin:tiny-sort", "max_prompt_length": 16}, {}
    if mode == "lora":
        policy["peft"] = {"class_path": "peft.LoraConfig", "init_args": {
            "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}}
        lora = {"optimizer": partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0)}
    module = GRPO.configured(
        policy=policy, sampling={"max_new_tokens": 8, "num_generations": 4, "temperature": 1.0},
        update={"micro_batch_size": 4, "max_grad_norm": 0.5}, objective={"kl_coef": 0.1}, **lora)
    return module, PromptDataModule(batch_size=2, max_val_rows=3, val_batch_size=1)


def main() -> None:
    torch.set_num_threads(1)
    out = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "grpo"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    os.makedirs(out, exist_ok=True)
    L.seed_everything(0, verbose=False)
    record = Record(seed_per_rank=mode == "resume")
    callbacks: list = [record, ExportPolicy(os.path.join(out, "policy"))]
    strategy = make_strategy(os.environ.get("STRATEGY", "fsdp2"), checkpoint=mode == "resume")
    if mode == "resume":
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), every_n_train_steps=2,
                                         save_top_k=-1, save_last=False))
        validation = {"limit_val_batches": 0, "num_sanity_val_steps": 0}
    else:
        validation = {"val_check_interval": 2, "check_val_every_n_epoch": None, "num_sanity_val_steps": 1}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=mode == "resume", enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=out, callbacks=callbacks, **validation)
    module, datamodule = build(mode, out)
    if resume == "last":
        from lightning_rl.cli.main import find_last_checkpoint

        resume = find_last_checkpoint(trainer)
    trainer.fit(module, datamodule, ckpt_path=resume)
    weights = full_state_dict(module.policy.model)  # every rank joins
    reference = module.reference_policy()
    held = {
        "policy_local_bytes": nbytes(module.policy.parameters()),
        "reference_bytes": nbytes(reference.parameters()) if reference is not None else 0,
        "sharded": collective_forward(module.policy.model),
        "reference_sharded": reference is not None and collective_forward(reference),
        "steps": record.steps,
    }
    if mode == "lora":
        module.export_merged = True  # the same export again, merged (FSDP2: gathered, merged on rank 0)
        ExportPolicy(os.path.join(out, "merged")).on_train_end(trainer, module)
        if not held["sharded"]:
            held["adapters"] = {n: p.detach().clone() for n, p in module.policy.named_parameters()
                                if p.requires_grad}
    per_rank = [None, None]
    dist.all_gather_object(per_rank, held)
    if trainer.global_rank == 0:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        torch.save({"weights": weights, "ranks": per_rank, "metrics": metrics,
                    "global_step": trainer.global_step}, os.path.join(out, "result.pt"))


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
