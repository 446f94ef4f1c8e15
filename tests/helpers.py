"""Shared test helpers: build tiny modules and trainers, run the real CLI in-process, read logged scalars
and text summaries, a chat-templated copy of the embedded model."""

from __future__ import annotations

import csv
import glob
import json
import shutil
from functools import partial
from pathlib import Path

import lightning as L
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer

import lightning_rl.step.logprobs
from lightning_rl.algorithms import GRPO
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.cli.main import LightningRLCLI
from lightning_rl.data import PromptDataModule

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def run_cli(*args: str):
    """``lightning-rl <args>`` in this process; returns the LightningCLI object."""
    return LightningRLCLI(args=[str(a) for a in args])


def scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """All TensorBoard scalars under ``log_dir``: ``{tag: [(step, value), ...]}``."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)):
        acc = EventAccumulator(path, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


def texts(log_dir) -> dict[str, list[tuple[int, str]]]:
    """Every text summary under ``log_dir``: ``{tag: [(step, markdown), ...]}`` (tags as written)."""
    out: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)):
        acc = EventAccumulator(path, size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            name = tag.removesuffix("/text_summary")
            out.setdefault(name, []).extend(
                (e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag))
    return out


def logprobs(module, rollout, scorer=None):
    """``[N, C]`` log-probs of ``rollout`` under ``scorer`` (default: the policy), as the step scores them."""
    from lightning_rl.step.collectives import Collectives
    from lightning_rl.step.logprobs import score_rollout

    scorer = module.policy if scorer is None else scorer
    joiner = module.policy if scorer is module.policy or getattr(scorer, "shares_weights", False) else None
    return score_rollout(scorer, rollout, micro_batch_size=module.updater.micro_batch_size,
                         collectives=Collectives(module._trainer), joiner=joiner)


def spy_policy_scoring(monkeypatch, module) -> list[int]:
    """Record the size of every rollout the step's log-prob passes score with the trained policy itself
    (the behaviour pass under ``recompute``); the ``logprobs`` helpers is not counted."""
    calls, original = [], lightning_rl.step.logprobs.score_rollout

    def spy(scorer, rollout, **kw):
        if scorer is module.policy:
            calls.append(len(rollout))
        return original(scorer, rollout, **kw)

    monkeypatch.setattr(lightning_rl.step.logprobs, "score_rollout", spy)
    return calls


class Recorder(RLCallback):
    """Keeps every step's final rollout (``rollouts``) and statistics (``stats``)."""

    def __init__(self) -> None:
        self.rollouts, self.stats = [], []

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.rollouts.append(rollout)

    def on_step_end(self, trainer, pl_module, stats):
        self.stats.append(dict(stats))


def update(module, minibatch):
    """One optimiser step of ``module``'s trained models on ``minibatch`` (the updater's ``update``);
    returns each micro-batch's ``(metrics, share)``."""
    from lightning_rl.step.collectives import Collectives

    return list(module.updater.update(minibatch, module.trained_models(), module.update_hooks(),
                                      Collectives(module.trainer)))


def make(cls=GRPO, **groups):
    """A tiny online RL module on the embedded model (prompts <= 16 tokens, 8 new tokens, G = 4, AdamW lr
    1e-3). Each group is given as a mapping of the fields to change (``sampling={"temperature": 0.5}``),
    merged over these test defaults and then over the preset's defaults, as a YAML would be; a group given
    as an options object replaces the preset's whole group."""
    args = {"policy": {"max_prompt_length": 16}, "sampling": {"max_new_tokens": 8, "num_generations": 4},
            "optimizer": partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.0)}
    for name, value in groups.items():
        base = args.get(name)
        args[name] = base | value if isinstance(base, dict) and isinstance(value, dict) else value
    return cls.configured(**args)


def make_trainer(tmp_path, max_steps=1, callbacks=(), logger=False, limit_val_batches=0, **kw):
    """A quiet single-process CPU trainer (no checkpoints, no validation unless asked)."""
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=logger,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0,
                     limit_val_batches=limit_val_batches, callbacks=list(callbacks),
                     default_root_dir=str(tmp_path), **kw)


def datamodule(**kw):
    return PromptDataModule(**(dict(batch_size=4, max_val_rows=16) | kw))


def read_csv_metrics(log_dir) -> dict[str, list[float]]:
    """Every logged value of a CSVLogger run: ``{name: [values in step order]}``."""
    (path,) = glob.glob(f"{log_dir}/**/metrics.csv", recursive=True)
    out: dict[str, list[float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if v not in ("", None) and k not in ("epoch", "step"):
                    out.setdefault(k, []).append(float(v))
    return out


# a chat template, and a model folder whose tokenizer carries it (test_online_behaviour, test_samples)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def templated_model(tmp_path):
    """The embedded model with a chat template in its tokenizer folder, and a tokenizer that adds <bos> to
    every plain encoding (as Llama's does): a template that holds BOS itself must not get a second one."""
    from lightning_rl.models.builtin import EMBEDDED_MODEL

    folder = tmp_path / "chat_model"
    shutil.copytree(EMBEDDED_MODEL, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    bos = [{"SpecialToken": {"id": "<bos>", "type_id": 0}}]
    spec["post_processor"] = {
        "type": "TemplateProcessing", "single": [*bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [*bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [1], "tokens": ["<bos>"]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return str(folder)


def sample_round(module, batch, collectives=None, decide=True):
    """The sampler's first round of a step on ``batch`` (G samples per prompt row, scored), seeded as the
    step seeds it; ``decide``: whether the reward-failure limit is checked (refill rounds: no)."""
    from lightning_rl.episodes.source import round_seed

    seed = round_seed(module.rollouts.seed, module.trainer.fit_loop.total_batch_idx, 0, module.global_rank)
    return module.online.sampler(batch, module.completer.io(), seed=seed, collectives=collectives,
                                 decide=decide, device=module.device)


def gone(pid: int) -> bool:
    """The process is dead (no /proc entry, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] == "Z"
    except FileNotFoundError:
        return True
