"""The pool of worker processes (:class:`WorkerPool`): calls are sent to idle workers of
:mod:`lightning_rl.step.workers`, kept for reuse (a few at most) while they answer, and the workers a call
cost (timed out, died, interrupted) are killed and counted; :data:`WORKERS` is this process's pool.

Every worker the pool started is killed at exit (:func:`atexit.register`); :func:`os.register_at_fork` clears
the pool in any forked child, whose workers are the parent's (the asynchronous sampler's process starts its
own).
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_rl.step.workers import CallRaised, CallTimedOut, ProcessWorker, WorkerDied, target


@dataclass
class WorkerPool:
    """Idle workers kept for reuse (at most ``max_idle``) and what happened to the others."""

    max_idle: int = 4
    idle: list[ProcessWorker] = field(default_factory=list)
    live: dict[int, ProcessWorker] = field(default_factory=dict)  # pid -> every worker not yet killed
    started: int = 0  # workers forked
    timeouts: int = 0  # calls that timed out (each cost a worker)
    deaths: int = 0  # workers that ended during a call
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire(self, key: int) -> ProcessWorker:
        """An idle worker that knows ``key`` (-1: any), else a new one (a worker forked before ``key`` was
        registered is replaced)."""
        stale = []
        with self.lock:
            worker = None
            while self.idle and worker is None:
                candidate = self.idle.pop()
                if candidate.known > key and candidate.alive():
                    worker = candidate
                else:
                    stale.append(candidate)
        for old in stale:
            self.drop(old)
        if worker is None:
            worker = ProcessWorker()
            with self.lock:
                self.started += 1
                self.live[worker.pid] = worker
        return worker

    def release(self, worker: ProcessWorker) -> None:
        """Keep a worker that answered for the next call, or end it when enough are idle."""
        with self.lock:
            if len(self.idle) < self.max_idle:
                self.idle.append(worker)
                return
        self.drop(worker)

    def drop(self, worker: ProcessWorker) -> None:
        worker.kill()
        with self.lock:
            self.live.pop(worker.pid, None)

    def call(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float | None,
             post: Callable[[Any], Any] | None = None) -> Any:
        """``post(fn(*args, **kwargs))`` in a worker within ``timeout`` seconds; raises as ``result``."""
        pending = self.start(fn, args, kwargs, post)
        return self.finish(pending, timeout)

    def start(self, fn: Callable[..., Any], args: tuple, kwargs: dict,
              post: Callable[[Any], Any] | None = None) -> ProcessWorker:
        """Send a call to a worker; :meth:`finish` waits for it."""
        name = target(fn)
        worker = self.acquire(name if isinstance(name, int) else -1)
        try:
            worker.start(name, args, kwargs, post)
        except WorkerDied:
            self.drop(worker)
            raise
        except Exception:  # arguments that cannot be pickled (nothing was sent): the worker is still idle
            self.release(worker)
            raise
        except BaseException:  # interrupted mid-send
            self.drop(worker)
            raise
        return worker

    def finish(self, worker: ProcessWorker, timeout: float | None) -> Any:
        """The value of the call sent to ``worker`` (raises as ``ProcessWorker.result``); the worker is kept
        for reuse unless the call timed out, ended it, or was interrupted."""
        try:
            value = worker.result(timeout)
        except CallRaised:
            self.release(worker)
            raise
        except (CallTimedOut, WorkerDied) as err:
            with self.lock:
                self.timeouts += isinstance(err, CallTimedOut)
                self.deaths += isinstance(err, WorkerDied)
            self.drop(worker)
            raise
        except BaseException:  # interrupted while waiting (KeyboardInterrupt): the call is abandoned
            self.drop(worker)
            raise
        self.release(worker)
        return value

    def close(self) -> None:
        """Kill every worker this process started (at exit)."""
        with self.lock:
            workers, self.idle, self.live = list(self.live.values()), [], {}
        for worker in workers:
            worker.kill()

    def forget(self) -> None:
        """In a forked child: the workers are the parent's; close their pipes here, keep none."""
        for worker in self.live.values():
            worker.conn.close()
        self.idle, self.live, self.lock = [], {}, threading.Lock()
        self.started = self.timeouts = self.deaths = 0


WORKERS = WorkerPool()
atexit.register(WORKERS.close)
os.register_at_fork(after_in_child=WORKERS.forget)
