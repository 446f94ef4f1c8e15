"""What the learner's work-saving options do on real shapes: the update phase's time, the process's peak RSS
and ``perf/pad_frac``, before (every row forwarded, fixed-row micro-batches, whole logits) and after.

    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 .venv/bin/python benchmarks/learner_real.py [--task smollm2|tools]

Each variant is a real ``lightning-rl fit`` in a subprocess; its peak RSS is the child's ``ru_maxrss``
(``os.wait4``), its times the logged ``perf/update_time`` / ``perf/step_time`` (mean over the steps after
the first), ``perf/pad_frac`` and ``perf/skipped_rows_frac`` likewise:

* ``--task smollm2`` (default): SmolLM2-135M-Instruct, full fine-tune (no LoRA), on
  ``vs_trl_tasks.arith_rows`` (``benchmarks/real_model.py``'s arithmetic task and chat template), 8 prompts x
  8 samples, 16 new tokens, temperature 0.7, ``kl_coef: 0`` (so rows whose group all scored alike carry no
  gradient), lr 1e-6, ``--steps`` steps (default 6).
* ``--task tools``: ``configs/grpo_tools.yaml`` as shipped (multi-turn episodes with the calculator, episode
  lengths from 10 to 100 tokens), ``--steps`` steps.

Variants: ``before`` (``update.skip_zero_rows: false``; ``micro_batch_size`` 16 rows; no chunking),
``skip`` (rows without signal skipped), ``tokens`` (``micro_batch_tokens`` instead of rows, skip on),
``after`` (skip, token budget and ``logprob_chunk: 256``). Prints a Markdown table with
``torch.backends.cpu.get_cpu_capability()`` and ``nproc``, writes ``benchmarks/results/learner_real.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import real_model  # noqa: E402  (the SmolLM2 task, loggers and CSV reading)
import vs_trl_tasks as tasks  # noqa: E402

ROWS = 16  # rows per micro-batch before; the token budget after holds as many rows of the typical length
VARIANTS: dict[str, dict[str, Any]] = {
    "before": {"skip_zero_rows": False, "micro_batch_size": ROWS},
    "skip": {"skip_zero_rows": True, "micro_batch_size": ROWS},
    "tokens": {"skip_zero_rows": True, "micro_batch_size": None, "micro_batch_tokens": "budget"},
    "after": {"skip_zero_rows": True, "micro_batch_size": None, "micro_batch_tokens": "budget",
              "logprob_chunk": 256},
}


def smollm2_overlay(args: argparse.Namespace, run: Path, name: str, update: dict[str, Any]) -> dict[str, Any]:
    train_rows, val_rows = tasks.arith_rows(seed=0, num_val=16)
    train = real_model.write_jsonl(run / "train.jsonl", train_rows)
    val = real_model.write_jsonl(run / "val.jsonl", val_rows)
    return {
        "seed_everything": 0,
        "trainer": {"max_steps": args.steps, "val_check_interval": 10_000, "num_sanity_val_steps": 0,
                    "enable_checkpointing": False, "logger": real_model.loggers(run, name), "callbacks": []},
        "model": {"init_args": {
            "policy": {"model": str(tasks.C_MODEL), "chat_template": True, "max_prompt_length": 128},
            "sampling": {"max_new_tokens": 16, "num_generations": 8, "temperature": 0.7},
            "objective": {"kl_coef": 0.0},
            "rewards": {"functions": ["lightning_rl.step.rewards:numeric_match"]},
            "update": update,
            "optimizer": {"class_path": "torch.optim.AdamW",
                          "init_args": {"lr": 1e-6, "weight_decay": 0.0}},
        }},
        "data": {"init_args": {"path": str(train), "val_path": str(val), "batch_size": 8,
                               "val_batch_size": 16}},
    }


def tools_overlay(args: argparse.Namespace, run: Path, name: str, update: dict[str, Any]) -> dict[str, Any]:
    trainer = {"max_steps": args.steps, "val_check_interval": 10_000, "num_sanity_val_steps": 0,
               "enable_checkpointing": False, "logger": real_model.loggers(run, name), "callbacks": []}
    return {"trainer": trainer, "model": {"init_args": {"update": update}}}


TASKS = {"smollm2": (ROOT / "configs" / "grpo.yaml", smollm2_overlay, 128 + 16),
         "tools": (ROOT / "configs" / "grpo_tools.yaml", tools_overlay, 16 + 100)}


def run_variant(args: argparse.Namespace, run: Path, name: str) -> dict[str, Any]:
    base, overlay_fn, row_tokens = TASKS[args.task]
    update = {k: (ROWS * row_tokens // 2 if v == "budget" else v) for k, v in VARIANTS[name].items()}
    overlay = real_model.dump_yaml(run / f"{name}.yaml", overlay_fn(args, run, name, update))
    command = [sys.executable, "-m", "lightning_rl.cli.main", "fit", "--config", str(base), "--config",
               str(overlay), "--trainer.enable_progress_bar", "false"]
    print(f"$ {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(run / f"{name}.log", "w") as out:
        child = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"{name} failed; see {run / f'{name}.log'}")
    means = {}
    for key in ("perf/update_time", "perf/step_time", "perf/pad_frac", "perf/skipped_rows_frac"):
        values = [v for _, v in sorted(real_model.read_metric(run, name, key))][1:]
        means[key] = round(statistics.fmean(values), 4) if values else None
    return {"variant": name, "update": update, "wall_s": round(time.perf_counter() - start, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024), **means}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=tuple(TASKS), default="smollm2")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = p.parse_args()
    if args.task == "smollm2":
        if not (tasks.C_MODEL / "config.json").exists():
            real_model.require_gguf_and_accelerate()
        tasks.build_workload_c()
    run = real_model.new_run_dir(f"learner-{args.task}")
    rows = [run_variant(args, run, name) for name in args.variants]
    facts = f"{torch.backends.cpu.get_cpu_capability()}, nproc {os.cpu_count()}, " \
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    print(f"\n{args.task}, {args.steps} steps ({facts})\n")
    print("| variant | update s | step s | pad_frac | skipped rows | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['perf/update_time']} | {r['perf/step_time']} | {r['perf/pad_frac']} | "
              f"{r['perf/skipped_rows_frac']} | {r['peak_rss_mb']} |")
    out = HERE / "results" / "learner_real.json"
    old = json.loads(out.read_text()) if out.exists() else {}
    old[args.task] = {"command": " ".join(sys.argv), "facts": facts, "rows": rows}
    out.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
