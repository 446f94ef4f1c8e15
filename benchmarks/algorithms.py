"""Measure each config as-is: held-out greedy accuracy at the start and end, steps and wall time.

    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 python benchmarks/algorithms.py [sft grpo gspo dapo sapo dpo ppo ...]

A name ``a+b/c`` runs ``configs/a.yaml`` with the overlay ``configs/b/c.yaml`` (e.g. ``grpo+precision/bf16``;
the objective options of ``configs/objectives/``: ``grpo+objectives/dppo``, ``grpo+objectives/high_entropy``,
``grpo+objectives/clip_cov``, ``grpo+objectives/kl_cov``, ``grpo+objectives/opsm``, or ``objectives`` for all
five).

``reward_model`` reports held-out pair accuracy (``val/rm/accuracy``); ``ppo_rm`` uses the reward model that
the ``reward_model`` run of the same invocation exported (it runs one first if none was asked for earlier).

Prints a Markdown table (the README's). Each run is a real `lightning-rl fit --config configs/<name>.yaml`
in a subprocess, logging to a temporary folder; figures are read back from its TensorBoard events.
"""

from __future__ import annotations

import glob
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]


def _scalars(log_dir: Path) -> dict[str, list[float]]:
    (events,) = glob.glob(f"{log_dir}/**/events.out.tfevents.*", recursive=True)
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


METRIC = {"reward_model": "val/rm/accuracy"}  # the held-out figure of each config; default val/accuracy
EXPORTS: dict[str, Path] = {}  # exported folders of this invocation's runs, by config name


def _configs(name: str) -> list[str]:
    """``grpo+precision/bf16``: ``configs/grpo.yaml`` with the overlay ``configs/precision/bf16.yaml``."""
    out = []
    for part in name.split("+"):
        out += ["--config", str(ROOT / "configs" / f"{part}.yaml")]
    return out


def _cli(subcommand: str, name: str, out: Path) -> float:
    cmd = [sys.executable, "-m", "lightning_rl.cli.main", subcommand, *_configs(name),
           "--trainer.logger.init_args.save_dir", str(out), "--trainer.enable_progress_bar", "false"]
    if name == "ppo_rm":
        cmd += ["--model.init_args.rewards.model", str(EXPORTS["reward_model"])]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def run(name: str) -> dict:
    """``validate`` (the starting model), then ``fit``; figures from their TensorBoard events."""
    out = Path(tempfile.mkdtemp(prefix=f"bench-{name.replace('/', '_')}-"))
    _cli("validate", name, out / "start")
    seconds = _cli("fit", name, out / "fit")
    start, end = _scalars(out / "start"), _scalars(out / "fit")
    base = name.split("+")[0]
    steps = yaml.safe_load((ROOT / "configs" / f"{base}.yaml").read_text())["trainer"]["max_steps"]
    metric = METRIC.get(name, "val/accuracy")
    result = {"name": name, "start": start[metric][0], "end": end[metric][-1], "steps": steps,
              "seconds": seconds}
    if name == "reward_model":
        (EXPORTS[name],) = (out / "fit").glob("**/reward_model/config.json")
        EXPORTS[name] = EXPORTS[name].parent
    if "val/rewards/accuracy" in end:
        result.update(pref_start=start["val/rewards/accuracy"][0], pref_end=end["val/rewards/accuracy"][-1])
    return result


OBJECTIVES = [f"grpo+objectives/{p.stem}" for p in sorted((ROOT / "configs" / "objectives").glob("*.yaml"))]


def main(names: list[str]) -> None:
    names = [n for name in names for n in (OBJECTIVES if name == "objectives" else [name])]
    print("| config | val/accuracy start | val/accuracy end | optimiser steps | wall time (s) |")
    print("|---|---|---|---|---|")
    for name in names:
        if name == "ppo_rm" and "reward_model" not in EXPORTS:
            run("reward_model")
        r = run(name)
        note = (f" (held-out preference accuracy {r['pref_start']:.2f} -> {r['pref_end']:.2f})"
                if "pref_start" in r else "")
        if name in METRIC:
            note += f" ({METRIC[name]})"
        label = " + ".join(f"`configs/{part}.yaml`" for part in name.split("+"))
        print(f"| {label} | {r['start']:.3f} | {r['end']:.3f}{note} | "
              f"{r['steps']} | {r['seconds']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["sft", "grpo", "gspo", "dapo", "sapo", "dpo", "ppo", "reward_model", "ppo_rm",
                          "grpo_lora", "rloo", "reinforce_pp", "grpo+precision/bf16"])
