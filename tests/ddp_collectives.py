"""Runs for tests/step/test_collectives.py: DAPO / DPO under DDP on 2 gloo ranks (or 1 process).

    python tests/ddp_collectives.py OUT MODE DEVICES [STEPS] [RESUME_CKPT]

MODE:
    starve   DAPO where rank 1's filter never keeps a group (every group all wrong) and rank 0's keeps
             every group; generation is synced across ranks (``synced_gpus``, as under FSDP2, through
             the engine), so a rank that generates one round more than another hangs.
    partial  DAPO where rank 0 keeps every group and rank 1 only the groups of some prompts, so rank 1
             refills and what it trains on depends on its refill position; a ModelCheckpoint every 2
             steps (under OUT.ckpt/), and RESUME_CKPT resumes from one.
    dpo      DPO on 8 pairs, 1 pair per rank per step, the policy moved away from the reference.

Every rank writes ``OUT.rank{r}.json``: per step the metrics it logged, its generation rounds and
refill position (DAPO), or its own loss (DPO); and the names it logged.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

import lightning as L
import torch
import torch.distributed as dist

from lightning_rl.algorithms import DAPO, DPO
from lightning_rl.algorithms.options import PolicyOptions
from lightning_rl.algorithms.sampler_options import SamplingOptions
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.data import PromptDataModule
from lightning_rl.data.preference import PreferenceDataModule
from lightning_rl.step.engine import HFEngine

MODE = os.environ.get("COLLECTIVES_MODE", "starve")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _informative(prompt: str) -> bool:
    """Whether this rank's correctness function gives the prompt's group mixed outcomes."""
    if _rank() == 0:
        return True
    if MODE == "starve":
        return False
    return sum(int(ch) for ch in prompt if ch.isdigit()) % 2 == 0


def correctness(prompts, completions, **_):
    """Mixed (every other sample correct) for informative prompts, all wrong otherwise."""
    return [_informative(p) and i % 2 == 0 for i, p in enumerate(prompts)]


def reward(prompts, completions, **_):
    """Correctness plus a little length, so that advantages (and the update) depend on the samples."""
    correct = correctness(prompts, completions)
    return [float(c) + 0.05 * len(t) for c, t in zip(correct, completions, strict=True)]


class SyncedEngine(HFEngine):
    """The in-process engine, its generation made a collective (``synced_gpus``) as with sharded weights."""

    def attach(self, policy, *, synced: bool = False, compact: bool = False) -> None:
        super().attach(policy, synced=synced or MODE == "starve", compact=compact)


class LocalLossDPO(DPO):
    def pair_loss(self, batch, enc):
        loss, metrics = super().pair_loss(batch, enc)
        self.local_loss = float(loss.detach())
        return loss, metrics


class Record(RLCallback):
    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.names: set[str] = set()
        self.rollout: tuple[int, float] = (0, 0.0)

    def on_rollout_end(self, trainer, pl_module, rollout):  # this rank's kept samples and their reward sum
        self.rollout = (len(rollout), float(rollout.rewards.sum()))

    def on_train_batch_end(self, trainer, pl_module, *_):
        logged = {k: float(v) for k, v in trainer.logged_metrics.items()}
        step = {"step": trainer.global_step, "logged": logged}
        dm = trainer.datamodule
        if isinstance(pl_module, DPO):
            step["local_loss"] = pl_module.local_loss
        else:
            step["refills_consumed"] = dm.refills_consumed
            step["kept"], step["reward_sum"] = self.rollout
        self.steps.append(step)
        self.names |= set(logged)


def main() -> None:
    torch.set_num_threads(1)
    out, devices = sys.argv[1], int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    L.seed_everything(0, verbose=False)
    callbacks: list = [record := Record()]
    if MODE == "dpo":
        rows = [{"prompt": f"{n}=", "chosen": "".join(sorted(str(n))), "rejected": str(n)[::-1] + "7"}
                for n in (312, 9071, 57, 4410, 826, 73, 1902, 648)]
        path = f"{out}.pairs.jsonl"
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        module = LocalLossDPO(policy=PolicyOptions(model="builtin:tiny-sort", max_prompt_length=16),
                              max_completion_length=10, optimizer=partial(torch.optim.SGD, lr=0.1))
        assert module.reference is not None  # built from the loaded model, before the policy moves
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # away from the reference, so losses differ between pairs
            for p in module.policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        dm = PreferenceDataModule(path=path, batch_size=1, val_fraction=0.0)
    else:
        here = "ddp_collectives"
        module = DAPO.configured(
            policy=PolicyOptions(model="builtin:tiny-sort", max_prompt_length=16),
            sampling=SamplingOptions(max_new_tokens=6, num_generations=4, temperature=1.0),
            engine=SyncedEngine(),
            filters={"max_gen_batches": 3},
            rewards={"correctness_fn": f"{here}:correctness", "functions": [f"{here}:reward"]},
            optimizer=partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.0))
        dm = PromptDataModule(batch_size=2, max_val_rows=4)
        if MODE == "partial":
            callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
                dirpath=f"{out}.ckpt", every_n_train_steps=2, save_top_k=-1, save_last=False))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                        max_steps=steps, logger=False, enable_checkpointing=MODE == "partial",
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=os.path.dirname(out))
    trainer.fit(module, dm, ckpt_path=resume)
    with open(f"{out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump({"steps": record.steps, "names": sorted(record.names)}, f)


if __name__ == "__main__":
    main()
    if dist.is_initialized():  # tear gloo down cleanly: its threads left running abort the process at exit
        dist.destroy_process_group()
