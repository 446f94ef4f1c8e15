"""Why a multi-process run stopped, said last: the failing rank's reason, not a peer's connection error.

When one rank fails (a reward function raises on rank 1 only), the others wait in a collective until its
sockets close, then fail with gloo's "Connection closed by peer"; rank 0, the process the user started,
prints last, so the real reason scrolled 100 lines up. Each rank that fails writes a one-line reason into a
folder shared by the ranks Lightning launches (rank 0 creates it and passes its path in the
environment, which the ranks it starts inherit); a rank whose own error is a lost connection waits a
little for a peer's reason and ends with it (``lightning-rl: error: rank 1 failed: ...``). Rank 0 waits
for the ranks it launched before it prints (and, failing first, stops those that only wait for it), so
its line stays the last one. Runs whose ranks another launcher starts (torchrun, SLURM) each keep their own
folder: every rank then prints its own error, as before.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

ENV = "LRL_RANK_REPORTS"
active: dict[str, Any] = {}  # the running trainer, set by the CLI: its launcher knows the ranks it started
# words of a collective that failed because another rank went away (gloo, NCCL, torch.distributed)
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistBackendError",
             "DistNetworkError", "NCCL communicator was aborted", "Socket Timeout", "connection refused")


def one_line(err: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def lost_a_peer(err: BaseException) -> bool:
    """Whether ``err`` (or an error it came from) is a collective failing because another rank is gone."""
    seen: BaseException | None = err
    for _ in range(8):
        if seen is None:
            return False
        text = f"{type(seen).__name__}: {seen}"
        if any(words.lower() in text.lower() for words in LOST_PEER):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def global_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (ImportError, RuntimeError):
        pass
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


class RankReports:
    """The reasons ranks failed, one file per rank in a folder the ranks share (see the module docstring).

    The process started by the user (no ``LOCAL_RANK`` / ``RANK`` in its environment) creates the folder and
    removes it at :meth:`close`; ranks it launches find its path in ``LRL_RANK_REPORTS``.
    """

    def __init__(self) -> None:
        self.folder = os.environ.get(ENV)
        self.owner = False
        if self.folder is None and "LOCAL_RANK" not in os.environ and "RANK" not in os.environ:
            self.folder = tempfile.mkdtemp(prefix="lightning-rl-ranks-")
            os.environ[ENV] = self.folder  # inherited by the ranks Lightning starts
            self.owner = True

    def write(self, reason: str) -> None:
        """This rank's reason (best effort: a report must never hide the error itself)."""
        if self.folder is None:
            return
        path = os.path.join(self.folder, f"rank{global_rank()}")
        try:
            with open(f"{path}.tmp", "w") as f:
                f.write(reason)
            os.replace(f"{path}.tmp", path)
        except OSError:
            pass

    def peer_reason(self, wait_s: float) -> tuple[int, str] | None:
        """The lowest other rank's reason, waiting up to ``wait_s`` seconds for one to appear."""
        if self.folder is None:
            return None
        mine, deadline = global_rank(), time.monotonic() + wait_s
        while True:
            try:
                names = sorted(n for n in os.listdir(self.folder) if n.startswith("rank") and n[4:].isdigit())
            except OSError:
                return None
            for name in names:
                if int(name[4:]) != mine:
                    try:
                        with open(os.path.join(self.folder, name)) as f:
                            return int(name[4:]), f.read().strip()
                    except OSError:
                        continue
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def close(self) -> None:
        if self.owner:
            os.environ.pop(ENV, None)
            shutil.rmtree(self.folder, ignore_errors=True)


def stop_other_ranks(trainer: Any, grace_s: float) -> None:
    """In the process that launched the other ranks, after it failed: give them ``grace_s`` seconds to
    exit on their own (a rank that failed first is exiting), then kill those still waiting in a
    collective for this one (their only words would be a lost connection), so that what this process
    prints comes last. Lightning does the same on Ctrl-C."""
    launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
    procs = list(getattr(launcher, "procs", None) or [])
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
