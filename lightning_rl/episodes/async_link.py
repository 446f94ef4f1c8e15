"""The learner's link to the running sampler worker of asynchronous sampling
(:mod:`lightning_rl.episodes.async_source`): how it starts, how its messages are read, how its silence is
judged and how it stops. The learner never waits blindly:

* the worker is a child of the rank's process forked from a fresh thread (:func:`~lightning_rl.step.forking.
  fork`: its ``model.sampling.worker_threads`` OpenMP threads work whatever the learner ran, and the kernel
  kills it when the learner's process ends, however it ends), or a daemon thread of it;
* a worker's failure is an error naming the step and the worker's exception; a worker that dies is reported
  with its exit code;
* a worker that reports no progress (:class:`~lightning_rl.episodes.async_worker.Progress`: every phase
  change, every generation call, every poll while it waits for weights) for ``model.sampling.worker_timeout``
  seconds while the learner waits for it is *stalled*: it is killed (a thread is abandoned) and the run stops
  with one line naming it (process pid or thread), the phase it was stuck in and the step the learner waited
  for. The limit is on silence within one phase, not on a step: a slow step whose phases each report in time
  is not a stall; one generation or one reward call longer than the limit is.
* once a stop is requested (Ctrl-C / SIGTERM, seen through ``AsyncRollouts.watch``), the patience is
  ``STOP_PATIENCE`` seconds of silence after the request (or the timeout, if shorter): a working worker still
  finishes its step, a silent one is given up (what the learner does then: ``async_source``).
"""

from __future__ import annotations

import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch.multiprocessing as mp

from lightning_rl.episodes.async_worker import (
    POLL_SECONDS,
    Failed,
    Progress,
    Sampled,
    SamplerWorker,
    run_worker,
)
from lightning_rl.step import forking

STOP_SECONDS = 30  # a worker's own stop (a vLLM engine it started shuts down in ~5 s) before it is killed
STOP_PATIENCE = 10.0  # after a stop request: seconds of silence before the worker is given up
# a process worker: the learner saves, then stops it (a signal to the process group reaches it too)
WORKER_SIGNALS = {signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_IGN}


class SamplerLost(RuntimeError):
    """The worker will not deliver: it failed, exited or stalled (and was stopped)."""


class WorkerLink:
    """The channels of one worker (create, build the :class:`SamplerWorker` with them, then :meth:`start` it).

    Args:
        thread: a thread of this process rather than a forked one.
        timeout: seconds of silence before a worker the learner waits for is stalled (``None``: no limit).
        stop_requested: whether a stop (Ctrl-C / SIGTERM) is pending.
    """

    def __init__(self, thread: bool, timeout: float | None, stop_requested: Callable[[], bool]) -> None:
        self.context = None if thread else mp.get_context("fork")  # also the weight slots'
        if self.context is None:
            self.results = self.sender = queue.SimpleQueue()
            self.stop: Any = SimpleNamespace(value=0)
        else:
            self.results, self.sender = self.context.Pipe(duplex=False)
            self.stop = self.context.Value("b", 0, lock=False)
        self.progress = Progress(self.context)
        self.timeout, self.stop_requested = timeout, stop_requested
        self.stop_seen: float | None = None  # when the learner first saw the stop request
        self.process: Any = None

    def start(self, worker: SamplerWorker, threads: int) -> None:
        """Run ``worker``: in a thread, or in a child forked with ``threads`` torch threads."""
        if self.context is None:
            self.process = threading.Thread(target=run_worker, args=(worker,), daemon=True,
                                            name="lightning-rl-sampler")
            self.process.start()
            return
        self.process = forking.fork(partial(run_worker, worker), threads=threads, handlers=WORKER_SIGNALS,
                                    name="lightning-rl-sampler")
        self.sender.close()  # the worker's end alone: its exit, even mid-message, reads as end of file here

    def name(self) -> str:
        if isinstance(self.process, threading.Thread):
            return f"thread {self.process.name}"
        return f"process {self.process.pid}"

    def next_result(self, step: int) -> Sampled | Failed:
        """The worker's next message; its exit (killed, even in the middle of a message) or its silence
        (:meth:`check_progress`) raises :class:`SamplerLost`, the worker stopped, never a wait."""
        if self.process is None:
            raise SamplerLost(f"the sampler worker is not running (step {step})")
        while True:
            try:
                message = self.poll()
            except (EOFError, OSError):  # its end of the pipe closed, or its tensors went with it
                raise self.exited(step) from None
            if message is not None:
                return message
            if not self.process.is_alive() and self.drained():
                raise self.exited(step)
            self.check_progress(step)

    def poll(self) -> Sampled | Failed | None:
        """The worker's next message if one arrives within ``POLL_SECONDS``."""
        if self.context is None:
            try:
                return self.results.get(timeout=POLL_SECONDS)
            except queue.Empty:
                return None
        return pickle.loads(self.results.recv_bytes()) if self.results.poll(POLL_SECONDS) else None

    def drained(self) -> bool:
        """Nothing left to read from a worker that ended (a process's pipe reads end of file instead)."""
        return self.context is not None or self.results.empty()

    def exited(self, step: int) -> SamplerLost:
        process = self.process
        self.close()
        if self.context is None:
            return SamplerLost(f"the sampler thread stopped before step {step}'s rollout")
        return SamplerLost(f"the sampler worker exited (code {process.exitcode}) before step {step}'s "
                           "rollout")

    def check_progress(self, step: int) -> None:
        """Raise :class:`SamplerLost` for a worker silent past ``timeout`` (``STOP_PATIENCE`` once a stop
        is pending), after stopping it."""
        limit, silent = self.timeout, self.progress.silent_for()
        if self.stop_requested():
            self.stop_seen = self.stop_seen or time.monotonic()
            silent = min(silent, time.monotonic() - self.stop_seen)
            limit = STOP_PATIENCE if limit is None else min(limit, STOP_PATIENCE)
        if limit is None or silent <= limit:
            return
        who, doing = self.name(), self.progress.describe()
        why = ("after a stop request" if self.stop_seen is not None
               else f"(`model.sampling.worker_timeout`: {self.timeout:g} s)")
        self.close(stalled=True)
        raise SamplerLost(f"the sampler worker ({who}) stalled: no progress for {silent:.1f} s {why} while "
                          f"{doing}, as the learner waited for step {step}'s rollout")

    def close(self, stalled: bool = False) -> None:
        """Stop the worker: it checks between rollouts and while it waits, then stops what it started (a vLLM
        engine); killed after ``STOP_SECONDS``, or at once when ``stalled``. A thread cannot be killed: a
        daemon, it is left to end with the process. A process is reaped (its ``exitcode`` set)."""
        process = self.process
        if process is None:
            return
        self.process = None
        self.stop.value = 1
        if not stalled:
            process.join(timeout=STOP_SECONDS)
        if self.context is not None:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
