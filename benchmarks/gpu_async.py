"""Synchronous against asynchronous GRPO on one GPU (sampler and learner on the same device), for the device
machine: seconds per step, tokens per second and peak memory.

    python benchmarks/gpu_async.py                       # CUDA, a 0.4B Llama-shaped model, 20 steps
    python benchmarks/gpu_async.py --device cpu --size tiny --steps 4     # a check that it runs, on CPU

The model is Llama-shaped with random weights and the embedded character tokenizer (no hub here): hidden
1024, 24 layers, 16 heads, MLP 4096 (0.4B parameters) with ``--size 0.4b``; the embedded task's prompts,
``--max-new-tokens`` (128) per completion, 8 prompts x 8 samples per step. Both runs train in fp32 with
``bf16-mixed`` autocast and sample with the bf16 ``CopyEngine``; ``async`` is ``max_staleness: 1`` with the
default worker on a GPU (a thread of the learner's process, its own weights copy and CUDA stream). Prints one
line per variant: median ``perf/step_time`` after the first 3 steps, median ``perf/tokens_per_sec``, the
median wait for the sampler (``perf/rollout_wait_time``), peak ``torch.cuda.max_memory_allocated``. Needs
only torch, lightning and transformers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import lightning as L
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def mount_subpackages() -> None:
    """``lightning_rl.callbacks`` / ``lightning_rl.data`` from the repo's folders when the package is not
    installed (the device machine runs a copy of the tree and has no package index)."""
    import importlib
    import importlib.util

    for name, folder in (("callbacks", "callbacks"), ("data", "data")):
        try:
            importlib.import_module(f"lightning_rl.{name}")
        except ImportError:
            spec = importlib.util.spec_from_file_location(
                f"lightning_rl.{name}", ROOT / folder / "__init__.py",
                submodule_search_locations=[str(ROOT / folder)])
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)


mount_subpackages()
from lightning_rl.algorithms import GRPO  # noqa: E402
from lightning_rl.data.prompts import PromptDataModule  # noqa: E402
from lightning_rl.models.builtin import build_char_tokenizer, tiny_llama_config  # noqa: E402
from lightning_rl.step.engine import CopyEngine  # noqa: E402

SIZES = {"tiny": dict(hidden_size=128, num_layers=2, num_heads=4, intermediate_size=512),
         "0.4b": dict(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096)}


def build_model(size: str, folder: Path) -> Path:
    """A random Llama-shaped model of ``size`` with the character tokenizer, saved to ``folder``."""
    from transformers import LlamaForCausalLM

    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(tokenizer, max_position_embeddings=512, **SIZES[size])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


KEYS = ("perf/step_time", "perf/tokens_per_sec", "perf/rollout_wait_time", "perf/weight_sync_time")


class Record(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        self.rows.append({k: float(m[k]) for k in KEYS if k in m})


def timed_fit(variant: str, model: Path, engine: object, lag: int, args: argparse.Namespace,
              out: Path) -> tuple[Callable[[str], float], float]:
    """GRPO on ``model`` sampled by ``engine`` (``lag`` = ``max_staleness``) for ``args.steps`` steps: the
    median of a logged key over the steps after the first 3, and the wall time of the fit."""
    module = GRPO.configured(
        policy={"model": str(model), "max_prompt_length": 64},
        sampling={"num_generations": 8, "max_new_tokens": args.max_new_tokens, "max_staleness": lag},
        engine=engine, optimizer=partial(torch.optim.AdamW, lr=1e-6))
    record = Record()
    cuda = args.device == "cuda"
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[record],
                        default_root_dir=str(out / variant), precision="bf16-mixed" if cuda else "32-true")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(module, datamodule=PromptDataModule(batch_size=8))
    wall = time.perf_counter() - start
    rows = record.rows[3:] or record.rows

    def med(key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else float("nan")

    return med, wall


def run(variant: str, model: Path, args: argparse.Namespace, out: Path) -> str:
    lag = {"sync": 0, "async": 1}[variant]
    med, wall = timed_fit(variant, model, CopyEngine("bfloat16"), lag, args, out)
    memory = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    return (f"{variant:5s} | {med('perf/step_time'):.3f} s/step | "
            f"{med('perf/tokens_per_sec'):.0f} tokens/s | wait {med('perf/rollout_wait_time'):.3f} s | "
            f"peak {memory:.1f} GiB | wall {wall:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", default="0.4b", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=["sync", "async"])
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else torch.backends.cpu.get_cpu_capability()
    print(f"{name}, torch {torch.__version__}, {args.size} model, {args.steps} steps")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.size, Path(tmp) / "model")
        for variant in args.variants:
            print(run(variant, model, args, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
