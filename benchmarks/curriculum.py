"""The difficulty curriculum against the plain prompt stream on the embedded sort task: steps and seconds to a
held-out accuracy.

    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 python benchmarks/curriculum.py [--steps 300] [--every 10]
        [--train-rows N] [--seed S] [--out results.json]

Runs ``configs/grpo.yaml`` as it is and with ``configs/curriculum.yaml`` over it (the same seed, model, 16
prompts x 8 samples per step, learning rate), each through the real CLI in a subprocess, with greedy
validation on the 256 held-out prompts every ``--every`` steps. Reports for each: held-out accuracy at the
start and the end (best), the first validated step at or above ``--target`` (0.85) and the training seconds
up to it (the sum of ``perf/step_time``: validation excluded), wall seconds, and for the curriculum what its
pools held: the mean share of each step's prompts that had never been seen (``curriculum/batch_unseen_frac``:
near 1, the pools had nothing to act on), and at the end the prompts seen and the easy / hard shares of them.

``--train-rows N`` trains on the first N prompts of the built-in task instead of its 20,000 (written to a
JSONL file, the held-out set beside it unchanged), so that prompts come back within the run. Prints the CPU
capability and thread counts beside the figures.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    (events,) = glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def data_files(rows: int, folder: Path) -> list[str]:
    """``--data.init_args.path`` / ``val_path`` arguments for the first ``rows`` training prompts of the
    built-in sort task and its held-out set."""
    from lightning_rl.data.sort_task import SortTask

    task = SortTask()
    train, val = folder / "train.jsonl", folder / "val.jsonl"
    train.write_text("".join(json.dumps(task.train_row(i)) + "\n" for i in range(rows)))
    val.write_text("".join(json.dumps(row) + "\n" for row in task.val_rows()))
    return ["--data.init_args.path", str(train), "--data.init_args.val_path", str(val)]


def run(curriculum: bool, steps: int, every: int, target: float, rows: int | None, seed: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"bench-curriculum-{int(curriculum)}-"))
    configs = ["grpo.yaml"] + (["curriculum.yaml"] if curriculum else [])
    cmd = [sys.executable, "-m", "lightning_rl.cli.main", "fit",
           *[a for c in configs for a in ("--config", str(ROOT / "configs" / c))],
           "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(every),
           "--trainer.logger.init_args.save_dir", str(out), "--trainer.enable_progress_bar", "false",
           "--trainer.enable_checkpointing", "false", "--seed_everything", str(seed),
           "--data.init_args.seed", str(seed), *(data_files(rows, out) if rows else [])]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    logged = scalars(out)
    accuracy = sorted(logged["val/accuracy"])
    step_time = dict(logged["perf/step_time"])
    reached = next((step for step, value in accuracy if step > 0 and value >= target), None)
    seconds = sum(t for s, t in step_time.items() if reached is not None and s <= reached)
    result = {"curriculum": curriculum, "start": accuracy[0][1], "end": accuracy[-1][1],
              "best": max(v for _, v in accuracy), "reached": reached,
              "seconds": seconds if reached is not None else None, "train_seconds": sum(step_time.values()),
              "wall": wall, "curve": accuracy}
    if curriculum:
        last = {k: v[-1][1] for k, v in logged.items() if k.startswith("curriculum/")}
        unseen = [v for _, v in logged["curriculum/batch_unseen_frac"]]
        result["pools"] = {"batch_unseen_frac_mean": sum(unseen) / len(unseen),
                           "seen": last["curriculum/seen"], "easy": last["curriculum/easy"],
                           "hard": last["curriculum/hard"],
                           "mean_pass_rate": last["curriculum/mean_pass_rate"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--train-rows", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed_everything and the data's seed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, nproc {os.cpu_count()}, "
          f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
          f"training prompts {args.train_rows or 'all 20000'}, seed {args.seed}")
    print(f"| stream | held-out accuracy start -> end (best) | first step >= {args.target} "
          "| training s to it | training s (all steps) | wall s |")
    print("|---|---|---|---|---|---|")
    results = []
    for curriculum in (False, True):
        r = run(curriculum, args.steps, args.every, args.target, args.train_rows, args.seed)
        results.append(r)
        seconds = f"{r['seconds']:.0f}" if r["seconds"] is not None else "-"
        name = "curriculum" if curriculum else "plain"
        print(f"| {name} | {r['start']:.3f} -> {r['end']:.3f} ({r['best']:.3f}) | {r['reached'] or '-'} "
              f"| {seconds} | {r['train_seconds']:.0f} | {r['wall']:.0f} |", flush=True)
        print("  curve:", " ".join(f"{s}:{v:.3f}" for s, v in r["curve"]), flush=True)
        if curriculum:
            p = r["pools"]
            print(f"  pools: mean share of never-seen prompts per step {p['batch_unseen_frac_mean']:.3f}; "
                  f"at the end {p['seen']:.0f} prompts seen, {p['easy']:.0f} easy, {p['hard']:.0f} hard, "
                  f"mean pass rate {p['mean_pass_rate']:.3f}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results,
                                        "cpu": torch.backends.cpu.get_cpu_capability(),
                                        "nproc": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
