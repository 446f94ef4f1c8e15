"""Sampling engines on a real model: GRPO on SmolLM2-135M-Instruct (``real_model.py``'s arithmetic task)
through the ``lightning-rl`` CLI with the HF engine, vLLM in the process (``configs/vllm.yaml``), a vLLM
server (``configs/vllm_server.yaml``), each synchronous and one version ahead (``configs/async.yaml``), and
vLLM in bf16 for the mismatch.

    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_speed.py [--steps 6] [--lora]
    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 .venv/bin/python benchmarks/vllm_speed.py --variants hf vllm --steps 3

Each variant is one ``lightning-rl fit`` subprocess: 4 prompts x 4 samples per step, 32 new tokens at
temperature 1, full float32 weights (``--lora``: LoRA r=16 on every linear layer, merged into what vLLM
samples with), lr 1e-6, validation off. Read back from each run's CSV log, the first step left out (engine
start-up): median ``perf/step_time``; generation tokens/s (the step's generated tokens,
``perf/tokens_per_sec x perf/step_time``, over ``perf/generation_time``, the median over steps; for a worker
sampling ahead, its own generation); median ``perf/update_time``; median ``perf/weight_sync_time`` (the
push to vLLM: the learner's for synchronous runs, the learner's publish for asynchronous ones, whose vLLM
load is ``perf/sampler_weight_sync_time``); mean ``rollout/mismatch_k3`` and ``rollout/staleness_mean``; and
the wall time of the process (start-up included). Prints ``get_cpu_capability()`` and ``nproc`` with the
table and updates ``benchmarks/results/vllm_speed.json`` (per variant). SmolLM2 is built as in
``real_model.py`` (needs ``gguf`` and ``accelerate`` once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import real_model  # noqa: E402
import vs_trl_tasks as tasks  # noqa: E402

VARIANTS = {  # overlays over configs/grpo.yaml (or grpo_lora.yaml) and extra keys
    "hf": ([], {}),
    "vllm": (["vllm"], {}),
    "vllm-server": (["vllm_server"], {}),
    "hf-async": (["async"], {}),
    "vllm-async": (["vllm", "async"], {}),
    "vllm-bf16": (["vllm"], {"engine": {"init_args": {"dtype": "bfloat16"}}}),
}


def overlay(args: argparse.Namespace, run: Path, name: str, train: Path, extra: dict) -> dict:
    model = {"policy": {"model": str(tasks.C_MODEL), "chat_template": True, "max_prompt_length": 128},
             "sampling": {"max_new_tokens": args.max_new_tokens, "num_generations": args.group,
                          "temperature": 1.0},
             "objective": {"kl_coef": 0.04},
             "rewards": {"functions": ["lightning_rl.step.rewards:numeric_match"]},
             "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-6, "weight_decay": 0.0}}}
    if args.lora:
        model["policy"]["peft"] = {"class_path": "peft.LoraConfig", "init_args": {
            "r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}}
    for key, value in extra.items():
        model[key] = value
    return {"seed_everything": 0,
            "trainer": {"max_steps": args.steps, "limit_val_batches": 0, "num_sanity_val_steps": 0,
                        "log_every_n_steps": 1, "enable_checkpointing": False,
                        "logger": real_model.loggers(run, name)},
            "model": {"init_args": model},
            "data": {"init_args": {"path": str(train), "val_path": str(train), "batch_size": args.prompts}}}


def summarise(run: Path, name: str, wall: float) -> dict:
    def series(key: str) -> list[float]:
        return [v for _, v in sorted(real_model.read_metric(run, name, key))][1:]

    def med(key: str) -> float:
        values = series(key)
        return statistics.median(values) if values else float("nan")

    # generated tokens = perf/tokens_per_sec x perf/step_time (the step's tokens over the step's time)
    tokens = [r * t for r, t in zip(series("perf/tokens_per_sec"), series("perf/step_time"), strict=True)]
    rates = [n / g for n, g in zip(tokens, series("perf/generation_time"), strict=True) if g > 0]
    k3, stale = series("rollout/mismatch_k3"), series("rollout/staleness_mean")
    return {"s_per_step": med("perf/step_time"),
            "gen_tokens_per_s": statistics.median(rates) if rates else None,
            "update_s": med("perf/update_time"), "sync_ms": med("perf/weight_sync_time") * 1000,
            "sampler_sync_ms": med("perf/sampler_weight_sync_time") * 1000,
            "mismatch_k3": statistics.fmean(k3) if k3 else None,
            "staleness": statistics.fmean(stale) if stale else 0.0, "wall_s": round(wall, 1),
            "steps": len(series("perf/step_time"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--lora", action="store_true")
    args = p.parse_args()
    import torch

    if not (tasks.C_MODEL / "config.json").exists():
        real_model.require_gguf_and_accelerate()
    tasks.build_workload_c()
    run = real_model.new_run_dir("vllm-speed")
    train_rows, _ = tasks.arith_rows(seed=0, num_val=64)
    train = real_model.write_jsonl(run / "train.jsonl", train_rows)
    base = ROOT / "configs" / ("grpo_lora.yaml" if args.lora else "grpo.yaml")
    results = {}
    for name in args.variants:
        overlays, extra = VARIANTS[name]
        mine = real_model.dump_yaml(run / f"{name}.yaml", overlay(args, run, name, train, extra))
        configs = [base, *(ROOT / "configs" / f"{o}.yaml" for o in overlays), mine]
        wall = real_model.run_cli(configs, run, name)
        results[name] = summarise(run, name, wall)
        print(json.dumps({name: results[name]}), flush=True)
    where = f"{torch.backends.cpu.get_cpu_capability()}, nproc {os.cpu_count()}, torch {torch.__version__}"
    print(f"\nSmolLM2-135M-Instruct, {'LoRA' if args.lora else 'full weights'}, {args.prompts} prompts x "
          f"{args.group} samples, {args.max_new_tokens} new tokens; {where}")
    print("| variant | s/step | generation tokens/s | update s | weight push ms | mismatch_k3 | staleness "
          "| wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        k3 = "-" if r["mismatch_k3"] is None else f"{r['mismatch_k3']:.2e}"
        rate = "-" if r["gen_tokens_per_s"] is None else f"{r['gen_tokens_per_s']:.0f}"
        print(f"| {name} | {r['s_per_step']:.2f} | {rate} | {r['update_s']:.2f} | {r['sync_ms']:.0f} | "
              f"{k3} | {r['staleness']:.1f} | {r['wall_s']:.0f} |")
    real_model.RESULTS.mkdir(exist_ok=True)
    out = real_model.RESULTS / ("vllm_speed_lora.json" if args.lora else "vllm_speed.json")
    saved = json.loads(out.read_text()) if out.exists() else {"results": {}}  # other variants' runs stay
    for name, result in results.items():
        saved["results"][name] = {**result, "command": " ".join(sys.argv), "where": where}
    out.write_text(json.dumps(saved, indent=1))
    print(f"wrote {out.relative_to(ROOT)} (each variant with the command and machine of its run)")


if __name__ == "__main__":
    main()
