"""The sampler's worker of asynchronous sampling (:mod:`lightning_rl.episodes.async_source`): the weight
slots, the messages it sends, the progress it reports, and its loop.

A **process** worker (``model.sampling.worker: process``, the default on CPU) is a child of its rank's
process forked from a fresh thread (:func:`lightning_rl.step.forking.fork`): it inherits the module's
sampler, tokenizer, reward functions, environments and tools as they are (nothing is pickled), runs
``model.sampling.worker_threads`` torch threads with an OpenMP runtime of its own (a fork from a thread that
ran parallel regions would hang in its first one), ignores SIGINT / SIGTERM (the learner stops it after
saving its checkpoint), is SIGKILLed by the kernel when its parent ends however it ends
(``PR_SET_PDEATHSIG``; a vLLM engine it started has its own), and is not daemonic: what it calls may start
processes of its own. Its messages travel pickled through a pipe whose only writer it is: rollouts are small
next to the weights, and its death, even in the middle of a message, reads as end of file on the learner's
side; its weight slots are shared-memory tensors.

A **thread** worker (``worker: thread``, the default on GPUs, where a CUDA context cannot be forked and
kernels release the GIL) runs in the learner's process with its own copy of the sampling weights
(``HFEngine.worker_copy``), its own CUDA stream, and slots on the device: a version is published by a
device-to-device copy, and the worker's stream waits for it. Its rollouts reach the learner through a queue,
on the CPU (a rollout is small; the learner moves it to its device). It never writes the process-global RNG
(the learner's): transformers' ``generate``, which draws from it, is refused there
(:func:`lightning_rl.step.engine.seeded`).

Either reports its **progress** (:class:`Progress`: a small shared-memory array for a process, a list for a
thread): its phase (``waiting for weights version 3 to sample step 4``, ``generating step 4``, ``scoring
rewards (or running tools) for step 4``, ...) and when it last reported. It reports at every phase change,
at every generation call (each round and each turn of a step) and all the while it waits for weights, so
the learner's ``model.sampling.worker_timeout`` measures how long one phase has gone without news, never a
whole step. Either never joins a collective.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from lightning_rl.episodes.sampler import PolicyIO
from lightning_rl.episodes.source import Batch, PromptBatches, RefillStream, RolloutSource
from lightning_rl.models.frozen import FrozenModels
from lightning_rl.models.sharding import full_value
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.logprobs import FrozenLogProbs
from lightning_rl.step.rollout import Rollout

POLL_SECONDS = 0.002
PHASES = ("starting", "waiting for weights version {version} to sample step {step}",
          "loading weights version {version} to sample step {step}", "generating step {step}",
          "scoring rewards (or running tools) for step {step}",
          "scoring the frozen models' log-probs for step {step}", "sending step {step}'s rollout", "stopped")
STARTING, WAITING, LOADING, GENERATING, SCORING, FROZEN, SENDING, STOPPED = range(len(PHASES))


class Progress:
    """What the worker is doing, for the learner's stall check: its phase (an index into ``PHASES``), the
    step and weight version it concerns, and the ``time.monotonic()`` of its last report (one clock for every
    process of the machine). A process worker's lives in shared memory (``context``: its multiprocessing
    context), a thread's in a list. Lock-free: the worker alone writes, the time last."""

    def __init__(self, context: Any = None) -> None:
        initial = [float(STARTING), -1.0, -1.0, time.monotonic()]
        self.values: Any = initial if context is None else context.RawArray("d", initial)

    def report(self, phase: int, step: int, version: int = -1) -> None:
        self.values[0], self.values[1], self.values[2] = float(phase), float(step), float(version)
        self.values[3] = time.monotonic()

    def beat(self) -> None:
        """Still in the same phase, and fine (waiting for the learner's weights)."""
        self.values[3] = time.monotonic()

    def silent_for(self) -> float:
        """Seconds since the last report."""
        return time.monotonic() - self.values[3]

    def describe(self) -> str:
        """The phase in words: ``generating step 4``."""
        phase, step, version = (int(v) for v in self.values[:3])
        return PHASES[phase].format(step=step, version=version)


@dataclass
class Sampled:
    """One step's rollout from the worker: its step, weight version, prompts (checked against the
    learner's batch), statistics, the refill stream's position after it, and the pass rate of each prompt
    before any filter (what a curriculum learns from)."""

    step: int
    version: int
    prompts: list[Any]
    rollout: Rollout
    stats: dict[str, float]
    refills: int
    outcomes: list[float] | None = None


@dataclass
class Failed:
    """The worker's exception, as text, and the step it was sampling."""

    step: int
    message: str


class WeightSlots:
    """``count`` copies of the sampling model's trained parameters, one per weight version in flight (see
    :mod:`lightning_rl.episodes.async_source`): shared-memory CPU tensors for a process worker (``context``
    its multiprocessing context), tensors on the engine's device for a thread worker (``context``
    ``None``)."""

    def __init__(self, params: dict[str, Tensor], count: int, context: Any = None) -> None:
        self.count = count
        if context is None:
            self.tensors = [{name: torch.zeros_like(p.detach()) for name, p in params.items()}
                            for _ in range(count)]
            self.versions: Any = [-1] * count
        else:
            self.tensors = [{name: torch.zeros_like(p.detach(), device="cpu").share_memory_()
                             for name, p in params.items()} for _ in range(count)]
            # lock-free: a lock the worker held when it was killed would hang the learner's next publish
            self.versions = context.Array("q", [-1] * count, lock=False)
        self.ready: list[Any] = [None] * count  # CUDA: the event after a version's copies

    @torch.no_grad()
    def publish(self, version: int, params: dict[str, Tensor]) -> None:
        """Write ``params`` (the learner's, cast to the slot's dtype) as ``version``."""
        index = version % self.count
        slot = self.tensors[index]
        for name, param in params.items():
            target = slot[name]
            target.copy_(full_value(param.detach()).to(dtype=target.dtype, device=target.device))
        if any(t.is_cuda for t in slot.values()):
            self.ready[index] = torch.cuda.Event()
            self.ready[index].record()  # on the learner's stream, after the copies
        self.versions[index] = version  # after the tensors: the worker reads them once it sees this

    def wait(self, version: int, stopping: Callable[[], bool]) -> dict[str, Tensor] | None:
        """The slot holding ``version`` once published (``None`` if ``stopping()`` first); on CUDA the
        caller's stream waits for the copies."""
        index = version % self.count
        while self.versions[index] != version:
            if stopping():
                return None
            time.sleep(POLL_SECONDS)
        if self.ready[index] is not None:
            torch.cuda.current_stream().wait_event(self.ready[index])
        return self.tensors[index]


def rollout_to(rollout: Rollout, device: torch.device | str) -> Rollout:
    """``rollout`` with every tensor on ``device``, each frozen model's log-probs included."""
    fields_now = {f.name: getattr(rollout, f.name) for f in fields(Rollout)}
    moved = {name: value.to(device) for name, value in fields_now.items()
             if isinstance(value, Tensor) and value.device != torch.device(device)}
    frozen = {name: value.to(device) for name, value in rollout.frozen_logp.items()}
    return replace(rollout, frozen_logp=frozen, **moved)


@dataclass
class SamplerWorker:
    """What the worker process runs with (inherited by fork)."""

    source: RolloutSource
    io: PolicyIO
    engine: Any
    slots: WeightSlots
    batches: PromptBatches  # its `record` hears each step's outcome before the next batch is drawn
    refills: Callable[[int], Iterator[Batch]] | None
    refills_start: int
    step: int
    start: int
    lag: int
    rank: int
    results: Any  # a process's pipe end, or a thread's queue
    stop: Any
    parent: int | None  # a process's parent pid; None: a thread
    threads: int
    progress: Progress
    frozen: dict[str, Any] | None = None  # frozen models scored here, by name: the reference, a preset's
    micro_batch_size: int | None = None  # rows per forward when scoring them (at the rollout's temperature)
    device: torch.device = torch.device("cpu")

    def run(self) -> None:
        """The loop, on the worker's own CUDA stream. A process has its threads and signals from
        :func:`~lightning_rl.step.forking.fork`; a thread sets its own OpenMP team size."""
        if self.parent is None:
            torch.set_num_threads(self.threads)
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.loop()

    def loop(self) -> None:
        """Sample and send each batch's rollout in step order until the batches end, a stop, or a failure
        (sent to the learner); the progress reports ``stopped`` and the engine closes however it ends."""
        refills = RefillStream(self.refills, self.refills_start)
        step = self.step
        try:
            for batch in self.batches:
                sampled = self.sample(step, batch, refills)
                if sampled is None:  # stopped (a version already published is no reason to go on)
                    return
                self.progress.report(SENDING, step, sampled.version)
                self.send(sampled)
                step += 1
        except BaseException as err:  # noqa: BLE001 (every failure reaches the learner)
            last = traceback.format_exception_only(type(err), err)[-1].strip()
            self.send(Failed(step, last))
        finally:
            self.progress.report(STOPPED, step)
            self.engine.close()

    def sample(self, step: int, batch: Batch, refills: RefillStream) -> Sampled | None:
        """Step ``step``'s rollout of ``batch``, sampled with weight version ``max(start, step - lag)`` once
        published, its outcome recorded by the batches' stream, its frozen models scored, on the CPU;
        ``None`` when stopped while waiting for the weights."""
        version = max(self.start, step - self.lag)
        self.progress.report(WAITING, step, version)
        tensors = None if self.stopping() else self.slots.wait(version, self.waiting)
        if tensors is None:
            return None
        self.progress.report(LOADING, step, version)
        loading = time.perf_counter()
        self.engine.set_weights(version, tensors)  # a vLLM engine loads the version here
        loaded = time.perf_counter() - loading
        outcomes: list[list[float]] = []
        with torch.no_grad():
            rollout, stats = self.source(batch, self.reporting_io(step), step=step, rank=self.rank,
                                         collectives=Collectives.local(), device=self.device,
                                         refill=refills if self.refills is not None else None,
                                         report=outcomes.append)
        self.batches.record(step, outcomes[0])  # before the next batch is drawn
        stats = {**stats, "perf/sampler_weight_sync_time": loaded}
        rollout = replace(rollout, versions=torch.full((len(rollout),), version, dtype=torch.long))
        self.progress.report(FROZEN, step, version)
        rollout, stats = self.score_frozen(rollout, stats)
        rollout = rollout_to(rollout, "cpu")  # a thread's stream finishes here: the slot is free
        return Sampled(step, version, list(batch["prompt"]), rollout, stats, refills.position, outcomes[0])

    def reporting_io(self, step: int) -> PolicyIO:
        """The policy's IO whose ``generate`` reports each call (a round, an episode's turn) and its end:
        what follows a generation is scoring (rewards, an episode's tools and environment, filters)."""
        generate = self.io.generate

        def reported(*args: Any, **kwargs: Any) -> Any:
            self.progress.report(GENERATING, step)
            try:
                return generate(*args, **kwargs)
            finally:
                self.progress.report(SCORING, step)

        return replace(self.io, generate=reported)

    @torch.no_grad()
    def score_frozen(self, rollout: Rollout, stats: dict[str, float]) -> tuple[Rollout, dict[str, float]]:
        """Every frozen model's log-probs (the reference's, a preset's own), here rather than on the
        learner: they do not depend on the trained weights (verl's separate reference worker), and the two
        sides' work is more even. The learner's own stage (``FrozenLogProbs``) scores them, with this
        process's collectives; the learner's stage then finds them scored."""
        models = FrozenModels(self.frozen)
        for name in models.all():
            stage = FrozenLogProbs(models, name, policy=None, micro_batch_size=self.micro_batch_size,
                                   time_key=f"perf/sampler_{name}_time")
            rollout, extra = stage(rollout, Collectives.local())
            stats = {**stats, **extra}
        return rollout, stats

    def send(self, message: Sampled | Failed) -> None:
        """A process's: pickled whole (tensors as bytes: cheaper for a rollout than a shared-memory file per
        tensor); a thread's: as it is."""
        if self.parent is None:
            self.results.put(message)
        else:
            self.results.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def stopping(self) -> bool:
        return bool(self.stop.value) or (self.parent is not None and os.getppid() != self.parent)

    def waiting(self) -> bool:
        """``stopping()``, polled while the worker waits for weights: each poll is a sign of life."""
        self.progress.beat()
        return self.stopping()


def run_worker(worker: SamplerWorker) -> None:
    worker.run()
