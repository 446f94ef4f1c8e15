"""Asynchronous sampling: :class:`AsyncRollouts` runs the sampler's half of the step
(:class:`~lightning_rl.episodes.source.RolloutSource`: engine or episodes, rewards, filters and refills) in a
worker process that samples the next steps' rollouts while the learner trains.

The protocol, for a lag ``k = model.sampling.max_staleness``:

* The learner publishes its weights at the start of each step ``t`` as **version t** (before it takes the
  step's rollout), then trains on step ``t``'s rollout.
* The worker samples step ``s``'s prompt batch with version ``max(start, s - k)`` (``start``: the step the
  run began or resumed at), waiting until that version is published: admission control, never
  discarding. A rollout is therefore exactly ``k`` versions old when trained on (fewer in the first steps),
  which makes an asynchronous run as reproducible as a synchronous one, and every row records its version
  (``Rollout.versions``); the learner logs ``rollout/staleness_mean`` and ``rollout/staleness_max``.
* Weights travel through shared memory, not a pipe: ``k + 1`` slots, each holding the sampling model's
  trained parameters (every parameter; the adapters alone under LoRA, whose frozen base the worker already
  has), version ``v`` in slot ``v % (k + 1)``. The worker points its model's parameters at a slot's tensors
  (no copy); the learner writes a version into the slot no rollout in flight can still be reading (the
  rollout it held was consumed before that version could exist). Under FSDP2 each parameter is gathered
  alone while published (every rank makes the same gathers every step).
* The worker reads the DataModule's prompt stream itself (batches are a pure function of the seed and the
  batch index), and the learner checks each rollout answers the batch Lightning gave its step.
* A checkpoint holds the rollouts sampled ahead (``state_dict``) and the refill stream's position after
  them: a resumed run trains on exactly the rollouts the uninterrupted run would have, and no prompt is
  sampled or scored twice.

The worker is a forked child of its rank's process: it inherits the module's sampler, tokenizer, reward
functions, environments and tools as they are (nothing is pickled), ignores SIGINT / SIGTERM (the learner
stops it after saving its checkpoint) and exits when its parent does. It never joins a collective: each
rank has its own worker, and its filters and reward-failure limit decide on that rank's samples alone.
A worker's failure reaches the learner as an error naming the step and the worker's exception; a worker
that dies is reported with its exit code, never waited for.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.multiprocessing as mp
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


def bind(params: dict[str, Tensor], tensors: dict[str, Tensor]) -> None:
    """Point the worker model's parameters at a slot's tensors (no copy)."""
    for name, param in params.items():
        param.data = tensors[name]


@dataclass
class Worker:
    """What the worker process runs with (inherited by fork)."""

    source: RolloutSource
    io: PolicyIO
    params: dict[str, Tensor]
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
                bind(self.params, tensors)
                with torch.no_grad():
                    rollout, stats = self.source(batch, self.io, step=step, rank=self.rank,
                                                 collectives=Collectives.local(), device=torch.device("cpu"),
                                                 refill=refill if self.refills is not None else None)
                rollout = replace(rollout, versions=torch.full((len(rollout),), version, dtype=torch.long))
                if self.reference is not None:
                    rollout, stats = self.score_reference(rollout, stats)
                self.results.send(Sampled(step, version, list(batch["prompt"]), rollout, stats, refilled))
                step += 1
        except BaseException as err:  # noqa: BLE001 (every failure reaches the learner)
            last = traceback.format_exception_only(type(err), err)[-1].strip()
            self.results.send(Failed(step, last))

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

    def stopping(self) -> bool:
        return bool(self.stop.value) or os.getppid() != self.parent


def _run(worker: Worker) -> None:
    worker.run()


class AsyncRollouts:
    """The learner's side of asynchronous sampling (see the module docstring).

    Args:
        source: the sampler's half of the step, run in the worker.
        max_staleness: the lag ``k`` >= 1.
        threads: torch threads of the worker.
    """

    def __init__(self, source: RolloutSource, max_staleness: int, threads: int = 1) -> None:
        if max_staleness < 1:
            raise ValueError(f"`model.sampling.max_staleness` must be >= 1 to sample ahead, got "
                             f"{max_staleness}")
        self.source, self.lag, self.threads = source, max_staleness, threads
        self.max_staleness = max_staleness
        self.seed = source.seed
        self.slots: WeightSlots | None = None
        self.process: Any = None
        self.ready: dict[int, Sampled] = {}  # sampled ahead, by step
        self.restored: list[Sampled] = []  # from a checkpoint, for `start`
        self.refills = 0  # the refill stream's position after the last rollout received

    @property
    def running(self) -> bool:
        return self.process is not None

    def start(self, *, io: PolicyIO, params: dict[str, Tensor], batches: Callable[[int], Iterator[Batch]],
              refills: Callable[[int], Iterator[Batch]] | None, step: int, batch_index: int, rank: int,
              refills_start: int, reference: Any = None, scoring: tuple[float, int | None] = (1.0, None)
              ) -> None:
        """Fork the worker. ``params``: the sampling model's trained parameters by name (the worker binds
        them to the slots); ``batches(i)``: the training batches from batch index ``i`` on; ``step``: the
        trainer step of ``batch_index``; ``reference``: the frozen reference, scored in the worker at
        ``scoring`` = (temperature, micro-batch size)."""
        if self.running:
            return
        context = mp.get_context("fork")
        self.slots = WeightSlots(params, self.lag + 1, context)
        self.ready = {item.step: item for item in self.restored}
        first = step + len(self.restored)
        refills_start = self.restored[-1].refills if self.restored else refills_start
        self.refills, self.restored = refills_start, []
        self.results, sender = context.Pipe(duplex=False)
        self.stop = context.Value("b", 0, lock=False)
        worker = Worker(self.source, io, params, self.slots, batches(batch_index + first - step), refills,
                        refills_start, first, step, self.lag, rank, sender, self.stop, os.getpid(),
                        self.threads, reference, scoring)
        self.process = context.Process(target=_run, args=(worker,), daemon=True, name="lightning-rl-sampler")
        self.process.start()
        sender.close()  # the worker's end alone: its exit, even mid-message, reads as end of file here

    def publish(self, step: int, params: dict[str, Tensor]) -> None:
        """The learner's weights at the start of ``step``, as version ``step``."""
        assert self.slots is not None, "start() the worker first"
        self.slots.publish(step, params)

    def __call__(self, batch: Batch, io: PolicyIO, *, step: int,
                 **_: Any) -> tuple[Rollout, dict[str, float]]:
        """As ``RolloutSource``'s: step ``step``'s rollout of ``batch``, from the worker."""
        return self.take(step, batch)

    def take(self, step: int, batch: Batch) -> tuple[Rollout, dict[str, float]]:
        """Step ``step``'s rollout (waiting for the worker) and its statistics, staleness included."""
        wait_start = time.perf_counter()
        item = self.receive(step)
        if list(batch["prompt"]) != item.prompts:
            raise RuntimeError(f"asynchronous sampling: the worker's prompt batch for step {step} is not the "
                               "one the DataModule gave this step (the sampler reads the DataModule's prompt "
                               "stream ahead; a DataModule whose batches are not a pure function of the "
                               "batch index cannot be sampled ahead: set `model.sampling.max_staleness: 0`)")
        staleness = float(step - item.version)
        return item.rollout, {**item.stats, "rollout/staleness_mean": staleness,
                              "rollout/staleness_max": staleness,
                              "perf/rollout_wait_time": time.perf_counter() - wait_start}

    def receive(self, step: int) -> Sampled:
        """The worker's rollout of ``step``: from those received ahead, else the next ones in order."""
        while step not in self.ready:
            item = self.next_result(step)
            if isinstance(item, Failed):
                self.close()
                raise RuntimeError(f"the sampler worker failed sampling step {item.step}: {item.message}")
            self.ready[item.step] = item
            self.refills = item.refills
        return self.ready.pop(step)

    def next_result(self, step: int) -> Sampled | Failed:
        """The worker's next message; its exit (killed, even in the middle of a message) is an error
        naming its exit code, never a wait."""
        process = self.process
        if process is None:
            raise RuntimeError(f"the sampler worker is not running (step {step})")
        while True:
            if self.results.poll(POLL_SECONDS):
                try:
                    return self.results.recv()
                except (EOFError, OSError):  # its end of the pipe closed, or its tensors went with it
                    break
            if not process.is_alive():
                break
        process.join(timeout=5)
        self.close()
        raise RuntimeError(f"the sampler worker exited (code {process.exitcode}) before step {step}'s "
                           "rollout")

    def state_dict(self, next_step: int) -> dict[str, Any]:
        """The rollouts of steps ``next_step .. next_step + k - 1`` (their weight versions are published, so
        the worker finishes them) and the refill position after them; the next ones are sampled after a
        resume from the checkpoint's weights, as they would have been."""
        ahead = [self.receive_kept(s) for s in range(next_step, next_step + self.lag)] if self.running else []
        return {"rollouts": [as_state(item) for item in ahead],
                "refills": ahead[-1].refills if ahead else self.refills}

    def receive_kept(self, step: int) -> Sampled:
        item = self.receive(step)
        self.ready[step] = item
        return item

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = [from_state(item) for item in state.get("rollouts", [])]
        self.refills = int(state.get("refills", 0))

    def close(self) -> None:
        """Stop the worker (at most a few seconds: it checks between rollouts and while it waits)."""
        process, self.process = self.process, None
        if process is None:
            return
        self.stop.value = 1
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def as_state(item: Sampled) -> dict[str, Any]:
    """A sampled-ahead rollout as plain types and tensors, for a checkpoint."""
    rollout = {f.name: getattr(item.rollout, f.name) for f in fields(Rollout)}
    return {"step": item.step, "version": item.version, "prompts": item.prompts, "rollout": rollout,
            "stats": dict(item.stats), "refills": item.refills}


def from_state(state: dict[str, Any]) -> Sampled:
    return Sampled(state["step"], state["version"], state["prompts"], Rollout(**state["rollout"]),
                   state["stats"], state["refills"])
