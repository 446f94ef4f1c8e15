"""Runs with a vLLM engine that are stopped from outside, through `lightning-rl fit` subprocesses, each in a
session of its own; what each left behind is counted the moment it ends.

    python tests/vllm_stops.py OUT_DIR

* ``sigint`` / ``sigterm``: GRPO + configs/vllm.yaml + configs/async.yaml (a forked worker with its own
  engine), Ctrl-C (or a scheduler's SIGTERM) to the run's whole process group at step 2, engines included.
* ``kill-worker``: the same run; at step 2 the worker, which started the engine, is SIGKILLed.
* ``server-death``: GRPO + configs/vllm_server.yaml with a checkpoint every step; at step 2 the server's own
  process is SIGKILLed.

The first three start at once, the last after them. ``OUT_DIR/result.json``: per run, the exit status, the
last line of stderr, the checkpoints, the logged staleness, and the vLLM processes still alive 30 s after
it ended (its own engines: ``LIGHTNING_RL_VLLM_OWNER`` is the trainer's or its worker's pid; a server's
whole session). The callbacks below are what the runs' YAML names (``vllm_stops.GroupSignalAt``...).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import yaml

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "configs"


class GroupSignalAt(L.Callback):
    """At optimiser step ``step``: write the worker's pid to ``record``, then send ``signum`` to the whole
    process group (as Ctrl-C or a batch system does)."""

    def __init__(self, step: int, signum: int, record: str) -> None:
        self.step, self.signum, self.record = step, signum, record

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            Path(self.record).write_text(str(pl_module.rollouts.process.pid))
            os.killpg(0, self.signum)


class KillWorkerAt(GroupSignalAt):
    """At ``step``, SIGKILL the sampler worker (the process that started the engine)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            pid = pl_module.rollouts.process.pid
            Path(self.record).write_text(str(pid))
            os.kill(pid, signal.SIGKILL)


class KillServerAt(GroupSignalAt):
    """At ``step``, SIGKILL the vLLM server's own process (its engine is left to the run to stop)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        backend = pl_module.engine.backend
        if trainer.global_step == self.step and backend is not None:
            Path(self.record).write_text(str(backend.process.pid))
            backend.process.kill()
            backend.process.wait()


def processes(test) -> list[int]:
    """Pids of the processes for which ``test(environ: bytes, stat: str)`` holds."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ, stat = (entry / "environ").read_bytes(), (entry / "stat").read_text()
        except OSError:
            continue
        if test(environ, stat):
            found.append(int(entry.name))
    return found


def left(owners: list[int], group: int | None, seconds: float = 30.0) -> list[int]:
    """The processes started under ``owners`` (or in session ``group``) still alive after ``seconds``."""
    marks = [f"LIGHTNING_RL_VLLM_OWNER={o}\0".encode() for o in owners]

    def ours(environ: bytes, stat: str) -> bool:
        in_group = group is not None and int(stat.rsplit(")", 1)[1].split()[2]) == group
        return in_group or any(mark in environ for mark in marks)

    deadline = time.monotonic() + seconds
    while (alive := processes(ours)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


RUNS = {
    "sigint": (["grpo", "vllm", "async"], "GroupSignalAt", signal.SIGINT),
    "sigterm": (["grpo", "vllm", "async"], "GroupSignalAt", signal.SIGTERM),
    "kill-worker": (["grpo", "vllm", "async"], "KillWorkerAt", 0),
    "server-death": (["grpo", "vllm_server"], "KillServerAt", 0),
}


def start(name: str, out: Path) -> tuple[subprocess.Popen, Path]:
    configs, callback, signum = RUNS[name]
    folder = out / name
    folder.mkdir(parents=True)
    record = folder / "pid"
    callbacks = [{"class_path": f"vllm_stops.{callback}",
                  "init_args": {"step": 2, "signum": int(signum), "record": str(record)}}]
    if name == "server-death":
        callbacks.insert(0, {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                             "init_args": {"dirpath": str(folder / "ckpt"), "every_n_train_steps": 1,
                                           "save_top_k": -1}})
    overlay = folder / "overlay.yaml"
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    argv = [sys.executable, "-m", "lightning_rl.cli.main", "fit"]
    for config in configs:
        argv += ["--config", str(CONFIGS / f"{config}.yaml")]
    argv += ["--config", str(overlay), "--trainer.max_steps", "8", "--trainer.limit_val_batches", "0",
             "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "1",
             "--data.init_args.batch_size", "4", "--trainer.logger.init_args.save_dir", str(folder / "runs")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv, cwd=HERE.parent, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(folder / "stderr.log", "w"), start_new_session=True)
    return proc, folder


def finish(name: str, proc: subprocess.Popen, folder: Path) -> dict:
    code = proc.wait(timeout=400)
    stderr = (folder / "stderr.log").read_text(errors="replace").strip().splitlines()
    record = folder / "pid"
    other = int(record.read_text()) if record.exists() else None
    if name == "server-death":
        alive = left([proc.pid], other)
    else:
        alive = left([proc.pid] + ([other] if other else []), None)
    checkpoints = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.ckpt"))
    staleness = []
    for events in folder.rglob("events.out.tfevents.*"):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if "rollout/staleness_max" in acc.Tags()["scalars"]:
            staleness = [e.value for e in acc.Scalars("rollout/staleness_max")]
    # Python's multiprocessing resource tracker may warn, after the run's own last line, about vLLM's shared
    # memory when vLLM's worker left under load without unlinking it (the tracker unlinks it): not ours
    ours = [line for line in stderr if "resource_tracker" not in line]
    return {"code": code, "last": ours[-1] if ours else "", "stderr": "\n".join(stderr[-30:]),
            "checkpoints": checkpoints, "staleness": staleness, "left": alive, "pid": proc.pid,
            "other": other}


def main() -> None:
    out = Path(sys.argv[1])
    result = {}
    first = {name: start(name, out) for name in ("sigint", "sigterm", "kill-worker")}
    for name, (proc, folder) in first.items():
        result[name] = finish(name, proc, folder)
    result["server-death"] = finish("server-death", *start("server-death", out))
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
