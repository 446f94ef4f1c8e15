"""Asynchronous sampling against the synchronous step, paired in one invocation (alternating rounds).

    .venv/bin/python benchmarks/async_speed.py [--steps 300] [--rounds 2] [--variants sync1 async1 ...]
    .venv/bin/python benchmarks/async_speed.py --real --steps 12        # SmolLM2-135M-Instruct + LoRA

Variants, each a real ``lightning-rl fit`` in a subprocess on ``configs/grpo.yaml``'s work (the embedded
model and sort task) or, with ``--real``, on SmolLM2-135M-Instruct with LoRA as ``benchmarks/real_model.py``
runs it:

* ``sync1`` / ``sync2``: ``max_staleness: 0``, torch on 1 / 2 threads;
* ``*_before``: the same with ``update.skip_zero_rows: false`` (the learner forwarding every row, as before
  it skipped the rows without gradient); ``*_packed``: with ``configs/packed.yaml`` over it;
* ``async1`` / ``async2``: ``configs/async.yaml`` with ``max_staleness`` 1 / 2: the learner on 1 thread, the
  sampler's worker (a process, the CPU default) on 1 thread; ``async1_learner2``: ``max_staleness`` 1 with
  the learner on 2 threads; ``async1_thread``: ``max_staleness`` 1 with the sampler a thread of the
  learner's process (``sampling.worker: thread``, the GPU default), each on 1 torch thread: what the GIL
  costs on CPU, where the decode loop is Python-heavy.

For each run: wall seconds, the median ``perf/step_time`` (steps after the first 5), the median of each
phase on the learner (``perf/rollout_wait_time``: waiting for the worker; ``perf/generation_time``,
``perf/reference_time`` / ``perf/sampler_reference_time``, ``perf/update_time``), held-out
``val/accuracy`` at the end, and the mean ``rollout/staleness_mean`` and ``rollout/mismatch_k3``. Prints
a Markdown table of the medians over rounds with ``torch.backends.cpu.get_cpu_capability()`` and the core
count, and writes ``benchmarks/results/async_speed.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# (max_staleness, the learner's torch threads, the worker, more flags); the worker always takes 1 torch thread
BEFORE = ("--model.init_args.update.skip_zero_rows", "false")  # the learner as it was: every row forwarded
PACKED = ("--config", str(Path(__file__).resolve().parents[1] / "configs" / "packed.yaml"))
VARIANTS = {"sync1": (0, 1, "auto", ()), "sync2": (0, 2, "auto", ()), "async1": (1, 1, "process", ()),
            "async2": (2, 1, "process", ()), "async1_learner2": (1, 2, "process", ()),
            "async1_thread": (1, 1, "thread", ()), "sync1_before": (0, 1, "auto", BEFORE),
            "sync2_before": (0, 2, "auto", BEFORE), "async1_before": (1, 1, "process", BEFORE),
            "sync1_packed": (0, 1, "auto", PACKED), "async1_packed": (1, 1, "process", PACKED)}
PHASES = ["perf/rollout_wait_time", "perf/generation_time", "perf/reference_time",
          "perf/sampler_reference_time", "perf/update_time"]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    (events,) = glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def configs(real: Path | None) -> list[str]:
    if real is None:
        return ["--config", str(ROOT / "configs" / "grpo.yaml")]
    return ["--config", str(ROOT / "configs" / "grpo_lora.yaml"), "--config", str(real)]


def run(variant: str, steps: int, real: Path | None, val_every: int) -> dict:
    lag, threads, worker, extra = VARIANTS[variant]
    out = Path(tempfile.mkdtemp(prefix=f"async-{variant}-"))
    cmd = [sys.executable, "-m", "lightning_rl.cli.main", "fit", *configs(real),
           "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(val_every),
           "--trainer.logger.init_args.save_dir", str(out), "--trainer.enable_progress_bar", "false",
           "--model.init_args.sampling.max_staleness", str(lag), "--model.init_args.sampling.worker", worker,
           *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "LRL_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                   stderr=open(out / "stderr.log", "w"))
    wall = time.perf_counter() - start
    logged = scalars(out)

    def median(tag: str) -> float | None:
        values = [v for s, v in logged.get(tag, []) if s > 5]
        return statistics.median(values) if values else None

    def mean(tag: str) -> float | None:
        values = [v for _, v in logged.get(tag, [])]
        return statistics.fmean(values) if values else None

    return {"variant": variant, "wall_s": wall, "step_time": median("perf/step_time"),
            **{tag: median(tag) for tag in PHASES},
            "val_accuracy_start": logged["val/accuracy"][0][1], "val_accuracy": logged["val/accuracy"][-1][1],
            "staleness_mean": mean("rollout/staleness_mean"), "mismatch_k3": mean("rollout/mismatch_k3")}


def real_overlay(steps: int) -> Path:
    """``benchmarks/real_model.py``'s GRPO + LoRA overlay on SmolLM2 and its arithmetic task (the model folder
    built once as it builds it), logging where each run of this script says."""
    sys.path.insert(0, str(HERE))
    import real_model  # noqa: PLC0415  (benchmarks/ is not a package)

    args = real_model.parse_args(["--steps", str(steps)])
    if not (real_model.tasks.C_MODEL / "config.json").exists():
        real_model.require_gguf_and_accelerate()
    real_model.tasks.build_workload_c()
    run = real_model.new_run_dir("async")
    train_rows, val_rows = real_model.tasks.arith_rows(seed=args.seed, num_val=args.num_val)
    train = real_model.write_jsonl(run / "train.jsonl", train_rows)
    val = real_model.write_jsonl(run / "val.jsonl", val_rows)
    overlay = real_model.grpo_overlay(args, run, train, val)
    del overlay["trainer"]["logger"]  # configs/grpo_lora.yaml's TensorBoard logger, in each run's folder
    return real_model.dump_yaml(run / "overlay.yaml", overlay)


def table(results: list[dict]) -> str:
    rows = ["| variant | s/step (median) | x best sync | wait | generation | reference (learner / sampler) | "
            "update | val/accuracy start -> end | staleness | mismatch_k3 |", "|---" * 10 + "|"]
    by = {v: [r for r in results if r["variant"] == v] for v in dict.fromkeys(r["variant"] for r in results)}

    def med(v: str, key: str) -> float | None:
        values = [r[key] for r in by[v] if r[key] is not None]
        return statistics.median(values) if values else None

    best = min(med(v, "step_time") for v in by if v.startswith("sync"))
    fmt = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    for v in by:
        rows.append(f"| {v} | {fmt(med(v, 'step_time'))} | {fmt(med(v, 'step_time') / best, 2)} | "
                    f"{fmt(med(v, 'perf/rollout_wait_time'))} | {fmt(med(v, 'perf/generation_time'))} | "
                    f"{fmt(med(v, 'perf/reference_time'))} / {fmt(med(v, 'perf/sampler_reference_time'))} | "
                    f"{fmt(med(v, 'perf/update_time'))} | {fmt(med(v, 'val_accuracy_start'))} -> "
                    f"{fmt(med(v, 'val_accuracy'))} | {fmt(med(v, 'staleness_mean'), 2)} | "
                    f"{fmt(med(v, 'mismatch_k3'), 5)} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--val-every", type=int, default=None, help="default: the last step only")
    parser.add_argument("--variants", nargs="+", default=["sync1", "sync2", "async1", "async2"],
                        choices=list(VARIANTS))
    parser.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct with LoRA")
    args = parser.parse_args()
    real = real_overlay(args.steps) if args.real else None
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, nproc {os.cpu_count()}, "
          f"{args.steps} steps, {args.rounds} rounds, "
          f"{'SmolLM2-135M + LoRA' if real else 'configs/grpo.yaml'}")
    results = []
    for round_index in range(args.rounds):
        for variant in args.variants:
            result = run(variant, args.steps, real, args.val_every or args.steps)
            results.append(result)
            print(f"[round {round_index + 1}] {json.dumps(result)}", flush=True)
    print(table(results))
    (HERE / "results").mkdir(exist_ok=True)
    name = "async_speed_real.json" if real else "async_speed.json"
    (HERE / "results" / name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
