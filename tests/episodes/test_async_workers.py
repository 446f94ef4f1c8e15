"""The asynchronous sampler's worker (``lightning_rl.episodes.async_source`` / ``async_worker``) cannot
deadlock, hang or outlive the run: a process worker runs ``model.sampling.worker_threads`` torch threads
after the learner ran parallel regions; it dies with the learner (and so do the reward workers it forked); a
worker that stalls stops the run with one line naming it, its step and its phase, while a slow step whose
phases report in time does not; SIGTERM while the learner waits for a stalled worker still saves a checkpoint
that resumes; and a thread worker never reseeds the process-global RNG."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from helpers import CONFIGS, ROOT, gone, make, scalars
from test_async_sampling import fit

from lightning_rl.algorithms import GRPO
from lightning_rl.algorithms.sampler_options import SamplingOptions
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.step.engine import HFEngine, seeded

HERE = Path(__file__).resolve().parent
STALL_AT, MARK = "LRL_TEST_STALL_AT", "LRL_TEST_STALL_MARK"  # the reward call that hangs; where it says so
RELEASE = threading.Event()  # ends a hanging reward in a thread worker at the end of its test


def threads_reward(completions, **_):
    """The worker's torch thread count, times 1.0 from parallel regions on that many threads (a 256 x 256
    ``ones @ ones / 256`` stays all ones; the mean of 2**20 ones)."""
    a = torch.ones(256, 256)
    for _ in range(3):
        a = (a @ a) / 256
    ones = float(torch.ones(1 << 20).exp().log().mean())
    return [torch.get_num_threads() * float(a[0, 0]) * ones] * len(completions)


def stall_here() -> None:
    """At call number ``$LRL_TEST_STALL_AT`` (calls counted in ``$LRL_TEST_STALL_MARK.calls``, whatever
    process makes them): write this process's pid and its parent's to ``$LRL_TEST_STALL_MARK``, then hang
    (until ``RELEASE``, at most 600 s)."""
    mark = os.environ.get(MARK)
    if not mark:
        return
    with open(f"{mark}.calls", "a") as f:
        f.write(f"call {os.getpid()} {threading.current_thread().name}\n")
    if len(Path(f"{mark}.calls").read_text().splitlines()) == int(os.environ.get(STALL_AT, "0")):
        Path(mark).write_text(f"{os.getpid()} {os.getppid()}")
        RELEASE.wait(600)


def stalling_reward(completions, **_):
    """Reward 0, through :func:`stall_here`."""
    stall_here()
    return [0.0] * len(completions)


class StallingEngine(HFEngine):
    """Generates through :func:`stall_here`."""

    def generate(self, *args, **kwargs):
        stall_here()
        return super().generate(*args, **kwargs)


def slow_reward(completions, **_):
    time.sleep(0.8)
    return [0.0] * len(completions)


class SlowEngine(HFEngine):
    """Takes 0.8 s more per generation call."""

    def generate(self, *args, **kwargs):
        time.sleep(0.8)
        return super().generate(*args, **kwargs)


class SignalGroupAt(L.Callback):
    """At the start of step ``step`` (before the learner waits for its rollout), send ``signum`` to the
    whole process group, as a batch system does (the worker receives it too)."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.fit_loop.total_batch_idx == self.step:
            os.killpg(os.getpgid(0), self.signum)


class Rewards(RLCallback):
    def __init__(self) -> None:
        self.seen = []

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.seen.append(rollout.rewards.tolist())


def wait_for(path: Path, proc: subprocess.Popen, seconds: float = 240) -> str:
    """The text of ``path`` once written (the run fails the test if it ends first)."""
    end = time.monotonic() + seconds
    while not (path.exists() and path.read_text()):
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before writing {path}"
        assert time.monotonic() < end, f"{path} never written"
        time.sleep(0.1)
    return path.read_text()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_process_worker_runs_its_worker_threads_after_the_learner_ran_parallel_code():
    """The learner ran 2-thread regions before forking (a fork from that thread would hang at step 0):
    the worker's reward sees 2 threads and 2-thread regions finish, so every sample's reward is 2.0."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert threads_reward(["x"]) == [2.0]  # parallel regions in this (the forking) thread
        module = make(GRPO, sampling={"max_staleness": 1, "worker_threads": 2, "worker_timeout": 120},
                      rewards={"functions": ["test_async_workers:threads_reward"]})
        rewards = Rewards()
        fit(module, 2, [rewards])
    finally:
        torch.set_num_threads(before)
    assert rewards.seen and all(r == [2.0] * len(r) for r in rewards.seen), rewards.seen


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("worker", "stalls"), [("process", "reward"), ("thread", "reward"),
                                                ("process", "generation")])
def test_a_stalled_worker_stops_the_run_naming_it_its_step_and_phase(worker, stalls, tmp_path, monkeypatch):
    """The reward or the generation hangs at step 1 (its second call): 1.5 s without progress, then one line
    naming the worker, what it was doing and the step the learner waited for; a process worker is killed."""
    monkeypatch.setenv(STALL_AT, "2")
    monkeypatch.setenv(MARK, str(tmp_path / "mark"))
    RELEASE.clear()
    groups = ({"rewards": {"functions": ["test_async_workers:stalling_reward"]}} if stalls == "reward"
              else {"engine": StallingEngine()})
    module = make(GRPO, sampling={"max_staleness": 1, "worker": worker, "worker_timeout": 1.5}, **groups)
    who = r"process \d+" if worker == "process" else "thread lightning-rl-sampler"
    doing = r"scoring rewards \(or running tools\) for" if stalls == "reward" else "generating"
    try:
        with pytest.raises(RuntimeError, match=(
                rf"^the sampler worker \({who}\) stalled: no progress for \d+\.\d s "
                rf"\(`model.sampling.worker_timeout`: 1.5 s\) while {doing} step 1, as the learner waited "
                r"for step 1's rollout$")) as err:
            fit(module, 4)
    finally:
        RELEASE.set()
    assert module.rollouts.process is None
    pid = int((tmp_path / "mark").read_text().split()[0])
    if worker == "process":
        assert f"process {pid}" in str(err.value) and gone(pid)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slow_step_whose_phases_report_in_time_is_not_a_stall():
    """Generation and rewards take 0.8 s each: every step takes over the 1.5 s limit, each phase under it."""
    module = make(GRPO, engine=SlowEngine(), sampling={"max_staleness": 1, "worker_timeout": 1.5},
                  rewards={"functions": ["test_async_workers:slow_reward"]})
    rewards = Rewards()
    fit(module, 2, [rewards])
    assert len(rewards.seen) == 2


ORPHAN = textwrap.dedent("""
    import sys
    import torch
    torch.set_num_threads(1)
    sys.path[:0] = [{tests!r}, {here!r}]
    from helpers import make
    from lightning_rl.algorithms import GRPO
    from test_async_workers import fit
    module = make(GRPO, sampling={{"max_staleness": 1}}, rewards={{
        "functions": ["test_async_workers:stalling_reward"], "isolate": True}})
    fit(module, 10)
""")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_worker_and_its_reward_workers_die_with_the_learner(tmp_path):
    """A learner (a script) whose sampler is in the middle of an isolated reward call at step 2 is SIGKILLed:
    the sampler process and the reward worker it forked are gone within seconds (neither polls anything
    while the reward runs)."""
    # TMPDIR: the killed learner's temporary folders stay in the test's own
    env = {**os.environ, STALL_AT: "3", MARK: str(tmp_path / "mark"), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path)}
    code = ORPHAN.format(tests=str(ROOT / "tests"), here=str(HERE))
    with open(tmp_path / "stderr", "w") as stderr:  # a pipe would stay open while an orphan holds it
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=stderr)
    try:
        reward_worker, sampler = (int(p) for p in wait_for(tmp_path / "mark", proc).split())
        assert sampler != proc.pid and not gone(sampler) and not gone(reward_worker)
    finally:
        proc.kill()
        proc.wait(60)
    for _ in range(100):
        if gone(sampler) and gone(reward_worker):
            break
        time.sleep(0.1)
    left = [pid for pid in (sampler, reward_worker) if not gone(pid)]
    for pid in left:  # end them here, not at the end of the session
        os.kill(pid, signal.SIGKILL)
    assert left == []


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_while_the_learner_waits_on_a_stalled_worker_checkpoints_and_resumes(tmp_path):
    """The worker hangs in step 2's reward; SIGTERM to the run's process group as step 2 starts (the worker
    ignores it): the learner gives the silent worker ``STOP_PATIENCE`` seconds, drops step 2, saves the
    checkpoint of its start (no rollout ahead, 2 batches consumed) and exits 143, the worker killed. Resumed
    from that checkpoint, the run trains steps 2 and 3, step 2's rollout sampled again with the resumed
    weights (staleness 0)."""
    def overlay(name: str, callbacks: list) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "trainer": {"limit_val_batches": 0, "num_sanity_val_steps": 0, "enable_progress_bar": False,
                        "callbacks": callbacks},
            "model": {"init_args": {"sampling": {"num_generations": 4},
                                    "rewards": {"functions": ["test_async_workers:stalling_reward"]}}},
            "data": {"init_args": {"batch_size": 4}}}))
        return path

    env = {**os.environ, "OMP_NUM_THREADS": "1", STALL_AT: "3", MARK: str(tmp_path / "mark"),
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}

    def cli(name: str, callbacks: list, *extra: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "lightning_rl.cli.main", "fit", "--config", str(CONFIGS / "grpo.yaml"),
                "--config", str(CONFIGS / "async.yaml"), "--config", str(overlay(name, callbacks)),
                "--trainer.max_steps", "4", "--trainer.logger.init_args.save_dir", str(tmp_path / name),
                *extra]
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    signal_at_2 = {"class_path": "test_async_workers.SignalGroupAt",
                   "init_args": {"step": 2, "signum": int(signal.SIGTERM)}}
    # patience after the stop request: min(worker_timeout, STOP_PATIENCE); 5 s keeps the test short, and
    # is far above the time the worker spends in the stalling reward before the signal (one learner step)
    proc = cli("cut", [signal_at_2], "--model.init_args.sampling.worker_timeout", "5")
    try:
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    worker = int((tmp_path / "mark").read_text().split()[0])
    assert re.search(rf"the sampler worker \(process {worker}\) stalled: no progress for \d+\.\d s after a "
                     r"stop request while scoring rewards \(or running tools\) for step 2, as the learner "
                     r"waited for step 2's rollout; step 2 is dropped", err), err[-3000:]
    assert gone(worker)
    (saved,) = (tmp_path / "cut").glob("**/interrupted-step=*.ckpt")
    state = torch.load(saved, weights_only=False)
    assert state["rollouts_ahead"]["rollouts"] == []
    assert state["PromptDataModule"]["batches_consumed"] == 2
    progress = state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert [progress[k] for k in ("ready", "started", "processed", "completed")] == [2, 2, 2, 2]

    env.pop(STALL_AT)
    resumed = cli("resumed", [], "--ckpt_path", str(saved))
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    staleness = scalars(tmp_path / "resumed")["rollout/staleness_max"]
    assert [v for _, v in sorted(staleness)] == [0.0, 1.0]


def test_a_thread_never_reseeds_the_global_rng():
    """transformers' ``generate`` draws from the process-global RNG; a sampler thread would reseed it
    under the learner: refused in one line naming `model.sampling.worker: thread`, the RNG untouched."""
    state, caught = torch.random.get_rng_state(), []

    def sample() -> None:
        try:
            with seeded(7, torch.device("cpu"), global_rng=True):
                pass
        except RuntimeError as err:
            caught.append(str(err))

    thread = threading.Thread(target=sample)
    thread.start()
    thread.join()
    assert len(caught) == 1 and caught[0].startswith("`model.sampling.worker: thread` samples beside the "
                                                     "learner, but transformers' `generate`")
    assert torch.equal(torch.random.get_rng_state(), state)
    with seeded(7, torch.device("cpu"), global_rng=False):  # the compacting sampler's own generator: fine
        pass


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_thread_worker_refuses_transformers_generate():
    module = make(GRPO, sampling={"max_staleness": 1, "worker": "thread", "share_prompt_prefix": False})
    with pytest.raises(RuntimeError, match=r"failed sampling step 0: RuntimeError: `model.sampling.worker: "
                                           r"thread` samples beside the learner"):
        fit(module, 2)


def test_worker_timeout_is_checked_naming_the_key():
    assert SamplingOptions().worker_timeout == 600.0
    assert SamplingOptions(worker_timeout=None).worker_timeout is None
    for bad in (0, -1.0):
        expected = f"`model.sampling.worker_timeout` must be > 0 seconds, or null for no limit, got {bad!r}"
        with pytest.raises(ValueError, match=re.escape(expected)):
            SamplingOptions(worker_timeout=bad)
