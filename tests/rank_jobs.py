"""Every multi-process run of the suite, by name, and the one launch that runs those a session needs.

A test marked ``@pytest.mark.ranks("fsdp2/grpo")`` (and ``distributed``) asks the session fixture
``rank_jobs`` (tests/conftest.py) for that run's folder. The fixture collects the names of every selected
test, starts the two ranks once (``tests/ranks.py``) and runs those jobs in the order of ``JOBS``; each test
then reads its own job's files, and a job that failed or hung fails the tests that read it, with the log.

In a step, ``{out}`` is the job's own folder. Runs that check launchers, signals or a rank failing on its
own (tests/cli/test_multinode.py, tests/cli/test_signals.py) start their processes themselves.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def run(script: str, *args: str, **env: str) -> dict:
    return {"script": str(HERE / script), "args": list(args), "env": env}


def copy(pattern: str, folder: str) -> dict:
    return {"copy": [pattern, folder]}


def resume(strategy: str) -> list[dict]:
    """GRPO 4 steps with a sharded checkpoint every 2; the step-2 checkpoint alone in a new folder; 2 more
    steps from it, found there as `--ckpt_path last` finds it."""
    return [run("fsdp2_fit.py", "{out}/full", "resume", "4", STRATEGY=strategy),
            copy("{out}/full/ckpt/*step=2.ckpt", "{out}/resumed/ckpt"),
            run("fsdp2_fit.py", "{out}/resumed", "resume", "4", "last", STRATEGY=strategy)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PREDICT_ROWS = [("44935=", "34459"), ("80684=", "04688"), ("32205=", "02235"), ("71148=", "11478"),
                ("90217=", "01279")]
PREDICT_PROMPTS = "".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in PREDICT_ROWS)

JOBS: dict[str, list[dict]] = {
    # gradient and update equality with one process (the single-process side runs in the test process)
    "ddp/update": [run("ddp_update.py", "{out}/result.pt", "2", "3")],
    "fsdp2/update-strided": [run("fsdp2_update.py", "{out}/result.pt", "2", "3", "strided")],
    "fsdp2/update-rank0": [run("fsdp2_update.py", "{out}/result.pt", "2", "none", "rank0")],
    "zero2/update-strided": [run("deepspeed_update.py", "{out}/result.pt", "2", "2", "3", "strided")],
    "zero3/update-strided": [run("deepspeed_update.py", "{out}/result.pt", "2", "3", "3", "strided")],
    "zero3/update-rank0": [run("deepspeed_update.py", "{out}/result.pt", "2", "3", "3", "rank0")],
    "ppo/ddp": [run("ppo_update.py", "{out}/result.pt", "2", "ddp", "3")],
    "ppo/fsdp2": [run("ppo_update.py", "{out}/result.pt", "2", "fsdp2", "3")],
    # fits: validation on uneven ranks, exports, resumes
    "ddp/validate": [run("ddp_validate.py", "{out}/result.json", "2")],
    "ddp/predict": [run("ddp_predict.py", "{out}/heldout.jsonl", "{out}", "2")],
    "ddp/starve": [run("ddp_collectives.py", "{out}/run", "2", "2", COLLECTIVES_MODE="starve")],
    "ddp/partial-resume": [
        run("ddp_collectives.py", "{out}/full", "2", "4", COLLECTIVES_MODE="partial"),
        run("ddp_collectives.py", "{out}/resumed", "2", "4", "glob:{out}/full.ckpt/*step=2.ckpt",
            COLLECTIVES_MODE="partial")],
    "ddp/dpo-metrics": [run("ddp_collectives.py", "{out}/run", "2", "2", COLLECTIVES_MODE="dpo")],
    "ddp/episodes": [run("episodes_fit.py", "{out}", "ddp")],
    "ddp/distill": [run("episodes_fit.py", "{out}", "ddp", "distill")],
    "ddp/engine": [run("engine_sync.py", "{out}", "ddp")],
    "ddp/lora": [run("fsdp2_fit.py", "{out}", "lora", "3", STRATEGY="ddp")],
    "ddp/async-resume": [run("async_fit.py", "{out}/full", "ddp", "2"),
                         copy("{out}/full/ckpt/*step=2.ckpt", "{out}/resumed/ckpt"),
                         run("async_fit.py", "{out}/resumed", "ddp",
                             "glob:{out}/resumed/ckpt/*step=2.ckpt")],
    "fsdp2/async-resume": [run("async_fit.py", "{out}/full", "fsdp2", "2"),
                           copy("{out}/full/ckpt/*step=2.ckpt", "{out}/resumed/ckpt"),
                           run("async_fit.py", "{out}/resumed", "fsdp2",
                               "glob:{out}/resumed/ckpt/*step=2.ckpt")],
    "fsdp2/grpo": [run("fsdp2_fit.py", "{out}")],
    "fsdp2/dapo": [run("fsdp2_fit.py", "{out}", "dapo", "3")],
    "fsdp2/dapo-kl": [run("fsdp2_fit.py", "{out}", "dapo_kl", "4")],
    "fsdp2/dpo": [run("fsdp2_fit.py", "{out}", "dpo", "3")],
    "fsdp2/resume": resume("fsdp2"),
    "fsdp2/episodes": [run("episodes_fit.py", "{out}", "fsdp2")],
    "fsdp2/distill": [run("episodes_fit.py", "{out}", "fsdp2", "distill")],
    "fsdp2/engine": [run("engine_sync.py", "{out}", "fsdp2", "float16")],  # ddp/engine: bfloat16
    "fsdp2/lora": [run("fsdp2_fit.py", "{out}", "lora", "3", STRATEGY="fsdp2")],
    "zero3/dapo": [run("fsdp2_fit.py", "{out}", "dapo", "3", STRATEGY="zero3")],
    # 1 node x 2 processes, what tests/cli/test_multinode.py's two-node launches must equal
    "ddp/multinode-reference": [run("multinode_fit.py", "{out}", "--trainer.devices", "2")],
    # the uninterrupted runs that tests/cli/test_signals.py compares its interrupted-and-resumed runs with
    "ddp/signals-reference": [run("signals_fit.py", "{out}", "ddp", "4")],
    "fsdp2/signals-reference": [run("signals_fit.py", "{out}", "fsdp2", "4")],
    "zero3/resume": resume("zero3"),
    # vLLM last: these start engines (tests/vllm_fit.py)
    "fsdp2/vllm": [run("vllm_fit.py", "{out}", "fsdp2")],
    "ddp/vllm-server": [run("vllm_fit.py", "{out}", "ddp-server", VLLM_PORT=str(free_port()))],
}
# jobs of one process (which starts processes of its own), run after the ranks' jobs: on the core the
# single-process tests leave free by then. A step is ``python tests/SCRIPT ARGS``.
SOLO: dict[str, list[dict]] = {
    "vllm/stops": [run("vllm_stops.py", "{out}")],  # runs stopped by signals, a killed worker, a dead server
}
SOLO_TIMEOUT = 600  # seconds one solo job may run
# files a job reads, written before the launch
FILES: dict[str, dict[str, str]] = {"ddp/predict": {"heldout.jsonl": PREDICT_PROMPTS}}
JOB_TIMEOUT = 300  # seconds one job may run before the launch is killed (the longest takes ~40 s)


def folder_name(name: str) -> str:
    return name.replace("/", "-")


def expand(step: dict, out: Path) -> dict:
    fill = lambda s: s.replace("{out}", str(out))  # noqa: E731
    if "copy" in step:
        return {"copy": [fill(s) for s in step["copy"]]}
    return {**step, "args": [fill(a) for a in step["args"]]}


def start_ranks(argv: list[str], logs: list[Path], env: dict[str, str] | None = None
                ) -> list[subprocess.Popen]:
    """``argv`` once per rank (``len(logs)`` gloo ranks), all started at once with the ranks' environment set
    (as torchrun or SLURM set it; Lightning then starts no process of its own), each in its own session,
    writing to its log."""
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(len(logs)), "NODE_RANK": "0", **(env or {})}
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(argv, cwd=HERE.parent, env={**base, "RANK": str(rank),
                                                                       "LOCAL_RANK": str(rank)},
                                          stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every process group still running (a hung gloo rank ignores SIGTERM)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)


def launch_ranks(names: list[str], folder: Path, world: int = 2) -> None:
    """Run the jobs ``names`` (in ``JOBS`` order) on ``world`` gloo ranks started at once, each in its own
    session; kill every rank when one job runs past ``JOB_TIMEOUT`` (a hung gloo rank ignores SIGTERM)."""
    jobs = []
    for name in sorted(set(names), key=list(JOBS).index):
        out = folder / folder_name(name)
        out.mkdir(parents=True, exist_ok=True)
        for file, text in FILES.get(name, {}).items():
            (out / file).write_text(text)
        jobs.append({"name": folder_name(name), "steps": [expand(s, out) for s in JOBS[name]]})
    spec = folder / "jobs.json"
    spec.write_text(json.dumps(jobs, indent=1))
    procs = start_ranks([sys.executable, str(HERE / "ranks.py"), str(spec)],
                        [folder / f"rank{r}.log" for r in range(world)])
    while any(p.poll() is None for p in procs):
        running = [j["name"] for j in jobs if (folder / f"{j['name']}.started").exists()
                   and not (folder / f"{j['name']}.done").exists()]
        started = (folder / f"{running[-1]}.started") if running else spec
        if time.time() - started.stat().st_mtime > JOB_TIMEOUT:
            (folder / "hung").write_text(running[-1] if running else "(start)")
            kill(procs)
        time.sleep(0.2)


def run_solo(name: str, folder: Path) -> None:
    """Run solo job ``name``'s steps one after another as subprocesses in a session of their own, each
    killed past ``SOLO_TIMEOUT``; ``<name>.done`` once all of them exited with status 0."""
    out = folder / folder_name(name)
    out.mkdir(parents=True, exist_ok=True)
    (folder / f"{folder_name(name)}.started").write_text(repr(time.time()))
    with open(folder / f"{folder_name(name)}.log", "w") as log:
        for step in SOLO[name]:
            step = expand(step, out)
            env = {**os.environ, "OMP_NUM_THREADS": "1", "LRL_NUM_THREADS": "1", **step["env"]}
            proc = subprocess.Popen([sys.executable, step["script"], *step["args"]], stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=HERE.parent,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=SOLO_TIMEOUT)
            except subprocess.TimeoutExpired:
                kill([proc])
                (folder / "hung").write_text(name)
                return
            if code != 0:
                return
    (folder / f"{folder_name(name)}.done").write_text(repr(time.time()))


def launch(names: list[str], folder: Path) -> None:
    """The ranks' jobs among ``names``, then the solo ones."""
    ranked = [n for n in names if n in JOBS]
    if ranked:
        launch_ranks(ranked, folder)
    for name in names:
        if name in SOLO:
            run_solo(name, folder)


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


class RankJobs:
    """The folders of one launch's jobs; ``out(name)`` fails the calling test unless its job completed.

    ``start()`` runs the launch in a background thread (the session starts it when collection ends, so the
    two ranks overlap the single-process tests that come first); ``out`` waits for it.
    """

    def __init__(self, folder: Path, names: list[str]) -> None:
        self.folder, self.names = folder, names
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.thread is None and self.names:
            self.thread = threading.Thread(target=launch, args=(self.names, self.folder), daemon=True)
            self.thread.start()

    def out(self, name: str) -> Path:
        """Job ``name``'s folder once it completed (waiting for it alone, not for the whole launch)."""
        if name not in self.names:
            pytest.fail(f"job {name!r} is not in this session's launch: mark the test ranks({name!r})")
        self.start()
        done = self.folder / f"{folder_name(name)}.done"
        while not done.exists() and self.thread.is_alive():
            time.sleep(0.2)
        if not done.exists():
            hung = self.folder / "hung"
            why = (f"hung in job {hung.read_text()} (killed after its timeout)" if hung.exists()
                   else "failed")
            logs = "\n".join(f"---- {log.name}\n" + tail(log) for log in
                             [*(self.folder / f"rank{r}.log" for r in range(2)),
                              self.folder / f"{folder_name(name)}.log"] if log.exists())
            pytest.fail(f"job {name} did not complete: the launch {why}\n{logs}")
        return self.folder / folder_name(name)


def run_here(script: str, *args: str, **env: str) -> None:
    """``python tests/<script> args...`` in this process (a single-process reference run)."""
    from ranks import run_script

    run_script(str(HERE / script), [str(a) for a in args], env, forget=False)
