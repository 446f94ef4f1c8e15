"""The tool-use task's figures (README, "Multi-turn episodes"): held-out accuracy on 256 multiplications of
2-3 digit numbers without the tool, with the tool before RL, and after multi-turn GRPO.

    OMP_NUM_THREADS=1 LRL_NUM_THREADS=1 python benchmarks/tools_task.py [--ceiling] [--out DIR]

Every row is the real CLI on the shipped configs (greedy ``val/accuracy``, exact match of the final answer):

* ``builtin:tiny-tools`` without tools: ``configs/grpo_tools.yaml`` with ``model.episodes.tools: null`` (one
  turn);
* with the calculator, before RL: ``lightning-rl validate --config configs/grpo_tools.yaml``;
* after multi-turn GRPO: ``lightning-rl fit --config configs/grpo_tools.yaml`` (its last validation);
* ``--ceiling``: the no-tool ceiling, the same SFT as ``builtin:tiny-tools`` on direct answers (``A*B=`` ->
  product) for 4x its steps (``configs/sft_tools.yaml`` with ``data.task: multiply``, 1040 steps; ~15 min).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "lightning_rl.cli.main"]
ACCURACY = re.compile(r"step (\d+): val/accuracy = ([0-9.]+)")


def run(*args: str, out: Path) -> tuple[list[tuple[int, float]], float]:
    """One CLI call; its printed ``val/accuracy`` lines and wall time."""
    start = time.perf_counter()
    cmd = [*CLI, *args, "--trainer.enable_progress_bar", "false",
           "--trainer.logger.init_args.save_dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    found = [(int(s), float(a)) for s, a in ACCURACY.findall(proc.stdout + proc.stderr)]
    return found, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ceiling", action="store_true",
                        help="also train the no-tool SFT ceiling (~15 min)")
    parser.add_argument("--out", type=Path, default=None, help="run folders (default: a temporary folder)")
    opts = parser.parse_args()
    out = opts.out or Path(tempfile.mkdtemp(prefix="tools_task_"))
    config = "configs/grpo_tools.yaml"
    rows = []
    curve, seconds = run("validate", "--config", config, "--model.init_args.episodes.tools", "null",
                         "--model.init_args.episodes.max_episode_tokens", "null",
                         out=out / "no_tool")
    rows.append(("builtin:tiny-tools, no tool (one turn)", curve[-1][1], seconds))
    curve, seconds = run("validate", "--config", config, out=out / "tool")
    rows.append(("builtin:tiny-tools with the calculator, before RL", curve[-1][1], seconds))
    curve, seconds = run("fit", "--config", config, out=out / "grpo")
    steps = ", ".join(f"{a:.3f}@{s}" for s, a in curve)
    rows.append((f"after multi-turn GRPO ({steps})", curve[-1][1], seconds))
    if opts.ceiling:
        curve, seconds = run("fit", "--config", "configs/sft_tools.yaml", "--data.init_args.task", "multiply",
                             "--trainer.max_steps", "1040", "--trainer.val_check_interval", "520",
                             out=out / "ceiling")
        name = "no-tool ceiling: SFT on direct answers, 4x the warm start's steps"
        rows.append((name, curve[-1][1], seconds))
    print("| model | held-out accuracy | wall time (s) |\n|---|---|---|")
    for name, accuracy, seconds in rows:
        print(f"| {name} | {accuracy:.3f} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
