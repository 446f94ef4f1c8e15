"""SIGTERM / SIGINT to every rank of a 2-rank DDP or FSDP2 run through the real CLI
(``tests/signals_fit.py``): one checkpoint, exit 143 / 130 within 30 s, a second signal stops at once, and
``--ckpt_path last`` resumes the checkpoint (a file under DDP, a distributed checkpoint folder under FSDP2)
exactly where an uninterrupted run would be. The FSDP2 runs use ``configs/strategy/fsdp2.yaml`` with only
``--trainer.devices 2`` (the overlay shards over every rank without a number).

Each run has its own session and is killed as a group after a hard timeout: with Lightning's SIGTERM handler
(a ``broadcast`` inside the handler, the signal re-sent to rank 1), rank 1 handled SIGTERM twice and both
ranks hung in mismatched collectives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, scalars
from rank_jobs import kill, start_ranks

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "signals_fit.py"


def run(out: Path, strategy: str, steps: int, *overrides: str, signal_spec: str | None = None,
        fail: str | None = None, timeout: int = 200) -> tuple[int, str, float]:
    """``signals_fit.py`` started once, Lightning's launcher starting rank 1 (as ``lightning-rl fit
    --trainer.devices 2`` does); returns its exit status, its output and when it ended (``time.time()``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LRL_NUM_THREADS": "1"}
    for key, value in (("SIGNAL", signal_spec), ("FAIL", fail)):
        env.pop(key, None)
        if value:
            env[key] = value
    argv = [sys.executable, str(SCRIPT), str(out), strategy, str(steps), *overrides]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"signals_fit.py {strategy} {steps} {signal_spec} hung (killed after {timeout}s):\n"
                    f"{log.decode(errors='replace')[-3000:]}")
    return proc.returncode, log.decode(errors="replace"), time.time()


def run_ranks(out: Path, strategy: str, steps: int, *overrides: str, timeout: int = 200) -> tuple[int, str]:
    """``signals_fit.py`` on both ranks started at once (the ranks' environment set, as torchrun or SLURM
    do: their start-up overlaps), each in its own session, killed after ``timeout``; the worst exit status
    and rank 0's output followed by rank 1's."""
    argv = [sys.executable, str(SCRIPT), str(out), strategy, str(steps), *overrides]
    logs = [out.parent / f"{out.name}.rank{r}.log" for r in range(2)]
    procs = start_ranks(argv, logs, env={"LRL_NUM_THREADS": "1", "SIGNAL": "", "FAIL": ""})
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        kill(procs)
        pytest.fail(f"signals_fit.py {strategy} {steps} {overrides} hung (killed after {timeout}s)")
    return max(codes, key=abs), "".join(log.read_text(errors="replace") for log in logs)


def logged_after(folder: Path, step: int) -> dict[str, list[tuple[int, float]]]:
    """Every logged scalar past ``step`` except timings, which differ between runs."""
    return {key: [(s, v) for s, v in values if s > step] for key, values in scalars(folder).items()
            if not key.startswith("perf/")}


@pytest.mark.ranks("ddp/signals-reference", "fsdp2/signals-reference")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_sigterm_to_every_rank_saves_one_checkpoint_that_resumes_exactly(tmp_path, strategy, rank_jobs):
    runs = tmp_path / "runs"
    code, log, ended = run(runs, strategy, 4, signal_spec="SIGTERM:2")
    sent = float((runs / "signal-sent").read_text())
    assert code == 143, log[-3000:]
    assert ended - sent < 30, ended - sent
    checkpoints = runs / "lightning-rl" / "version_0" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["interrupted-step=2.ckpt"]
    assert (checkpoints / "interrupted-step=2.ckpt").is_dir() == (strategy == "fsdp2")
    assert log.count("checkpoint saved to") == 1

    code, log = run_ranks(runs, strategy, 4, "--ckpt_path", "last")
    assert code == 0, log[-3000:]
    assert f"resuming from {checkpoints / 'interrupted-step=2.ckpt'}" in log
    resumed = logged_after(runs / "lightning-rl" / "version_1", 2)
    full = logged_after(rank_jobs.out(f"{strategy}/signals-reference"), 2)  # the same 4 steps, uninterrupted
    assert [s for s, _ in full["policy/loss"]] == [3, 4]
    assert len(full) > 15 and resumed == full


def test_a_second_sigint_stops_every_rank_at_once(tmp_path):
    code, log, ended = run(tmp_path, "ddp", 4, signal_spec="SIGINT:2:twice")
    sent = float((tmp_path / "signal-sent").read_text())
    assert code == 130, log[-3000:]
    assert ended - sent < 10, ended - sent
    assert "SIGINT: saving a checkpoint at the end of this step" in log
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_reward_failing_on_one_rank_is_the_last_line(tmp_path):
    """Rank 1's reward raises; rank 0, waiting for it in a collective, fails with gloo's "Connection closed
    by peer". The run's last line is rank 1's reason, after both ranks' tracebacks."""
    code, log, _ = run(tmp_path, "ddp", 4, fail="1:2")
    assert code != 0
    last = log.strip().splitlines()[-1]
    assert last.startswith("lightning-rl: error: rank 1 failed: "), log[-3000:]
    assert "the reward service is down on rank 1" in last and "signals_fit:slow_reward" in last
