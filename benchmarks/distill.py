"""On-policy distillation against GRPO on the embedded sort task: steps and seconds to a held-out accuracy.

    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 python benchmarks/distill.py [--steps 300] [--every 10]

Runs ``configs/distill.yaml`` and ``configs/grpo.yaml`` as they are (the same student, the embedded warm
start; the same 16 prompts x 8 samples per step and learning rate), each through the real CLI in a subprocess,
with greedy validation on the 256 held-out prompts every ``--every`` steps, for ``--steps`` steps. Reports for
each: held-out accuracy at the start and the end, the first validated step at or above ``--target`` (0.85) and
the training seconds up to it (the sum of ``perf/step_time``: validation excluded), and the reverse KL to the
teacher (``builtin:tiny-sort-teacher``) before and after: the mean per-token ``log p_student - log p_teacher``
of the student's own samples (4 per held-out prompt, temperature 1), the quantity distillation minimises.
Prints the CPU capability and thread counts beside the figures.
"""

from __future__ import annotations

import argparse
import glob
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


@torch.no_grad()
def reverse_kl(student_path: str, samples: int = 4, seed: int = 0) -> float:
    """Mean per-token ``log p_student - log p_teacher`` on the student's samples of the held-out prompts."""
    from lightning_rl.data.sort_task import SortTask
    from lightning_rl.models.generation import SamplingParams, hf_generate
    from lightning_rl.models.loading import load_policy

    student, teacher = load_policy(student_path), load_policy("builtin:tiny-sort-teacher")
    student.model.eval()
    prompts = [row["prompt"] for row in SortTask().val_rows()]
    ids, mask = student.encode_prompts(prompts, 16)
    torch.manual_seed(seed)
    gen = hf_generate(student, ids, mask, num_samples=samples, compact=True,
                      sampling=SamplingParams(8, 1.0, 1.0, 0, True))
    args = (gen.prompt_ids, gen.prompt_mask, gen.completion_ids, gen.completion_mask)
    mine, _ = student.token_logprobs(*args)
    theirs, _ = teacher.token_logprobs(*args)
    valid = gen.completion_mask.bool()
    return float((mine - theirs)[valid].mean())


def run(config: str, steps: int, every: int, target: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"bench-distill-{config}-"))
    cmd = [sys.executable, "-m", "lightning_rl.cli.main", "fit", "--config", str(ROOT / "configs" / config),
           "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(every),
           "--trainer.logger.init_args.save_dir", str(out), "--trainer.enable_progress_bar", "false",
           "--trainer.enable_checkpointing", "false"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    logged = scalars(out)
    accuracy = sorted(logged["val/accuracy"])
    step_time = dict(logged["perf/step_time"])  # logged at the optimiser step each trainer step reached
    reached = next((step for step, value in accuracy if step > 0 and value >= target), None)
    seconds = sum(t for s, t in step_time.items() if reached is not None and s <= reached)
    (policy,) = glob.glob(f"{out}/**/policy", recursive=True)
    return {"config": config, "start": accuracy[0][1], "end": accuracy[-1][1],
            "best": max(v for _, v in accuracy), "reached": reached,
            "seconds": seconds if reached is not None else None, "wall": wall,
            "kl_before": reverse_kl("builtin:tiny-sort"), "kl_after": reverse_kl(policy),
            "curve": accuracy}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--configs", nargs="+", default=["distill.yaml", "grpo.yaml"])
    args = parser.parse_args()
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, nproc {os.cpu_count()}, "
          f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"| config | held-out accuracy start -> end (best) | first step >= {args.target} "
          "| training s to it | reverse KL to the teacher before -> after | wall s |")
    print("|---|---|---|---|---|---|")
    for config in args.configs:
        r = run(config, args.steps, args.every, args.target)
        seconds = f"{r['seconds']:.0f}" if r["seconds"] is not None else "-"
        print(f"| `{r['config']}` | {r['start']:.3f} -> {r['end']:.3f} ({r['best']:.3f}) "
              f"| {r['reached'] or '-'} | {seconds} | {r['kl_before']:.3f} -> {r['kl_after']:.3f} "
              f"| {r['wall']:.0f} |", flush=True)
        print("  curve:", " ".join(f"{s}:{v:.3f}" for s, v in r["curve"]), flush=True)


if __name__ == "__main__":
    main()
