"""Every non-timing metric of the shipped configs over their first steps, before and after a change: the
check a refactor promises ("kept exactly").

    .venv/bin/python benchmarks/same_metrics.py REF [--steps 10] [--configs grpo ppo ... grpo+objectives/dppo]

Checks ``REF`` (a commit) out in a temporary worktree, runs ``lightning-rl fit`` on each config there and in
this checkout (``--trainer.max_steps``, validation every ``steps // 2`` steps on one batch, no checkpoint),
one torch thread each, and compares every scalar both logged that is not a timing (``perf/*``, ``*time*``):
step by step, exactly. Prints one line per config and exits 1 when any differs. A name ``a+b`` runs
``configs/a.yaml`` with ``configs/b.yaml`` over it. The old checkout's ``data`` and ``callbacks`` folders are
linked into its package, so it imports as itself without being installed.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["grpo", "gspo", "dapo", "sapo", "rloo", "reinforce_pp", "ppo", "dpo", "distill", "grpo_tools",
           "grpo_lora", "grpo+async"]


def run(repo: Path, config: str, out: Path, steps: int) -> dict[str, list[tuple[int, float]]]:
    files = [a for name in config.split("+") for a in ("--config", str(repo / "configs" / f"{name}.yaml"))]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "LRL_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lightning_rl.cli.main", "fit", *files,
               "--trainer.max_steps", str(steps), "--trainer.val_check_interval", str(max(steps // 2, 1)),
               "--trainer.limit_val_batches", "1",
               "--trainer.num_sanity_val_steps", "0", "--trainer.enable_checkpointing", "false",
               "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(out)]
    done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{config} at {repo} failed:\n{done.stderr[-3000:]}")
    (events,) = glob.glob(f"{out}/**/events.out.tfevents.*", recursive=True)
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    return {k: [(e.step, e.value) for e in acc.Scalars(k)] for k in acc.Tags()["scalars"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ref")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--configs", nargs="+", default=CONFIGS)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="same-metrics-"))
    old = work / "old"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(old), args.ref], cwd=ROOT, check=True)
    try:
        for plugin in ("data", "callbacks"):
            (old / "lightning_rl" / plugin).symlink_to(old / plugin)
        differ = 0
        for config in args.configs:
            runs = []
            for side, repo in (("old", old), ("new", ROOT)):
                (work / f"{side}-{config.replace('/', '_')}").mkdir()
                runs.append(run(repo, config, work / f"{side}-{config.replace('/', '_')}", args.steps))
            before, after = runs
            timing = [k for k in {*before, *after} if k.startswith("perf/") or "time" in k]
            both = sorted(k for k in before if k in after and k not in timing)
            changed = [k for k in both if before[k] != after[k]]
            differ += bool(changed)
            print(f"{config}: {len(both)} non-timing metrics in both, {len(changed)} differ {changed[:5]}; "
                  f"only before: {sorted(set(before) - set(after) - set(timing))}; "
                  f"only after: {sorted(set(after) - set(before) - set(timing))}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
        shutil.rmtree(work, ignore_errors=True)  # both sides' runs
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
