"""Forked workers (``lightning_rl.step.forking``, used by ``lightning_rl.step.workers`` and the asynchronous
sampler): a child can run 2-thread torch code after its parent did (a fork from a thread that ran OpenMP
regions hangs in GNU libgomp), outlives the thread that asked for it but not its parent, reports its exit
code to its owner, and a signal it receives never reaches the parent's signal wakeup descriptor."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers import gone

from lightning_rl.step import forking
from lightning_rl.step.worker_pool import WorkerPool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parallel_ops() -> tuple[int, float, float]:
    """Torch's thread count and two results that need parallel regions on 2 threads: ``ones @ ones / 256``
    stays all ones (a 256 x 256 matmul, three times), and the sum of 2**20 ones."""
    a = torch.ones(256, 256)
    for _ in range(3):
        a = (a @ a) / 256
    return torch.get_num_threads(), float(a[0, 0]), float(torch.ones(1 << 20).exp().log().sum())


def my_pid() -> int:
    return os.getpid()


@pytest.fixture
def two_threads():
    """Two torch threads in this process, after running parallel regions on them (the state a trainer is
    in when it forks a worker); one again afterwards (tests/conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    assert parallel_ops() == (2, 1.0, float(1 << 20))
    yield
    torch.set_num_threads(before)


def test_a_reward_worker_runs_two_thread_torch_code_after_its_parent_did(two_threads):
    """A worker forked from the thread that ran the parent's 2-thread regions would hang in its first one
    (the call would time out); forked from a fresh thread it gets the parent's 2 threads and finishes."""
    pool = WorkerPool()
    try:
        assert pool.call(parallel_ops, (), {}, timeout=60) == (2, 1.0, float(1 << 20))
    finally:
        pool.close()


def test_a_child_runs_the_threads_it_is_given(two_threads):
    reader, writer = os.pipe()

    def body() -> None:
        os.write(writer, repr(parallel_ops()).encode())

    child = forking.fork(body, threads=3)
    child.join(60)
    os.close(writer)
    assert os.read(reader, 200).decode() == repr((3, 1.0, float(1 << 20)))
    os.close(reader)
    assert child.exitcode == 0


def test_a_worker_outlives_the_thread_that_asked_for_it():
    """``PR_SET_PDEATHSIG`` fires when the *thread* that forked a child ends: a worker forked by a thread
    that called it and has since ended (a reward batch's thread) is still there to serve calls (its keeper
    thread lives as long as it does)."""
    pool, box = WorkerPool(), []

    def ask() -> None:
        worker = pool.acquire(-1)
        worker.start(my_pid, (), {})
        box.append((worker, worker.result(timeout=30)))

    try:
        asking = threading.Thread(target=ask)
        asking.start()
        asking.join()
        time.sleep(0.3)  # time for a death signal to arrive, were there one
        ((worker, pid),) = box
        worker.start(my_pid, (), {})
        assert worker.result(timeout=30) == pid == worker.pid
    finally:
        pool.close()


def test_the_owner_reads_the_exit_code_and_kills_once():
    exits = forking.fork(lambda: sys.exit(3))
    exits.join(30)
    assert not exits.is_alive() and exits.exitcode == 3
    raises = forking.fork(lambda: 1 / 0)
    raises.join(30)
    assert raises.exitcode == 1
    sleeps = forking.fork(lambda: time.sleep(60))
    assert sleeps.is_alive() and sleeps.exitcode is None
    sleeps.kill()
    sleeps.join(30)
    assert sleeps.exitcode == -signal.SIGKILL and gone(sleeps.pid)
    sleeps.kill()  # reaped: its pid is never signalled again


def test_a_signal_to_the_child_does_not_reach_the_parents_wakeup_descriptor():
    """The interrupt callback counts signals through Python's wakeup descriptor: a child that inherited it
    would make a signal it receives (a process group's SIGTERM) read as a second one to the trainer. The
    child below keeps the parent's SIGUSR1 handler and signals itself; the parent's descriptor stays empty,
    and the child's SIGINT is ignored as asked."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    reader.setblocking(False)
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)

    def body() -> None:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)

    try:
        child = forking.fork(body, handlers={signal.SIGINT: signal.SIG_IGN})
        child.join(30)
        assert child.exitcode == 0
        with pytest.raises(BlockingIOError):
            reader.recv(16)
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGUSR1, previous)
        reader.close()
        writer.close()


ORPHANS = textwrap.dedent("""
    import os, sys, threading, time
    from lightning_rl.step import forking
    from lightning_rl.step.worker_pool import WorkerPool
    pool = WorkerPool()
    box = []
    t = threading.Thread(target=lambda: box.append(pool.acquire(-1)))
    t.start(); t.join()
    busy = pool.start(time.sleep, (600,), {})  # a worker in the middle of a call
    child = forking.fork(lambda: time.sleep(600))
    print(box[0].pid, busy.pid, child.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_workers_die_with_their_parent():
    """SIGKILL to the parent (nothing of it runs after): an idle worker, one in the middle of a call and a
    plain forked child are all gone within seconds."""
    proc = subprocess.Popen([sys.executable, "-c", ORPHANS], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 3 and all(not gone(p) for p in pids)
    finally:
        proc.kill()
        proc.wait(30)
    for _ in range(100):
        if all(gone(p) for p in pids):
            break
        time.sleep(0.1)
    assert [p for p in pids if not gone(p)] == []
