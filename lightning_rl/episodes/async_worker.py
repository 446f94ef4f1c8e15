"""The sampler's worker process of asynchronous sampling (:mod:`lightning_rl.episodes.async_source`): the
shared-memory weight slots, the messages it sends, and its loop.

The worker is a forked child of its rank's process: it inherits the module's sampler, tokenizer, reward
functions, environments and tools as they are (nothing is pickled), ignores SIGINT / SIGTERM (the learner
stops it after saving its checkpoint) and exits when its parent does. It never joins a collective. Its
messages travel pickled through a pipe whose only writer it is: rollouts are small next to the weights,
and its death, even in the middle of a message, reads as end of file on the learner's side.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
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
    """``count`` shared-memory copies of the sampling model's trained parameters, one per weight version
    in flight (see the module docstring)."""

    def __init__(self, params: dict[str, Tensor], count: int, context: Any) -> None:
        self.count = count
        self.tensors = [{name: torch.zeros_like(p.detach(), device="cpu").share_memory_()
                         for name, p in params.items()} for _ in range(count)]
        # lock-free: a lock the worker held when it was killed would hang the learner's next publish
        self.versions = context.Array("q", [-1] * count, lock=False)

    @torch.no_grad()
    def publish(self, version: int, params: dict[str, Tensor]) -> None:
        """Write ``params`` (the learner's, cast to the slot's dtype) as ``version``."""
        index = version % self.count
        slot = self.tensors[index]
        for name, param in params.items():
            slot[name].copy_(full_value(param.detach()).to(dtype=slot[name].dtype, device="cpu"))
        self.versions[index] = version  # after the tensors: the worker reads them once it sees this

    def wait(self, version: int, stopping: Callable[[], bool]) -> dict[str, Tensor] | None:
        """The slot holding ``version`` once published (``None`` if ``stopping()`` first)."""
        index = version % self.count
        while self.versions[index] != version:
            if stopping():
                return None
            time.sleep(POLL_SECONDS)
        return self.tensors[index]


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
    results: Any
    stop: Any
    parent: int
    threads: int
    reference: Any = None
    scoring: tuple[float, int | None] = (1.0, None)  # the reference's temperature and micro-batch size

    def run(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the learner saves, then stops the worker
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        torch.set_num_threads(self.threads)
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
                self.engine.set_weights(version, tensors)
                with torch.no_grad():
                    rollout, stats = self.source(batch, self.io, step=step, rank=self.rank,
                                                 collectives=Collectives.local(), device=torch.device("cpu"),
                                                 refill=refill if self.refills is not None else None)
                rollout = replace(rollout, versions=torch.full((len(rollout),), version, dtype=torch.long))
                if self.reference is not None:
                    rollout, stats = self.score_reference(rollout, stats)
                self.send(Sampled(step, version, list(batch["prompt"]), rollout, stats, refilled))
                step += 1
        except BaseException as err:  # noqa: BLE001 (every failure reaches the learner)
            last = traceback.format_exception_only(type(err), err)[-1].strip()
            self.send(Failed(step, last))
        finally:
            self.engine.close()

    @torch.no_grad()
    def score_reference(self, rollout: Rollout, stats: dict[str, float]) -> tuple[Rollout, dict[str, float]]:
        """The frozen reference's log-probs, here rather than on the learner: they do not depend on the
        trained weights (verl's separate reference worker), and the two sides' work is more even."""
        start = time.perf_counter()
        temperature, micro_batch_size = self.scoring
        ref_logp = score_rollout(self.reference, rollout, temperature=temperature,
                                 micro_batch_size=micro_batch_size, collectives=Collectives.local())
        return replace(rollout, ref_logp=ref_logp), {**stats, "perf/sampler_reference_time":
                                                     time.perf_counter() - start}

    def send(self, message: Sampled | Failed) -> None:
        """Pickled whole (tensors as bytes: cheaper for a rollout than a shared-memory file per tensor)."""
        self.results.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def stopping(self) -> bool:
        return bool(self.stop.value) or os.getppid() != self.parent


def run_worker(worker: Worker) -> None:
    worker.run()
