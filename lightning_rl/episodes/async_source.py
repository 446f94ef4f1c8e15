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
  sampled or scored twice. Each carries its prompts' pass rates: a curriculum's stream
  (:mod:`lightning_rl.data.curriculum`) hears them in the learner when trained on, and in a resumed worker,
  which draws their batches again, before it draws a new one.

The worker (:mod:`lightning_rl.episodes.async_worker`) is a child of its rank's process on CPU, a thread
of it with its own copy of the weights and its own CUDA stream on GPUs (``model.sampling.worker``). It
never joins a collective: each rank has its own worker, and its filters and reward-failure limit decide on
that rank's samples alone. The learner never waits for it blindly (:mod:`lightning_rl.episodes.async_link`):
a worker that fails, dies or stalls (silent past ``model.sampling.worker_timeout``) stops the run with a line
naming it.

A stop request (Ctrl-C / SIGTERM, seen through :meth:`AsyncRollouts.watch`) while the learner waits: a
worker that keeps reporting progress finishes the step, which ends with the usual checkpoint; one silent for
``async_link.STOP_PATIENCE`` seconds is given up. In a single process the step is then dropped (nothing of
it has run: its batch, weights and optimiser are untouched) and the run saves the checkpoint of its start
and exits as the signal asks; with several ranks, which cannot agree in the middle of a step, it stops with
the stall's error. A checkpoint taken with a stop pending holds the rollouts received in time: a stalled,
failed or dead worker costs the rollouts it had not delivered, which the resumed run samples again with its
own weights (fresher than the uninterrupted run's would have been).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from lightning_rl.episodes.async_link import SamplerLost, WorkerLink
from lightning_rl.episodes.async_worker import Failed, Sampled, SamplerWorker, WeightSlots, rollout_to
from lightning_rl.episodes.sampler import PolicyIO
from lightning_rl.episodes.source import Batch, PromptBatches, RolloutSource
from lightning_rl.models.adapters import named_trainable_parameters
from lightning_rl.step.rollout import Rollout


class AsyncRollouts:
    """The learner's side of asynchronous sampling (see the module docstring).

    Args:
        source: the sampler's half of the step, run in the worker.
        max_staleness: the lag ``k`` >= 1.
        threads: torch threads of a process worker.
        worker: ``process``, ``thread`` or ``auto`` (a process on CPU, a thread on GPUs).
        timeout: seconds without progress before a worker the learner waits for is stalled (``None``: no
            limit).
    """

    def __init__(self, source: RolloutSource, max_staleness: int, threads: int = 1,
                 worker: str = "auto", timeout: float | None = 600.0) -> None:
        if max_staleness < 1:
            raise ValueError(f"`model.sampling.max_staleness` must be >= 1 to sample ahead, got "
                             f"{max_staleness}")
        self.source, self.lag, self.threads, self.worker = source, max_staleness, threads, worker
        self.max_staleness, self.timeout = max_staleness, timeout
        self.seed = source.seed
        self.slots: WeightSlots | None = None
        self.link: WorkerLink | None = None
        self.ready: dict[int, Sampled] = {}  # sampled ahead, by step
        self.restored: list[Sampled] = []  # from a checkpoint, for `start`
        self.refills = 0  # the refill stream's position after the last rollout received
        self.loaded = False  # resumed: `refills` is the checkpoint's position, not the DataModule's
        self.stop_requested: Callable[[], bool] = lambda: False
        self.stop_now: Callable[[], None] | None = None

    @property
    def running(self) -> bool:
        return self.link is not None

    @property
    def process(self) -> Any:
        """The running worker: a ``forking.Forked`` process or a thread (``None`` when stopped)."""
        return None if self.link is None else self.link.process

    def watch(self, requested: Callable[[], bool], stop: Callable[[], None] | None) -> None:
        """How a wait sees a stop request: ``requested()`` (Ctrl-C / SIGTERM received); ``stop()`` saves the
        checkpoint of the current step's start and ends the run (it raises; ``None``: not possible here,
        e.g. with several ranks). Called by ``lightning_rl.callbacks.CheckpointOnInterrupt``."""
        self.stop_requested, self.stop_now = requested, stop

    def start(self, *, io: PolicyIO, engine: Any, names: list[str], batches: Callable[[int], PromptBatches],
              refills: Callable[[int], Iterator[Batch]] | None, step: int, batch_index: int, rank: int,
              refills_start: int, frozen: dict[str, Any] | None = None, micro_batch_size: int | None = None,
              thread: bool = False, device: torch.device | None = None) -> None:
        """Start the worker: a forked process, or a ``thread`` sampling on ``device``. ``engine``: the
        rollout engine (``io.generate`` is its; a thread's has its own weights), which receives each version
        through ``set_weights``; ``names``: the trained parameters' names; ``batches(i)``: the training
        batches from batch index ``i`` on (their ``record`` hears each step's outcome); ``step``: the trainer
        step of ``batch_index``; ``frozen``: the frozen models scored in the worker, by name (the reference,
        a preset's own), ``micro_batch_size`` rows per forward, at each rollout's temperature."""
        if self.running:
            return
        link = WorkerLink(thread, self.timeout, lambda: self.stop_requested())
        self.slots = WeightSlots(engine.weights(names), self.lag + 1, link.context)
        self.ready = {item.step: item for item in self.restored}
        first = step + len(self.restored)
        refills_start = self.refills if self.loaded else refills_start
        stream = batches(batch_index)
        for item in self.restored:  # sampled before the checkpoint: drawn again, their outcomes heard
            next(stream)
            if item.outcomes is not None:  # by a curriculum's stream, which learns from the pass rates
                stream.record(item.step, item.outcomes)
        self.refills, self.restored = refills_start, []
        worker = SamplerWorker(self.source, io, engine, self.slots, stream, refills,
                        refills_start, first, step, self.lag, rank, link.sender, link.stop,
                        None if thread else os.getpid(), self.threads, link.progress, frozen=frozen,
                        micro_batch_size=micro_batch_size, device=device or torch.device("cpu"))
        link.start(worker, self.threads)
        self.link = link
        atexit.register(self.close)  # however the learner ends (a signal's exit skips Lightning's teardown)

    def publish(self, step: int, model: nn.Module) -> None:
        """The trained weights of ``model`` at the start of ``step``, as version ``step``."""
        assert self.slots is not None, "start() the worker first"
        self.slots.publish(step, named_trainable_parameters(model))

    def __call__(self, batch: Batch, io: PolicyIO, *, step: int, device: torch.device | None = None,
                 report: Callable[[list[float]], None] | None = None,
                 **_: Any) -> tuple[Rollout, dict[str, float]]:
        """As ``RolloutSource``'s: step ``step``'s rollout of ``batch``, from the worker, on ``device``;
        ``report`` receives its prompts' pass rates, as the worker measured them."""
        rollout, stats = self.take(step, batch, report)
        return (rollout if device is None else rollout_to(rollout, device)), stats

    def take(self, step: int, batch: Batch,
             report: Callable[[list[float]], None] | None = None) -> tuple[Rollout, dict[str, float]]:
        """Step ``step``'s rollout (waiting for the worker) and its statistics, staleness included. A worker
        lost while a stop is pending ends the run through ``stop_now`` (see :meth:`watch`)."""
        wait_start = time.perf_counter()
        try:
            item = self.receive(step)
        except SamplerLost as err:
            if self.stop_requested() and self.stop_now is not None:
                print(f"{err}; step {step} is dropped: the checkpoint is that of its start", file=sys.stderr,
                      flush=True)
                self.stop_now()
            raise
        if list(batch["prompt"]) != item.prompts:
            raise RuntimeError(f"asynchronous sampling: the worker's prompt batch for step {step} is not the "
                               "one the DataModule gave this step (the sampler reads the DataModule's prompt "
                               "stream ahead; a DataModule whose batches are not a pure function of the "
                               "batch index cannot be sampled ahead: set `model.sampling.max_staleness: 0`)")
        if report is not None and item.outcomes is not None:
            report(item.outcomes)
        staleness = float(step - item.version)
        return item.rollout, {**item.stats, "rollout/staleness_mean": staleness,
                              "rollout/staleness_max": staleness,
                              "perf/rollout_wait_time": time.perf_counter() - wait_start}

    def receive(self, step: int) -> Sampled:
        """The worker's rollout of ``step``: from those received ahead, else the next ones in order."""
        while step not in self.ready:
            if self.link is None:
                raise SamplerLost(f"the sampler worker is not running (step {step})")
            try:
                item = self.link.next_result(step)
            except SamplerLost:
                self.close()  # the link stopped it already
                raise
            if isinstance(item, Failed):
                self.close()
                raise SamplerLost(f"the sampler worker failed sampling step {item.step}: {item.message}")
            self.ready[item.step] = item
            self.refills = item.refills
        return self.ready.pop(step)

    def state_dict(self, next_step: int) -> dict[str, Any]:
        """The rollouts of steps ``next_step .. next_step + k - 1`` (their weight versions are published, so
        the worker finishes them) and the refill position after them; the next ones are sampled after a
        resume from the checkpoint's weights, as they would have been. With a stop pending, a worker lost
        on the way costs the rollouts it had not delivered (see the module docstring)."""
        ahead: list[Sampled] = []
        for step in range(next_step, next_step + self.lag):
            item = self.ready.get(step) or (self.kept(step) if self.running else None)
            if item is None:
                break
            ahead.append(item)
        return {"rollouts": [as_state(item) for item in ahead],
                "refills": ahead[-1].refills if ahead else self.refills}

    def kept(self, step: int) -> Sampled | None:
        """Step ``step``'s rollout, received and kept for its step; ``None`` if the worker is lost with a stop
        pending."""
        try:
            item = self.receive(step)
        except SamplerLost as err:
            if not self.stop_requested():
                raise
            print(f"{err}: the checkpoint holds the rollouts received before it", file=sys.stderr, flush=True)
            return None
        self.ready[step] = item
        return item

    def load_state_dict(self, state: dict[str, Any]) -> None:
        temperature = self.source.sampler.sampling.temperature
        self.restored = [from_state(item, temperature) for item in state.get("rollouts", [])]
        self.refills, self.loaded = int(state.get("refills", 0)), True

    def close(self) -> None:
        """Stop the worker (``WorkerLink.close``)."""
        link, self.link = self.link, None
        if link is not None:
            atexit.unregister(self.close)
            link.close()


def as_state(item: Sampled) -> dict[str, Any]:
    """A sampled-ahead rollout as plain types and tensors, for a checkpoint."""
    rollout = {f.name: getattr(item.rollout, f.name) for f in fields(Rollout)}
    return {"step": item.step, "version": item.version, "prompts": item.prompts, "rollout": rollout,
            "stats": dict(item.stats), "refills": item.refills, "outcomes": item.outcomes}


def from_state(state: dict[str, Any], temperature: float) -> Sampled:
    """A sampled-ahead rollout of a checkpoint. A field an older record had and this one has not (a frozen
    model's log-probs before ``Rollout.frozen_logp``) is left out: the learner's stage scores what is
    missing. A record from before rollouts carried their temperature was drawn at the run's
    ``temperature``."""
    names = {f.name for f in fields(Rollout)}
    saved = {"temperature": temperature, **state["rollout"]}
    rollout = Rollout(**{name: value for name, value in saved.items() if name in names})
    return Sampled(state["step"], state["version"], state["prompts"], rollout, state["stats"],
                   state["refills"], state.get("outcomes"))
