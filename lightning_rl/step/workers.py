"""Calls that can be stopped: user code (tools, reward functions) in forked worker processes that are killed
on timeout (a batch's reward functions at once: :func:`lightning_rl.step.rewards.run_all`).

A :class:`ProcessWorker` is a child forked from this process (:func:`lightning_rl.step.forking.fork`: from a
fresh thread) that runs one call at a time. The function is inherited at fork (:func:`register` it first, so
closures and test-local functions work too); the arguments and the result travel by pipe, pickled. A call
past its timeout costs the worker: it is killed with SIGKILL and reaped, so a function stuck in C code that
holds the GIL (a catastrophic regex) is stopped too, and no thread is left behind. A worker dies with its
parent: ``PR_SET_PDEATHSIG`` (SIGKILL when this process ends, even mid-call; the keeper thread that forked
it lives as long as it does, whichever thread asked for it), pipe EOF and a parent-pid check every second.
It is not daemonic: what it calls may start processes of its own. The pool that keeps a few idle workers
for reuse, and counts what happened to the others, is :mod:`lightning_rl.step.worker_pool`.

**Threads.** A worker gets the torch intra-op thread count of the thread that asked for it
(``torch.get_num_threads()`` there, when torch is imported) and a fresh OpenMP runtime: a reward function or
tool may run parallel torch code even after the trainer did (a child forked from a thread that ran OpenMP
regions would hang in its first one). Several workers run at once (one per isolated function of a batch), so
a function that needs few threads may set ``torch.set_num_threads`` itself.

Forking copies nothing up front (copy-on-write) and costs ~20 ms in a process that holds torch; a call costs a
pipe round trip (~0.1 ms) plus pickling. The child must not touch CUDA or the parent's process groups.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable
from typing import Any

from lightning_rl.step import forking

# the worker's signals (SIGTERM ends it; Ctrl-C goes to the parent, which kills its workers)
HANDLERS = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.SIG_IGN}
REGISTRY: list[Callable[..., Any]] = []  # functions a worker can call, by key; a worker knows those before it
_KEYS: dict[int, int] = {}  # id(fn) -> key (the function is held in REGISTRY, so its id is never reused)
_REGISTER = threading.Lock()


def register(fn: Callable[..., Any]) -> int:
    """The key that names ``fn`` to workers (the same key for the same object)."""
    with _REGISTER:
        key = _KEYS.get(id(fn))
        if key is None:
            key = _KEYS[id(fn)] = len(REGISTRY)
            REGISTRY.append(fn)
        return key


def target(fn: Callable[..., Any]) -> Callable[..., Any] | int:
    """How a call names ``fn`` to a worker: a module-level function or builtin is sent by reference (pickled
    as module and name: any worker finds it), anything else by its ``register`` key (only workers forked
    after it was registered know it)."""
    if inspect.isfunction(fn) or inspect.isbuiltin(fn):
        try:
            pickle.dumps(fn)
            return fn
        except Exception:  # noqa: BLE001 - a closure, a lambda, a function shadowed under its name
            pass
    return register(fn)


class CallTimedOut(TimeoutError):
    """The call did not come back in time; its worker was killed."""


class WorkerDied(RuntimeError):
    """The worker process ended during the call (the function exited it, or it was killed)."""


class CallRaised(RuntimeError):
    """The function raised in the worker: ``kind`` is the exception's type name, the message its text."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def describe(err: BaseException) -> str:
    """``Type: message`` (``Type`` alone when the message is empty) of an exception, local or remote."""
    kind = err.kind if isinstance(err, CallRaised) else type(err).__name__
    try:
        text = str(err)
    except Exception:  # noqa: BLE001 - a __str__ that raises
        text = ""
    return f"{kind}: {text}" if text else kind


# ------------------------------------------------------------------------------------------- the child
def _run(fn: Callable[..., Any] | int, post: Callable[[Any], Any] | None, args: tuple, kwargs: dict) -> tuple:
    """``("ok", value)`` or ``("raised", type name, message)`` of one call (awaited if it is a coroutine)."""
    try:
        value = (REGISTRY[fn] if isinstance(fn, int) else fn)(*args, **kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(awaited(value))
        return ("ok", post(value) if post is not None else value)
    except BaseException as err:  # noqa: B036 - a SystemExit or KeyboardInterrupt in user code is its error
        return ("raised", type(err).__name__, describe(err).partition(": ")[2])


async def awaited(awaitable: Any) -> Any:
    return await awaitable


def _serve(conn: Any, parent: int) -> None:
    """The worker's loop: one request at a time until the parent goes away (set up by :func:`forking.fork`:
    SIGTERM ends it, SIGINT goes to the parent, which kills its workers)."""
    while True:
        while not conn.poll(1.0):
            if os.getppid() != parent:
                return
        try:
            fn, post, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        except Exception as err:  # noqa: BLE001 - a function that cannot be found here
            conn.send(("raised", type(err).__name__, describe(err).partition(": ")[2]))
            continue
        reply = _run(fn, post, args, kwargs)
        try:
            conn.send(reply)
        except Exception as err:  # noqa: BLE001 - an unpicklable result
            conn.send(("raised", type(err).__name__, f"the result could not be sent back: {describe(err)}"))


# ------------------------------------------------------------------------------------------ the parent
class ProcessWorker:
    """One forked child that runs registered functions, one call at a time."""

    def __init__(self) -> None:
        parent, (mine, theirs) = os.getpid(), multiprocessing.Pipe()
        self.known = len(REGISTRY)  # keys below this were inherited

        def serve() -> None:
            mine.close()
            _serve(theirs, parent)

        self.process = forking.fork(serve, handlers=HANDLERS, name="lightning-rl-worker")
        theirs.close()
        self.pid, self.conn, self.done = self.process.pid, mine, False

    def start(self, fn: Callable[..., Any] | int, args: tuple, kwargs: dict,
              post: Callable[[Any], Any] | None = None) -> None:
        """Send one call of ``fn`` (``target(fn)``); ``post``, a module-level function, is applied to its
        value in the worker."""
        try:
            self.conn.send((fn, post, args, kwargs))
        except (BrokenPipeError, ConnectionError, EOFError) as err:
            raise WorkerDied(f"the worker process had ended ({self.ended()})") from err

    def result(self, timeout: float | None) -> Any:
        """The value of the call sent, waiting at most ``timeout`` seconds (``None``: no limit).

        Raises:
            CallTimedOut: no answer in time; the worker is killed. WorkerDied: it ended during the call.
            CallRaised: the function raised (the worker is fine).
        """
        if not self.conn.poll(None if timeout is None else max(timeout, 0.0)):
            self.kill()
            raise CallTimedOut(f"timed out after {float(timeout or 0.0)} s")
        try:
            reply = self.conn.recv()
        except (EOFError, OSError) as err:
            raise WorkerDied(f"ended the worker process ({self.ended()})") from err
        if reply[0] == "raised":
            raise CallRaised(reply[1], reply[2])
        return reply[1]

    def alive(self) -> bool:
        if self.done:
            return False
        if self.process.is_alive():
            return True
        self.done = True
        self.conn.close()
        self.process.join()
        return False

    def ended(self) -> str:
        """Reap the worker and say how it ended (``exit code 3``, ``signal 9``)."""
        self.conn.close()
        if self.done:
            return "already reaped"
        self.done = True
        self.process.join()
        code = self.process.exitcode
        if code is None:
            return "already reaped"
        return f"signal {-code}" if code < 0 else f"exit code {code}"

    def kill(self) -> None:
        """SIGKILL and reap the worker (once: a reaped pid may belong to another process by now)."""
        if not self.done:
            self.process.kill()
        self.ended()
