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

The worker (:mod:`lightning_rl.episodes.async_worker`) is a forked child of its rank's process on CPU, a
thread of it with its own copy of the weights and its own CUDA stream on GPUs (``model.sampling.worker``).
It never joins a collective: each rank has its own worker, and its filters and reward-failure limit decide on
that rank's samples alone. A worker's failure reaches the learner as an error naming the step and the worker's
exception; a worker that dies is reported with its exit code, never waited for.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from lightning_rl.episodes.async_worker import (
    POLL_SECONDS,
    Failed,
    Sampled,
    WeightSlots,
    Worker,
    rollout_to,
    run_worker,
)
from lightning_rl.episodes.sampler import PolicyIO
from lightning_rl.episodes.source import Batch, RolloutSource
from lightning_rl.models.adapters import named_trainable_parameters
from lightning_rl.step.rollout import Rollout

STOP_SECONDS = 30  # a worker's own stop (a vLLM engine it started shuts down in ~5 s) before it is killed


class AsyncRollouts:
    """The learner's side of asynchronous sampling (see the module docstring).

    Args:
        source: the sampler's half of the step, run in the worker.
        max_staleness: the lag ``k`` >= 1.
        threads: torch threads of a process worker.
        worker: ``process``, ``thread`` or ``auto`` (a process on CPU, a thread on GPUs).
    """

    def __init__(self, source: RolloutSource, max_staleness: int, threads: int = 1,
                 worker: str = "auto") -> None:
        if max_staleness < 1:
            raise ValueError(f"`model.sampling.max_staleness` must be >= 1 to sample ahead, got "
                             f"{max_staleness}")
        self.source, self.lag, self.threads, self.worker = source, max_staleness, threads, worker
        self.max_staleness = max_staleness
        self.seed = source.seed
        self.slots: WeightSlots | None = None
        self.process: Any = None
        self.ready: dict[int, Sampled] = {}  # sampled ahead, by step
        self.restored: list[Sampled] = []  # from a checkpoint, for `start`
        self.refills = 0  # the refill stream's position after the last rollout received
        self.loaded = False  # resumed: `refills` is the checkpoint's position, not the DataModule's

    @property
    def running(self) -> bool:
        return self.process is not None

    def start(self, *, io: PolicyIO, engine: Any, names: list[str], batches: Callable[[int], Iterator[Batch]],
              refills: Callable[[int], Iterator[Batch]] | None, step: int, batch_index: int, rank: int,
              refills_start: int, frozen: dict[str, Any] | None = None,
              scoring: tuple[float, int | None] = (1.0, None),
              thread: bool = False, device: torch.device | None = None) -> None:
        """Start the worker: a forked process, or a ``thread`` sampling on ``device``. ``engine``: the
        rollout engine (``io.generate`` is its; a thread's has its own weights), which receives each version
        through ``set_weights``; ``names``: the trained parameters' names; ``batches(i)``: the training
        batches from batch index ``i`` on; ``step``: the trainer step of ``batch_index``; ``frozen``: the
        frozen models scored in the worker (``{"reference": ..., "teacher": ...}``) at ``scoring`` =
        (temperature, micro-batch size)."""
        if self.running:
            return
        context = None if thread else mp.get_context("fork")
        self.slots = WeightSlots(engine.weights(names), self.lag + 1, context)
        self.ready = {item.step: item for item in self.restored}
        first = step + len(self.restored)
        refills_start = self.refills if self.loaded else refills_start
        self.refills, self.restored = refills_start, []
        if context is None:
            self.results = sender = queue.SimpleQueue()
            self.stop = SimpleNamespace(value=0)
        else:
            self.results, sender = context.Pipe(duplex=False)
            self.stop = context.Value("b", 0, lock=False)
        worker = Worker(self.source, io, engine, self.slots, batches(batch_index + first - step), refills,
                        refills_start, first, step, self.lag, rank, sender, self.stop,
                        None if thread else os.getpid(), self.threads, frozen, scoring,
                        device or torch.device("cpu"))
        if context is None:
            self.process = threading.Thread(target=run_worker, args=(worker,), daemon=True,
                                            name="lightning-rl-sampler")
            self.process.start()
        else:
            # not daemonic: what samples may start processes of its own (a vLLM engine, a reward's pool)
            self.process = context.Process(target=run_worker, args=(worker,), daemon=False,
                                           name="lightning-rl-sampler")
            self.process.start()
            sender.close()  # the worker's end alone: its exit, even mid-message, reads as end of file here
        # however the learner ends (a signal's checkpoint-and-exit skips Lightning's teardown), stop the
        # worker before multiprocessing's own exit handler joins it (after a SIGTERM the worker ignores)
        atexit.register(self.close)

    def publish(self, step: int, model: nn.Module) -> None:
        """The trained weights of ``model`` at the start of ``step``, as version ``step``."""
        assert self.slots is not None, "start() the worker first"
        self.slots.publish(step, named_trainable_parameters(model))

    def __call__(self, batch: Batch, io: PolicyIO, *, step: int, device: torch.device | None = None,
                 **_: Any) -> tuple[Rollout, dict[str, float]]:
        """As ``RolloutSource``'s: step ``step``'s rollout of ``batch``, from the worker, on ``device``."""
        rollout, stats = self.take(step, batch)
        return (rollout if device is None else rollout_to(rollout, device)), stats

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
        if isinstance(process, threading.Thread):
            return self.next_from_thread(process, step)
        while True:
            if self.results.poll(POLL_SECONDS):
                try:
                    return pickle.loads(self.results.recv_bytes())
                except (EOFError, OSError):  # its end of the pipe closed, or its tensors went with it
                    break
            if not process.is_alive():
                break
        process.join(timeout=5)
        self.close()
        raise RuntimeError(f"the sampler worker exited (code {process.exitcode}) before step {step}'s "
                           "rollout")

    def next_from_thread(self, thread: threading.Thread, step: int) -> Sampled | Failed:
        """A thread worker's next message (it reports its own exceptions; it cannot be killed)."""
        while True:
            try:
                return self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not thread.is_alive() and self.results.empty():
                    self.close()
                    raise RuntimeError(f"the sampler thread stopped before step {step}'s rollout") from None

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
        self.refills, self.loaded = int(state.get("refills", 0)), True

    def close(self) -> None:
        """Stop the worker: it checks between rollouts and while it waits, then stops what it started (a vLLM
        engine); killed after ``STOP_SECONDS``."""
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.close)
        self.stop.value = 1
        process.join(timeout=STOP_SECONDS)
        if process.is_alive() and not isinstance(process, threading.Thread):
            process.kill()  # a thread in the middle of a rollout ends with it (a daemon: never waited for)
            process.join(timeout=5)


def as_state(item: Sampled) -> dict[str, Any]:
    """A sampled-ahead rollout as plain types and tensors, for a checkpoint."""
    rollout = {f.name: getattr(item.rollout, f.name) for f in fields(Rollout)}
    return {"step": item.step, "version": item.version, "prompts": item.prompts, "rollout": rollout,
            "stats": dict(item.stats), "refills": item.refills}


def from_state(state: dict[str, Any]) -> Sampled:
    return Sampled(state["step"], state["version"], state["prompts"], Rollout(**state["rollout"]),
                   state["stats"], state["refills"])
