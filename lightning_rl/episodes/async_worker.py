"""The sampler's worker of asynchronous sampling (:mod:`lightning_rl.episodes.async_source`): the weight
slots, the messages it sends, and its loop.

A **process** worker (``model.sampling.worker: process``, the default on CPU) is a forked child of its
rank's process: it inherits the module's sampler, tokenizer, reward functions, environments and tools as
they are (nothing is pickled), has its own torch threads, ignores SIGINT / SIGTERM (the learner stops it
after saving its checkpoint) and exits when its parent does. Its messages travel pickled through a pipe
whose only writer it is: rollouts are small next to the weights, and its death, even in the middle of a
message, reads as end of file on the learner's side; its weight slots are shared-memory tensors.

A **thread** worker (``worker: thread``, the default on GPUs, where a CUDA context cannot be forked and
kernels release the GIL) runs in the learner's process with its own copy of the sampling weights
(``HFEngine.worker_copy``), its own CUDA stream, and slots on the device: a version is published by a
device-to-device copy, and the worker's stream waits for it. Its rollouts reach the learner through a queue,
on the CPU (a rollout is small; the learner moves it to its device).

Either never joins a collective.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from lightning_rl.episodes.sampler import PolicyIO
from lightning_rl.episodes.source import Batch, RolloutSource
from lightning_rl.models.sharding import full_value
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.logprobs import score_rollout
from lightning_rl.step.rollout import Rollout

POLL_SECONDS = 0.002


@dataclass
class Sampled:
    """One step's rollout from the worker: its step, weight version, prompts (checked against the
    learner's batch), statistics, and the refill stream's position after it."""

    step: int
    version: int
    prompts: list[Any]
    rollout: Rollout
    stats: dict[str, float]
    refills: int


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
    """``rollout`` with every tensor on ``device``."""
    moved = {f.name: getattr(rollout, f.name) for f in fields(Rollout)}
    return replace(rollout, **{name: value.to(device) for name, value in moved.items()
                               if isinstance(value, Tensor) and value.device != torch.device(device)})


FROZEN_FIELDS = {"reference": "ref_logp", "teacher": "teacher_logp"}  # the rollout field each one fills


@dataclass
class Worker:
    """What the worker process runs with (inherited by fork)."""

    source: RolloutSource
    io: PolicyIO
    engine: Any
    slots: WeightSlots
    batches: Iterator[Batch]
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
    frozen: dict[str, Any] | None = None  # frozen models scored here: {"reference": ..., "teacher": ...}
    scoring: tuple[float, int | None] = (1.0, None)  # their temperature and micro-batch size
    device: torch.device = torch.device("cpu")

    def run(self) -> None:
        if self.parent is not None:  # a process of its own
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner saves, then stops the worker
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        torch.set_num_threads(self.threads)  # a thread's: its own OpenMP team (a new thread has the default)
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.loop()

    def loop(self) -> None:
        refill_stream, refilled = None, self.refills_start

        def refill() -> Batch:
            nonlocal refill_stream, refilled
            if refill_stream is None:
                refill_stream = self.refills(refilled)
            refilled += 1
            return next(refill_stream)

        step = self.step
        try:
            for batch in self.batches:
                version = max(self.start, step - self.lag)
                tensors = self.slots.wait(version, self.stopping)
                if tensors is None:
                    return
                loading = time.perf_counter()
                self.engine.set_weights(version, tensors)  # a vLLM engine loads the version here
                loaded = time.perf_counter() - loading
                with torch.no_grad():
                    rollout, stats = self.source(batch, self.io, step=step, rank=self.rank,
                                                 collectives=Collectives.local(), device=self.device,
                                                 refill=refill if self.refills is not None else None)
                stats = {**stats, "perf/sampler_weight_sync_time": loaded}
                rollout = replace(rollout, versions=torch.full((len(rollout),), version, dtype=torch.long))
                rollout, stats = self.score_frozen(rollout, stats)
                rollout = rollout_to(rollout, "cpu")  # a thread's stream finishes here: the slot is free
                self.send(Sampled(step, version, list(batch["prompt"]), rollout, stats, refilled))
                step += 1
        except BaseException as err:  # noqa: BLE001 (every failure reaches the learner)
            last = traceback.format_exception_only(type(err), err)[-1].strip()
            self.send(Failed(step, last))
        finally:
            self.engine.close()

    @torch.no_grad()
    def score_frozen(self, rollout: Rollout, stats: dict[str, float]) -> tuple[Rollout, dict[str, float]]:
        """The frozen models' log-probs (the reference's, a distillation teacher's), here rather than on the
        learner: they do not depend on the trained weights (verl's separate reference worker), and the two
        sides' work is more even. Each fills its field of the rollout (``FROZEN_FIELDS``)."""
        temperature, micro_batch_size = self.scoring
        for name, model in (self.frozen or {}).items():
            start = time.perf_counter()
            logp = score_rollout(model, rollout, temperature=temperature, micro_batch_size=micro_batch_size,
                                 collectives=Collectives.local())
            rollout = replace(rollout, **{FROZEN_FIELDS[name]: logp})
            stats = {**stats, f"perf/sampler_{name}_time": time.perf_counter() - start}
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


def run_worker(worker: Worker) -> None:
    worker.run()
