"""Measure each config as-is: held-out greedy accuracy at the start and end, steps and wall time.

    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 python benchmarks/algorithms.py [grpo gspo dapo sapo sft dpo]

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


def run(name: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    cmd = [sys.executable, "-m", "lightning_rl.cli", "fit", "--config", str(ROOT / "configs" / f"{name}.yaml"),
           "--trainer.logger.init_args.save_dir", str(out), "--trainer.enable_progress_bar", "false"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    (events,) = glob.glob(f"{out}/**/events.out.tfevents.*", recursive=True)
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    val = [e.value for e in acc.Scalars("val/accuracy")]
    steps = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())["trainer"]["max_steps"]
    extra = {}
    if "val/rewards/accuracy" in acc.Tags()["scalars"]:
        pref = [e.value for e in acc.Scalars("val/rewards/accuracy")]
        extra = {"pref_start": pref[0], "pref_end": pref[-1]}
    return {"name": name, "start": val[0], "end": val[-1], "steps": steps, "seconds": seconds, **extra}


def main(names: list[str]) -> None:
    print("| config | val/accuracy start | val/accuracy end | optimiser steps | wall time (s) |")
    print("|---|---|---|---|---|")
    for name in names:
        r = run(name)
        note = f" (held-out preference accuracy {r['pref_start']:.2f} -> {r['pref_end']:.2f})" if "pref_start" in r else ""
        print(f"| `configs/{name}.yaml` | {r['start']:.3f} | {r['end']:.3f}{note} | {r['steps']} | {r['seconds']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["sft", "grpo", "gspo", "dapo", "sapo"])
