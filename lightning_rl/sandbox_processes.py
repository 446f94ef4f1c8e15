"""The trainer's control of a sandboxed run's processes (:mod:`lightning_rl.sandbox`): a pids cgroup
that caps and then kills every process of the run, the count of a user's tasks that ``RLIMIT_NPROC``
compares against, waiting for the child with a pidfd, and the kill of its process group and of its PID
namespace (whose first process's end ends every process in it)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
import uuid
from pathlib import Path

CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")


def wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` exits (left unreaped) or ``deadline`` passes; whether it exited. A pidfd wakes up
    at the exit (polling every 10 ms where the kernel has none)."""
    with contextlib.suppress(OSError):
        fd = os.pidfd_open(pid)
        try:
            select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        finally:
            os.close(fd)
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.01)
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def wait_gone(pid: int, seconds: float = 2.0) -> None:
    """SIGKILL ``pid`` (killed already with its group, unless it left it) and wait until it is gone or a
    zombie (its parent, now the host's init, reaps it)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.005)


def kill_all(pid: int, cgroup: Path | None) -> None:
    """SIGKILL the process group ``pid`` and, until it is empty, every process in ``cgroup``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for _ in range(100) if cgroup else ():
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split() if int(p) != pid]
        if not pids:
            return
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        time.sleep(0.01)


def make_cgroup(max_processes: int) -> Path | None:
    """A fresh pids cgroup holding at most ``max_processes`` processes, or None where none can be made."""
    for root in CGROUP_ROOTS:
        path = Path(root) / f"lightning-rl-sandbox-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
        except OSError:
            continue
        try:
            (path / "pids.max").write_text(str(max_processes))
            return path
        except OSError:
            remove_cgroup(path)
    return None


def remove_cgroup(path: Path) -> None:
    """Remove an (empty) cgroup; its last processes may take a moment to be released."""
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def user_processes(uid: int) -> int:
    """How many tasks (threads: what ``RLIMIT_NPROC`` counts) the user ``uid`` runs, by real uid."""
    count = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):  # a process that ended meanwhile
            lines = (line.split(":", 1) for line in (p / "status").read_text().splitlines())
            fields = {pair[0]: pair[1] for pair in lines if len(pair) == 2}
            count += int(fields["Uid"].split()[0]) == uid and int(fields["Threads"])
    return count
