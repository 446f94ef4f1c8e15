"""Asynchronous sampling (``model.sampling.max_staleness``): a worker process samples ahead of the learner
with a fixed lag, each rollout labelled with the weight version that sampled it; slow samplers and slow
learners alike keep staleness at exactly ``k`` and discard nothing; a failing or killed worker stops the
run naming why; a resumed run trains on exactly what the uninterrupted one did, and the reward sees every
prompt once."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from async_fit import LR, MOMENTUM
from helpers import CONFIGS, ROOT, datamodule, make, run_cli, scalars

from lightning_rl.algorithms import GRPO
from lightning_rl.callbacks.base import RLCallback
from lightning_rl.models.generation import make_generation
from lightning_rl.step.engine import CopyEngine, HFEngine

pytestmark = pytest.mark.slow
PROMPT_LOG = "LRL_TEST_PROMPT_LOG"
SLOW_REWARD = "LRL_TEST_SLOW_REWARD"


def logged_reward(prompts, completions, **_):
    """Reward 0; appends every prompt it scores to the file named by ``$LRL_TEST_PROMPT_LOG`` (the worker
    is another process) and sleeps ``$LRL_TEST_SLOW_REWARD`` seconds (a slow sampler)."""
    time.sleep(float(os.environ.get(SLOW_REWARD, "0")))
    path = os.environ.get(PROMPT_LOG)
    if path:
        with open(path, "a") as f:
            f.writelines(f"{p}\n" for p in prompts)
    return [0.0] * len(completions)


def failing_reward(prompts, completions, **_):
    raise ZeroDivisionError("the reward of this test always fails")


class Versions(RLCallback):
    """Each step's trainer step, its rollout's versions and its first completion token."""

    def __init__(self, pause: float = 0.0) -> None:
        self.seen, self.pause = [], pause

    def on_rollout_end(self, trainer, pl_module, rollout):
        step = trainer.fit_loop.total_batch_idx
        self.seen.append((step, rollout.versions.tolist(), rollout.completion_ids[:, 0].tolist()))
        time.sleep(self.pause)  # a slow learner


class StampVersion(L.Callback):
    """Before each step publishes its weights, write the step number into one trained weight (the
    optimiser's learning rate is 0, so nothing else changes it)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        with torch.no_grad():
            first_weight(pl_module).view(-1)[0] = float(trainer.fit_loop.total_batch_idx + 1)


def first_weight(module) -> torch.Tensor:
    """The model's first parameter (trained in the learner; frozen in a thread worker's copy)."""
    return next(iter(module.policy.model.parameters()))


class StampingEngine(HFEngine):
    """Generates two tokens that name the weight it samples with: token ``STAMPS[w]`` where ``w`` is the
    value :class:`StampVersion` wrote (so the rollout shows which weights sampled it)."""

    STAMPS = list(range(10, 30))

    def generate(self, prompt_ids, prompt_mask, *, num_samples=1, sampling, seed=None):
        stamp = self.STAMPS[int(first_weight(self).view(-1)[0])]
        ids = prompt_ids.repeat_interleave(num_samples, 0)
        mask = prompt_mask.repeat_interleave(num_samples, 0)
        completion = torch.full((len(ids), 2), stamp, dtype=torch.long)
        gen = make_generation(ids, mask, completion, self.policy.eos_token_id, self.policy.pad_token_id)
        gen.rollout_logp = torch.zeros(completion.shape)
        return gen


def fit(module, steps: int, callbacks=()) -> L.Trainer:
    """``steps`` steps of ``module``; its exported policy goes to a temporary folder, not the working one."""
    with tempfile.TemporaryDirectory(prefix="lrl-async-fit-") as root:
        trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, limit_val_batches=0, accelerator="cpu",
                            callbacks=list(callbacks), default_root_dir=root)
        trainer.fit(module, datamodule=datamodule())
    return trainer


@pytest.mark.parametrize(("lag", "worker"), [(1, "process"), (2, "thread")])
def test_each_rollout_is_labelled_with_the_weights_that_sampled_it(lag, worker):
    """The worker (a process, or a thread with its own copy of the weights) binds version max(0, t - k) for
    step t: the stamped token proves which weights sampled, and the recorded versions agree."""
    module = make(GRPO, sampling={"max_staleness": lag, "worker": worker}, engine=StampingEngine(),
                  optimizer=partial(torch.optim.SGD, lr=0.0))
    versions = Versions()
    fit(module, 6, [StampVersion(), versions])
    assert [s for s, *_ in versions.seen] == list(range(6))
    for step, labels, stamps in versions.seen:
        expected = max(0, step - lag)
        assert set(labels) == {expected}, (step, labels)
        # version v is the weights step v published, which StampVersion had set to v + 1
        assert set(stamps) == {StampingEngine.STAMPS[expected + 1]}, (step, stamps)


@pytest.mark.parametrize(("slow", "worker"), [("sampler", "process"), ("learner", "process"),
                                             ("sampler", "thread")])
def test_staleness_is_exactly_the_lag_and_nothing_is_discarded(slow, worker, tmp_path, monkeypatch):
    """A slow sampler (its reward sleeps) or a slow learner (its steps sleep): either way step t trains on
    the rollout of its own batch sampled with version max(0, t - 1), and the reward scored each step's
    batch once, plus at most the lag's batches sampled ahead when the run ended."""
    log = tmp_path / "prompts.txt"
    monkeypatch.setenv(PROMPT_LOG, str(log))
    monkeypatch.setenv(SLOW_REWARD, "0.2" if slow == "sampler" else "0")
    module = make(GRPO, sampling={"max_staleness": 1, "worker": worker},
                  rewards={"functions": ["test_async_sampling:logged_reward"]})
    versions = Versions(pause=0.2 if slow == "learner" else 0.0)
    trainer = fit(module, 5, [versions])
    assert [(s, set(v)) for s, v, _ in versions.seen] == [(t, {max(0, t - 1)}) for t in range(5)]
    assert trainer.callback_metrics["rollout/staleness_max"] == 1.0
    scored = log.read_text().splitlines()
    stream = datamodule()
    stream.setup("fit")
    batches = stream.train_batches(0)
    expected = [p for _ in range(6) for p in next(batches)["prompt"] for _ in range(4)]  # 5 steps + 1 ahead
    assert scored[: 5 * 16] == expected[: 5 * 16] and len(scored) in (5 * 16, 6 * 16)
    assert module.rollouts.process is None  # the worker stopped with the run


def test_the_gradient_does_not_depend_on_the_micro_batch_size_when_sampling_ahead():
    """With the learning rate at 0 the weights never move, so every version samples alike: the learner's
    gradient (its norm and the loss, per step) is the same whole or in micro-batches of 3, with the
    worker's gap corrected in the loss."""
    logged = {}
    for micro in (None, 3):
        module = make(GRPO, sampling={"max_staleness": 1}, update={"micro_batch_size": micro},
                      optimizer=partial(torch.optim.SGD, lr=0.0))
        norms = Norms()
        fit(module, 3, [norms])
        logged[micro] = norms.seen
    assert len(logged[None]) == 3 and all(norm > 1e-4 for norm, _ in logged[None])
    flat = {micro: [x for pair in seen for x in pair] for micro, seen in logged.items()}
    assert flat[3] == pytest.approx(flat[None], rel=1e-4, abs=1e-6)


class Norms(L.Callback):
    """Each step's logged ``policy/grad_norm`` and ``policy/loss``."""

    def __init__(self) -> None:
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.seen.append((float(metrics["policy/grad_norm"]), float(metrics["policy/loss"])))


class Rollouts(RLCallback):
    """Every rollout the step trains on."""

    def __init__(self) -> None:
        self.seen = []

    def on_rollout_end(self, trainer, pl_module, rollout):
        self.seen.append(rollout)


def test_a_thread_worker_samples_what_a_process_worker_samples():
    """The same seeds and versions give the same rollouts, whichever worker samples them: tokens, rewards
    and versions exactly; the engine's log-probs to float rounding (the thread samples with its own copy of
    the weights). The learner's losses follow."""
    seen = {}
    for worker in ("process", "thread"):
        module = make(GRPO, sampling={"max_staleness": 1, "worker": worker})
        rollouts, norms = Rollouts(), Norms()
        fit(module, 3, [rollouts, norms])
        seen[worker] = rollouts.seen, norms.seen
        assert module.rollouts.process is None  # stopped with the run
    (process, process_norms), (thread, thread_norms) = seen["process"], seen["thread"]
    assert len(process) == len(thread) == 3
    for a, b in zip(process, thread, strict=True):
        for name in ("completion_ids", "loss_mask", "rewards", "correct", "versions", "ref_logp"):
            if getattr(a, name) is not None:
                torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=0, atol=0, msg=name)
        torch.testing.assert_close(b.rollout_logp, a.rollout_logp, rtol=0, atol=1e-5)
    assert [v for pair in thread_norms for v in pair] == pytest.approx(
        [v for pair in process_norms for v in pair], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_a_failing_sampler_stops_the_run_with_its_reason(worker):
    module = make(GRPO, sampling={"max_staleness": 1, "worker": worker},
                  rewards={"functions": ["test_async_sampling:failing_reward"], "on_error": "raise"})
    with pytest.raises(RuntimeError, match="sampler worker failed sampling step 0: .*ZeroDivisionError"):
        fit(module, 3)
    assert module.rollouts.process is None


def test_a_killed_sampler_is_reported_not_waited_for():
    class KillWorker(RLCallback):
        def on_step_end(self, trainer, pl_module, stats):
            os.kill(pl_module.rollouts.process.pid, 9)

    module = make(GRPO, sampling={"max_staleness": 1})
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"sampler worker exited \(code -9\) before step"):
        fit(module, 6, [KillWorker()])
    assert time.perf_counter() - start < 60


TINY = """
seed_everything: 3
trainer:
  max_steps: 6
  limit_val_batches: 0
  num_sanity_val_steps: 0
  enable_progress_bar: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: "{ckpt}", save_last: true, every_n_train_steps: 3, save_top_k: -1}}
model:
  init_args:
    sampling:
      num_generations: 4
      max_new_tokens: 8
    rewards:
      functions: [lightning_rl.step.rewards:exact_match, test_async_sampling:logged_reward]
data:
  init_args:
    batch_size: 4
"""


def test_resumed_async_run_continues_exactly_and_scores_each_prompt_once(tmp_path, monkeypatch):
    """Killed after step 3 (its checkpoint holds the rollout sampled ahead) and resumed: the same metrics
    as the uninterrupted run, and the reward saw the same prompts, none twice."""
    def run(name, steps, resume=False):
        monkeypatch.setenv(PROMPT_LOG, str(tmp_path / f"{name}.txt"))
        overlay = tmp_path / f"{name}.yaml"
        overlay.write_text(TINY.format(ckpt=tmp_path / f"ckpt_{name.split('_')[0]}"))
        args = ["fit", "--config", CONFIGS / "grpo.yaml", "--config", CONFIGS / "async.yaml", "--config",
                overlay, "--trainer.max_steps", str(steps), "--trainer.logger.init_args.save_dir",
                tmp_path / name]
        run_cli(*(args + (["--ckpt_path", "last"] if resume else [])))
        return scalars(tmp_path / name), (tmp_path / f"{name}.txt").read_text().splitlines()

    full, full_prompts = run("full", 6)
    _, first = run("cut_first", 3)
    resumed, second = run("cut_second", 6, resume=True)
    for key in ["policy/loss", "rollout/reward_mean", "policy/grad_norm", "rollout/staleness_mean",
                "rollout/mismatch_k3"]:
        assert [v for s, v in full[key] if s > 3] == pytest.approx([v for s, v in resumed[key] if s > 3],
                                                                   rel=1e-6, abs=1e-7), key
    # the interrupted run scored steps 0-3 (3 trained, 1 ahead, saved in its checkpoint); the resumed
    # run starts at step 4's batch: together the uninterrupted run's prompts, in order
    assert first + second == full_prompts[: len(first) + len(second)]
    assert len(first) == 4 * 16


# fp32's unit roundoff, and how far DDP's and FSDP2's gradients of one step may differ, relative to the
# gradient's norm (per tensor). Their sums run in different orders (all-reduce of whole buckets vs
# reduce-scatter of shards; BLAS blocks of the gathered weights), and a gradient entry is a sum over the
# step's 128 completion tokens (both ranks) of products whose factors come out of inner products up to the
# MLP's 512 wide: n ~ 128 * 512 terms. Two orders of such a sum differ by about sqrt(n) * u relative
# (rounding errors of random sign: Higham & Mary, 2019; n * u is the worst case), 256 u = 1.5e-5. Measured
# on the machine that set it: 15-37 u at each of the 4 steps.
U = 2.0**-24
GRAD_RTOL = math.sqrt(128 * 512) * U


def sgd_weight_bound(grads: list[dict], other: list[dict], name: str, weights: torch.Tensor) -> float:
    """How far the weights ``name`` of two runs of ``async_fit.py`` (SGD, ``LR``, ``MOMENTUM``) may differ
    after their steps, given each step's gradients.

    ``w_T = w_0 - lr * sum_t b_t`` with ``b_t = mu * b_{t-1} + g_t``: linear in the gradients, so
    ``|dw_T| <= lr * sum_s c_s * max|dg_s|`` with ``c_s = sum_{k < T-s} mu^k`` (3.44, 2.71, 1.9, 1 for
    T = 4), plus each run's rounding of its T updates, at most half an ulp of the weight (``u * |w|``) each,
    twice for the two runs; ``|w|`` along the way is taken as up to twice the final largest (the weights move
    by < 1e-2 and are ~0.1-1 here)."""
    T = len(grads)
    c = [sum(MOMENTUM**k for k in range(T - s)) for s in range(T)]
    propagated = LR * sum(cs * (g[name] - h[name]).abs().max().item()
                          for cs, g, h in zip(c, grads, other, strict=True))
    return propagated + 2 * T * U * 2 * weights.abs().max().item()


@pytest.mark.distributed
@pytest.mark.ranks("ddp/async-resume", "fsdp2/async-resume")
def test_two_ranks_with_uneven_samplers_under_ddp_and_fsdp2(rank_jobs):
    """tests/async_fit.py (the uninterrupted run of the resume jobs): rank 1's worker is slow; both ranks
    train every step on their own batch one version back, the workers stop with the run, and DDP and FSDP2
    sample the same tokens every step (exactly), compute the same gradients every step (to within fp32's
    reduction-order error, ``GRAD_RTOL``) and reach the same weights after 4 SGD steps (to within what those
    gradient differences and the updates' rounding allow: ``sgd_weight_bound``). Weights after several Adam
    steps are not compared: Adam turns reduction-order noise in near-zero gradients into steps of ~lr."""
    results = {kind: torch.load(rank_jobs.out(f"{kind}/async-resume") / "full" / "result.pt",
                                weights_only=False)
               for kind in ("ddp", "fsdp2")}
    for result in results.values():
        for steps in result["steps"]:  # each rank
            assert [(s["step"], set(s["versions"]), s["staleness"]) for s in steps] == [
                (t, {max(0, t - 1)}, float(min(t, 1))) for t in range(4)]
        assert result["worker"] is None
    for ddp_rank, fsdp2_rank in zip(results["ddp"]["steps"], results["fsdp2"]["steps"], strict=True):
        assert [s["tokens"] for s in ddp_rank] == [s["tokens"] for s in fsdp2_rank]
    ddp, fsdp2 = results["ddp"]["grads"], results["fsdp2"]["grads"]
    assert len(ddp) == len(fsdp2) == 4
    for t, (a, b) in enumerate(zip(ddp, fsdp2, strict=True)):
        assert a.keys() == b.keys()
        for name, g in a.items():
            norm = torch.linalg.vector_norm(g).item()
            assert norm > 0, (t, name)
            assert torch.linalg.vector_norm(b[name] - g).item() <= GRAD_RTOL * norm, (t, name)
    weights, other = results["ddp"]["weights"], results["fsdp2"]["weights"]
    assert weights.keys() == other.keys() and set(ddp[0]) <= set(weights)  # lm_head: tied, no grad of its own
    for name in ddp[0]:
        diff = (weights[name] - other[name]).abs().max().item()
        assert diff <= sgd_weight_bound(ddp, fsdp2, name, weights[name]), name


ONLINE_CONFIGS = ["grpo", "gspo", "dapo", "sapo", "rloo", "reinforce_pp", "ppo", "grpo_tools", "grpo_lora",
                  "grpo_lora@thread", "grpo+precision/bf16@thread"]


@pytest.mark.parametrize("name", ONLINE_CONFIGS)
def test_async_overlay_composes_with_every_online_config_through_the_cli(tmp_path, name):
    """configs/async.yaml over each shipped online config: the worker samples one version back (PPO's
    values, LoRA's adapters, tools, DAPO's refills and the bf16 engine's copy included), losses stay finite,
    the worker stops. ``@thread``: the sampler is a thread of the learner's process (the GPU default)."""
    name, _, worker = name.partition("@")
    configs = [arg for part in name.split("+") for arg in ("--config", CONFIGS / f"{part}.yaml")]
    configs += ["--config", CONFIGS / "async.yaml"]
    configs += ["--model.init_args.sampling.worker", worker] if worker else []
    cli = run_cli("fit", *configs,
                  "--trainer.max_steps", "4", "--trainer.limit_val_batches", "0",
                  "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "1",
                  "--trainer.logger.init_args.save_dir", tmp_path, "--trainer.enable_progress_bar", "false")
    assert cli.model.rollouts.max_staleness == 1 and cli.model.rollouts.process is None
    assert cli.model.rollouts.worker == (worker or "auto")
    logged = scalars(tmp_path)
    staleness = [v for _, v in logged["rollout/staleness_max"]]
    assert staleness[0] == 0.0 and set(staleness[1:]) == {1.0}, staleness
    losses = [v for k, series in logged.items() if k.endswith("loss") for _, v in series]
    assert losses and all(v == v and abs(v) < 1e6 for v in losses)
    assert all(v > -1e-6 for _, v in logged["rollout/mismatch_k3"])  # k3 >= 0, up to rounding


class SignalGroupAt(L.Callback):
    """At ``step``, record the worker's pid and the time, then send ``signum`` to the whole process group
    (as Ctrl-C or a batch system does): the worker receives it too."""

    def __init__(self, step: int, signum: int, record: str) -> None:
        self.step, self.signum, self.record = step, signum, record

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            with open(self.record, "w") as f:
                f.write(f"{pl_module.rollouts.process.pid} {time.time()}")
            os.killpg(os.getpgid(0), self.signum)


SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}


@pytest.fixture(scope="module")
def signalled(tmp_path_factory) -> dict:
    """One GRPO + configs/async.yaml run per signal through `lightning-rl fit` in its own session (both
    started at once), the signal sent to the process group at step 2; ``{name: (folder, process, end time,
    worker pid, time sent)}``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LRL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), str(ROOT / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    procs = {}
    for name, signum in SIGNALS.items():
        folder = tmp_path_factory.mktemp(name)
        overlay = folder / "signal.yaml"
        overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": [
            {"class_path": "test_async_sampling.SignalGroupAt",
             "init_args": {"step": 2, "signum": int(signum), "record": str(folder / "record.txt")}}]}}))
        argv = [sys.executable, "-m", "lightning_rl.cli.main", "fit", "--config", str(CONFIGS / "grpo.yaml"),
                "--config", str(CONFIGS / "async.yaml"), "--config", str(overlay), "--trainer.max_steps",
                "10", "--trainer.val_check_interval", "100", "--trainer.num_sanity_val_steps", "0",
                "--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(folder)]
        procs[name] = folder, subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    out = {}
    for name, (folder, proc) in procs.items():
        _, err = proc.communicate(timeout=300)
        pid, sent = (folder / "record.txt").read_text().split()
        out[name] = folder, proc.returncode, err, time.time(), int(pid), float(sent)
    return out


@pytest.mark.parametrize("name", list(SIGNALS))
def test_a_signal_stops_learner_and_worker_with_one_checkpoint(signalled, name):
    """SIGINT / SIGTERM to the process group at step 2: exit 130 / 143 within 30 s, one checkpoint holding
    the rollout sampled ahead, and no worker left behind."""
    folder, code, stderr, ended, pid, sent = signalled[name]
    assert code == 128 + SIGNALS[name], stderr[-3000:]
    assert ended - sent < 30
    saved = list((folder / "lightning-rl" / "version_0" / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in saved] == ["interrupted-step=3.ckpt"], saved  # after the step it arrived in
    assert torch.load(saved[0], weights_only=False)["rollouts_ahead"]["rollouts"][0]["step"] == 3
    for _ in range(50):  # the worker is gone (not even a zombie: its parent reaped it)
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()


@pytest.mark.distributed
@pytest.mark.ranks("ddp/async-resume", "fsdp2/async-resume")
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_a_two_rank_async_run_resumes_exactly(rank_jobs, kind):
    """tests/async_fit.py under DDP and FSDP2 (a sharded checkpoint), checkpointed at step 2 and resumed from
    it: each rank gets back its own rollout sampled ahead (they travel in rank 0's file), so steps 2-3
    sample the same tokens on each rank and end at the same weights as the uninterrupted run."""
    full = torch.load(rank_jobs.out(f"{kind}/async-resume") / "full" / "result.pt", weights_only=False)
    resumed = torch.load(rank_jobs.out(f"{kind}/async-resume") / "resumed" / "result.pt", weights_only=False)
    for full_rank, resumed_rank in zip(full["steps"], resumed["steps"], strict=True):
        assert [s["step"] for s in resumed_rank] == [2, 3]
        assert [(s["versions"], s["tokens"]) for s in full_rank[2:]] == [
            (s["versions"], s["tokens"]) for s in resumed_rank]
    assert full["steps"][0][2]["tokens"] != full["steps"][1][2]["tokens"]  # the ranks' rollouts differ
    for name, value in full["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=0, atol=1e-6, msg=name)


class CountingCopy(CopyEngine):
    """A copy engine that counts the learner process's weight syncs (a forked worker's own
    copy counts in its own memory)."""

    learner_syncs = 0

    def sync_weights(self, policy, version=None):
        if os.getpid() == LEARNER:
            type(self).learner_syncs += 1
        super().sync_weights(policy, version)


LEARNER = os.getpid()


@pytest.mark.slow
def test_sampling_ahead_the_learner_publishes_and_never_refreshes_its_own_engine_copy():
    """With a CopyEngine and ``max_staleness: 1`` the learner publishes each version to the worker and does
    not also copy its weights into its own engine every step (under FSDP2 a second gather of every
    parameter per step); its copy is synced when validation needs it."""
    CountingCopy.learner_syncs = 0
    module = make(GRPO, engine=CountingCopy("float32"), sampling={"max_staleness": 1})
    fit(module, 4)
    assert CountingCopy.learner_syncs == 1  # the copy filled once when built, before the worker starts
    with tempfile.TemporaryDirectory() as root:
        L.Trainer(logger=False, accelerator="cpu", limit_val_batches=1, enable_progress_bar=False,
                  default_root_dir=root).validate(module, datamodule=datamodule())
    assert CountingCopy.learner_syncs == 2  # validation samples with the trained weights
