"""Several multi-process test runs in one launch: every rank runs the same scripts in turn, in one process.

    python tests/ranks.py JOBS.json        (started once per rank by ``rank_jobs.launch_ranks``)

Starting a rank costs seconds (importing torch, Lightning, transformers and the package); a suite that
started two of them for every multi-process check spent most of its time there. Here each rank starts
once, joins one gloo process group, and runs each job of ``JOBS.json`` as ``python SCRIPT ARGS`` would
(``runpy`` with ``sys.argv`` and the job's environment set), so the scripts stay runnable on their own.
Every rank makes the same calls in the same order, so a job that hangs in one rank hangs them all; the
parent (``rank_jobs.launch_ranks``) watches the job that runs and kills the launch when it overruns.

A job is ``{"name", "steps"}``; a step is ``{"script", "args", "env"}`` or ``{"copy": [GLOB, FOLDER]}``
(rank 0 copies the one folder or file GLOB matches into FOLDER, then every rank waits for it). An argument
``glob:PATTERN`` becomes the one path PATTERN matches when the step starts (a checkpoint an earlier step
wrote). Rank 0 writes ``NAME.started`` and ``NAME.done`` beside JOBS.json around each job; a step that
raises ends the launch.
"""

from __future__ import annotations

import glob
import json
import os
import runpy
import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def one_match(pattern: str) -> str:
    matches = glob.glob(pattern)
    if len(matches) != 1:
        raise FileNotFoundError(f"expected one match for {pattern}, found {matches}")
    return matches[0]


def forget_test_modules() -> None:
    """Drop the test scripts imported as modules by an earlier job (a reward function named
    ``fsdp2_fit:reward``): some read their mode from the environment when they are imported."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if path and Path(path).resolve().parent == HERE:
            del sys.modules[name]


def run_script(script: str, args: list[str], env: dict[str, str], forget: bool = True) -> None:
    """``python script *args`` in this process, with ``env`` set for its duration; ``forget``: import the
    test scripts afresh (a rank's runner; not in the pytest process, which holds the test modules)."""
    saved_env = {k: os.environ.get(k) for k in env}
    saved_argv = sys.argv
    os.environ.update(env)
    sys.argv = [script, *[one_match(a[5:]) if a.startswith("glob:") else a for a in args]]
    if forget:
        forget_test_modules()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def copy(pattern: str, dest: str, rank: int) -> None:
    if rank == 0:
        source = one_match(pattern)
        target = os.path.join(dest, os.path.basename(source))
        os.makedirs(dest, exist_ok=True)
        (shutil.copytree if os.path.isdir(source) else shutil.copy)(source, target)


def main() -> None:
    spec = Path(sys.argv[1])
    folder, jobs = spec.parent, json.loads(spec.read_text())
    rank = int(os.environ["RANK"])
    sys.path.insert(0, str(HERE))
    dist.init_process_group("gloo")  # Lightning finds it initialised and keeps it for every job
    # the scripts tear the group down when they end (for their own launches); here it outlives each job
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *a, **k: None
    for job in jobs:
        if rank == 0:
            (folder / f"{job['name']}.started").write_text(repr(time.time()))
        for step in job["steps"]:
            if "copy" in step:
                copy(*step["copy"], rank)
            else:
                print(f"==== {job['name']}: {step['script']} {' '.join(step['args'])}", flush=True)
                run_script(step["script"], step["args"], step.get("env", {}))
            dist.barrier()
        if rank == 0:
            (folder / f"{job['name']}.done").write_text(repr(time.time()))
    destroy()


if __name__ == "__main__":
    main()
