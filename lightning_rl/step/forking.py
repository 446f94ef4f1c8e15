"""Forked workers that can run parallel torch code and die with their parent: the one way this package forks
(the asynchronous sampler's process, :mod:`lightning_rl.step.workers`' reward and tool workers).

**OpenMP.** GNU libgomp (the OpenMP runtime of torch's CPU builds) keeps its thread pool per thread. A child
forked from a thread that ran a parallel region inherits that thread's pool state but not the pool's
threads, and its first parallel region waits for them forever. A thread that never ran one has a clean
state, so :func:`fork` forks from a fresh *keeper* thread: the child's only thread is a copy of it and may
start its own team of ``threads`` intra-op threads (set in the child: ``torch.set_num_threads``).

**Death with the parent.** The child sets ``PR_SET_PDEATHSIG`` right after the fork (SIGKILL by default),
then checks that its parent is still the process that forked it (it may have died before the ``prctl``).
The kernel sends that signal when the *thread* that forked the child ends, so the keeper lives exactly as
long as the child: it waits for the child's exit without reaping it (``waitid(WNOWAIT)``) and ends then.
It is a daemon thread: the parent's exit (any exit: a crash, ``os._exit``, SIGKILL) ends it, and with it
the child. The owner reaps the child (:meth:`Forked.join`) and reads its exit code.

**Signals.** The keeper blocks SIGINT and SIGTERM around the fork, so the child starts with them blocked; it
drops the parent's signal wakeup descriptor (a signal to the child must not count as one to the parent),
installs ``handlers`` and only then unblocks them. The child runs ``body()`` and leaves with ``os._exit``
(0, the ``SystemExit`` code, or 1 after printing an exception): none of the parent's ``atexit`` handlers or
finalisers run in it.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

PR_SET_PDEATHSIG = 1
BLOCKED = {signal.SIGINT, signal.SIGTERM}


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """In a forked child: receive ``signum`` when the parent thread that forked it ends (Linux); exit at once
    if ``parent`` is already gone."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum))
    except (OSError, AttributeError):  # not Linux: the owner's own checks (getppid, pipe EOF) remain
        pass
    if os.getppid() != parent:  # the parent ended before prctl
        os._exit(0)


def parent_threads() -> int | None:
    """The caller's torch intra-op thread count (``None`` when torch is not imported: nothing to set)."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.get_num_threads()


class Forked:
    """A child started by :func:`fork`, with the part of ``multiprocessing.Process`` its owners use."""

    def __init__(self, pid: int, keeper: threading.Thread) -> None:
        self.pid, self.keeper = pid, keeper
        self.exitcode: int | None = None  # after join: negative for the signal that ended it
        self._reaped = False
        self._lock = threading.Lock()

    def is_alive(self) -> bool:
        return self.keeper.is_alive()  # the keeper returns when the child exits

    def join(self, timeout: float | None = None) -> None:
        """Wait at most ``timeout`` seconds for the child's exit; reap it once it has exited."""
        self.keeper.join(timeout)
        if not self.keeper.is_alive():
            self._reap()

    def _reap(self) -> None:
        with self._lock:
            if self._reaped:
                return
            self._reaped = True
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:  # reaped by someone else: the exit code is lost
                return
            self.exitcode = os.waitstatus_to_exitcode(status)

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Send ``signum`` (a reaped pid is never signalled: it may belong to another process by now)."""
        with self._lock:
            if self._reaped:
                return
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass


def fork(body: Callable[[], Any], *, threads: int | None = None, death_signal: int = signal.SIGKILL,
         handlers: Mapping[int, Any] | None = None, name: str = "lightning-rl-fork") -> Forked:
    """Run ``body()`` in a child forked from a fresh keeper thread (see the module docstring).

    Args:
        body: what the child runs; it never returns into the caller's stack.
        threads: torch intra-op threads of the child (``None``: the caller's ``torch.get_num_threads()``,
            if torch is imported).
        death_signal: what the child receives when this process ends.
        handlers: signal dispositions set in the child before SIGINT / SIGTERM are unblocked (the others
            keep the parent's).
        name: the keeper thread's name.
    """
    parent, threads = os.getpid(), parent_threads() if threads is None else threads
    started: queue.SimpleQueue = queue.SimpleQueue()

    def keep() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)  # this thread only: the parent's others take them
        try:
            pid = os.fork()
        except OSError as err:
            started.put(err)
            return
        if pid == 0:
            child(body, parent, threads, death_signal, handlers or {})
        started.put(pid)
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere
            pass

    keeper = threading.Thread(target=keep, name=name, daemon=True)
    keeper.start()
    pid = started.get()
    if isinstance(pid, BaseException):
        raise pid
    return Forked(pid, keeper)


def child(body: Callable[[], Any], parent: int, threads: int | None, death_signal: int,
          handlers: Mapping[int, Any]) -> None:
    """The forked child: dies with its parent, sets its threads and signals, runs ``body``, exits."""
    code = 1
    try:
        die_with_parent(parent, death_signal)
        signal.set_wakeup_fd(-1)  # the parent's: a byte there would read as a signal to the parent
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        body()
        code = 0
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's last word, then its exit code says it failed
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream
                pass
        os._exit(code)
