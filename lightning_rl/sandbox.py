"""Model-written Python run in a sandbox: ``run_python``, the built-in tool ``python`` and the reward
``code_tests`` (``lightning_rl.sandbox:python``, ``lightning_rl.sandbox:code_tests``).

The code runs in a child interpreter (:mod:`lightning_rl.sandbox_child` run as ``python -I -S``: the
standard library only) in a fresh temporary folder, removed afterwards, with only ``PATH``, ``HOME`` (the
folder) and ``LANG`` in its environment. What contains what:

- kernel limits (``setrlimit``): CPU seconds, address space, the size of any file written (stdout and
  stderr included, so a flood of output stops too).
- a wall-clock timeout: the process group is killed (``SIGKILL``), and every process of the run's cgroup
  where there is one (a child that left the group with ``setsid`` too; without a cgroup it survives).
- processes: a fresh cgroup with ``pids.max`` where one can be made (root, cgroup v1 ``pids`` or a
  writable v2 hierarchy); else, for a user who is not root, ``RLIMIT_NPROC`` set to the processes the user
  already runs plus ``max_processes`` (the kernel counts the user's processes, not the run's); root
  without a cgroup has only the audit hook (the kernel ignores ``RLIMIT_NPROC`` for root).
- network: a new network namespace, in which no interface is up (``unshare(CLONE_NEWNET)`` as root,
  ``CLONE_NEWUSER|CLONE_NEWNET`` otherwise); where the kernel refuses both, only the audit hook refuses
  sockets. ``SandboxResult.network`` and ``.processes`` say which layer a run had.
- an audit hook (``sys.addaudithook``) refuses sockets, ``os.system``, ``subprocess``, ``exec``/``spawn``/
  ``fork``, signals, ``ctypes``, native modules from outside the standard library, writing, renaming or
  removing outside the folder, and reading outside the folder, the standard library and a few devices.
  It is a Python-level layer, not a kernel boundary (Python's documentation says as much).

Not contained by the kernel: the child runs as the caller's user (as root here), so only the hook (and file
permissions, for a user who is not root) keeps writes outside the folder; the disk space of many files
under the size limit is bounded only by time; the run shares the machine's CPUs and disk bandwidth.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_rl.sandbox_child import NETNS_NOTE

CHILD = str(Path(__file__).with_name("sandbox_child.py"))  # run as a script: imports nothing of ours
CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")
# the last stderr line of an error, and the limit it means (a signal, or an error the limit raises)
LIMIT_ERRORS = (("MemoryError", "memory"), ("File too large", "file_size"),
                ("Resource temporarily unavailable", "processes"), ("sandbox refused", "refused"))
TEST_TIMEOUT = 5.0
WORKERS = 4


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run gave.

    Attributes:
        stdout, stderr: the output, cut to ``output_limit`` characters (a cut ends with ``[... cut]``).
        exit_code: the child's exit status; ``-N`` when signal N ended it.
        timed_out: the wall-clock timeout ran out and the process group was killed.
        limit: what stopped it: ``timeout``, ``cpu``, ``memory``, ``file_size``, ``processes``, ``refused``
            (the audit hook refused an operation), or None (exited by itself, maybe with an error).
        reason: the same in words, with the error line; ``""`` when it ran to a clean exit.
        wall_time: seconds from start to the end of the child.
        network: ``namespace`` (no network device) or ``audit hook`` (sockets refused in Python only).
        processes: ``cgroup`` (pids.max), ``rlimit`` (RLIMIT_NPROC) or ``audit hook`` (fork refused only).
    """

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    limit: str | None
    reason: str
    wall_time: float
    network: str
    processes: str

    @property
    def ok(self) -> bool:
        """It exited with status 0 and no limit stopped it."""
        return self.exit_code == 0 and self.limit is None


def run_python(code: str, *, timeout: float = 5.0, cpu_seconds: int | None = None, memory_mb: int = 512,
               file_size_mb: int = 16, max_processes: int = 16, output_limit: int = 10_000,
               stdin: str = "", audit: bool = True) -> SandboxResult:
    """Run ``code`` in a sandboxed child interpreter and wait for it, at most ``timeout`` seconds.

    Args:
        code: Python source, run as ``__main__`` from ``main.py`` in a fresh temporary folder.
        timeout: wall-clock seconds before the whole process group is killed.
        cpu_seconds: CPU-time limit (``RLIMIT_CPU``); default ``int(timeout) + 2``, so the wall clock decides.
        memory_mb: address-space limit (``RLIMIT_AS``) of each process.
        file_size_mb: largest file any process may write (``RLIMIT_FSIZE``), stdout and stderr included.
        max_processes: most processes at once (a cgroup's ``pids.max``, else ``RLIMIT_NPROC``, see above).
        output_limit: characters kept of stdout and of stderr.
        stdin: text the code reads on standard input.
        audit: install the audit hook (turn off only to test the kernel layers alone).
    """
    cpu = cpu_seconds if cpu_seconds is not None else int(timeout) + 2
    work, private = Path(tempfile.mkdtemp(prefix="lrl-sandbox-")), Path(tempfile.mkdtemp(prefix="lrl-out-"))
    cgroup = make_cgroup(max_processes)
    try:
        (work / "main.py").write_text(code)
        nproc = "" if cgroup else user_processes() + max_processes
        config = f"{cpu}\t{memory_mb << 20}\t{file_size_mb << 20}\t{nproc}\t{int(audit)}\t" + (
            str(cgroup / "cgroup.procs") if cgroup else "")
        return supervise(config, work, private, timeout, output_limit, stdin, cgroup)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)
        if cgroup:
            remove_cgroup(cgroup)


def supervise(config: str, work: Path, private: Path, timeout: float, output_limit: int,
              stdin: str, cgroup: Path | None) -> SandboxResult:
    """Start the child in ``work``, wait at most ``timeout``, kill what is left, read its results."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8"}
    start = time.monotonic()
    (private / "in").write_text(config + "\n" + stdin)  # a file: a pipe could block on the child
    with open(private / "in", "rb") as inp, open(private / "out", "wb") as out, \
            open(private / "err", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-I", "-S", CHILD], cwd=work, env=env, stdin=inp,
                                stdout=out, stderr=err, start_new_session=True)
        timed_out = not wait_unreaped(proc.pid, start + timeout)
        kill_all(proc.pid, cgroup)  # the leader is not reaped yet, so its group id is still its own
        exit_code = proc.wait()
    wall = time.monotonic() - start
    stdout, stderr = (read_cut(private / name, output_limit) for name in ("out", "err"))
    network = "namespace" if stderr.startswith(NETNS_NOTE) else "audit hook"
    stderr = stderr.removeprefix(NETNS_NOTE)
    limit, reason = classify(exit_code, timed_out, stderr, timeout)
    return SandboxResult(stdout, stderr, exit_code, timed_out, limit, reason, wall, network,
                         "cgroup" if cgroup else "rlimit" if os.geteuid() else "audit hook")


def wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` exits (left unreaped) or ``deadline`` passes; whether it exited."""
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.01)
    return False


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


def read_cut(path: Path, limit: int) -> str:
    """The first ``limit`` characters of a file, marked ``[... cut]`` when there was more."""
    with open(path, "rb") as f:
        text = f.read(4 * limit + 4).decode("utf-8", errors="replace")
    return text if len(text) <= limit and path.stat().st_size <= 4 * limit else text[:limit] + "\n[... cut]"


def classify(exit_code: int, timed_out: bool, stderr: str, timeout: float) -> tuple[str | None, str]:
    """Which limit stopped the child, and why in words (see ``SandboxResult.limit``)."""
    if timed_out:
        return "timeout", f"wall-clock timeout after {timeout:g} s: process group killed"
    if exit_code == -signal.SIGXCPU:
        return "cpu", "CPU-time limit: killed by SIGXCPU"
    if exit_code == -signal.SIGKILL:
        return "cpu", "killed by SIGKILL (the CPU-time hard limit, or the kernel out of memory)"
    last = next((line for line in reversed(stderr.strip().split("\n")) if line.strip()), "")
    for needle, limit in LIMIT_ERRORS if exit_code else ():
        if needle in last:
            return limit, last.strip()
    if exit_code:
        return None, f"exit code {exit_code}: {last.strip()}" if last else f"exit code {exit_code}"
    return None, ""


# ------------------------------------------------------------------------------- processes: cgroup
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


def user_processes() -> int:
    """How many processes this user runs (``RLIMIT_NPROC`` counts them all, not only the child's)."""
    count = 0
    for p in Path("/proc").iterdir():
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            count += p.name.isdigit() and p.stat().st_uid == os.getuid()
    return count


# ----------------------------------------------------------------------------- the tool and reward
def python(code: str) -> str:
    """Run Python code in a sandbox and return what it prints.

    (The tool ``lightning_rl.sandbox:python``: ``run_python`` with a 5 s timeout and the default limits;
    what the code printed and its traceback or the limit that stopped it come back as the error.)

    Args:
        code: A Python program; print the values you want to see, for example `print(sum(range(10)))`.
    """
    result = run_python(code, timeout=5.0)
    if result.ok:
        return result.stdout
    parts = (result.stdout, result.stderr, result.reason if result.limit in ("timeout", "cpu") else "")
    raise RuntimeError("\n".join(p.strip() for p in parts if p.strip()))  # the tool's caller: an error result


def extract_code(completion: str) -> str:
    """The last fenced ```python (or bare ```) block of a completion, else the whole text."""
    blocks = re.findall(r"```(?:python|py)?[^\S\n]*\n(.*?)```", completion, flags=re.DOTALL)
    return blocks[-1] if blocks else completion


def split_tests(tests: str | Sequence[str]) -> list[str]:
    """A row's test cases: a list of statements, or one string whose top-level statements are each one."""
    if not isinstance(tests, str):
        return [str(t) for t in tests]
    try:
        return [ast.get_source_segment(tests, node) or "" for node in ast.parse(tests).body]
    except SyntaxError as err:
        raise ValueError(f"code_tests: the `tests` column holds invalid Python: {err}") from err


def code_tests(prompts: Sequence[Any], completions: Sequence[str], tests: Sequence[str | Sequence[str]],
               **_: Any) -> list[float]:
    """The fraction of each row's test cases (the ``tests`` column) its completion passes, in the sandbox.

    The completion's code (see ``extract_code``) runs first, then each test case in the same namespace,
    each in its own ``try`` so one failure does not stop the rest; all in one sandboxed process per
    completion, ``TEST_TIMEOUT`` seconds in all (a timeout keeps the passes before it). A test passes when
    it raises nothing. Passes are reported on stdout tagged with a random nonce the code is not given and
    the harness's builtins are bound before it runs, so printing ``pass`` or replacing ``exec`` scores
    nothing; but the nonce is in the process: code that walks frames (``sys._getframe(1).f_globals``)
    can find it and forge passes. Nothing in one process can stop that without breaking ``namedtuple``.
    """
    rows = [split_tests(t) for t in tests]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return list(pool.map(score_one, [extract_code(c) for c in completions], rows))


def score_one(code: str, tests: list[str]) -> float:
    """The fraction of ``tests`` that pass after ``code`` (1.0 when there are no tests and it runs)."""
    nonce = secrets.token_hex(16)
    harness = {"code": code, "tests": tests, "nonce": nonce}
    result = run_python(HARNESS, timeout=TEST_TIMEOUT, stdin=json.dumps(harness))
    passed = len(re.findall(rf"^{nonce} pass$", result.stdout, flags=re.MULTILINE))
    return passed / len(tests) if tests else float(result.ok)


# the builtins it uses are bound before the completion runs, so that replacing `builtins.exec` passes nothing
HARNESS = """\
import json, sys
_h, _exec, _compile, _out = json.loads(sys.stdin.readline()), exec, compile, sys.stdout
_g = {"__name__": "__main__"}
_exec(_compile(_h["code"], "<completion>", "exec"), _g)
for _t in _h["tests"]:
    try:
        _exec(_compile(_t, "<test>", "exec"), _g)
    except BaseException:
        continue
    _out.write("\\n" + _h["nonce"] + " pass\\n")
    _out.flush()
"""
