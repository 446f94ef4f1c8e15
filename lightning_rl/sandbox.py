"""Model-written Python run in a sandbox: ``run_python``, the built-in tool ``python`` and the reward
``code_tests`` (``lightning_rl.sandbox:python``, ``lightning_rl.sandbox:code_tests``).

The code runs in a child interpreter (:mod:`lightning_rl.sandbox_child` run as ``python -I -S``: the
standard library only) in a fresh temporary folder, removed afterwards, with only ``PATH``, ``HOME`` (the
folder) and ``LANG`` in its environment; stdin carries only the ``stdin`` given. What contains what (the
README's containment table says the same, with where each layer may be missing):

- an unprivileged user: as root the child drops to ``nobody`` (the folder is given to it); a user who is
  not root stays itself (:mod:`lightning_rl.sandbox_kernel`).
- namespaces: user, PID (a fresh ``/proc`` listing only the run's processes), mount, network (no device
  up), IPC and UTS; killing the PID namespace's first process ends every process in it.
- Landlock: the interpreter's library and a few devices read-only, the folder read-write, nothing
  executable, no TCP, no signals or abstract unix sockets out of the run; ``no_new_privs``; no capabilities.
- seccomp: no ptrace, namespaces, mounts, keyrings, BPF, perf, io_uring, modules, kexec, file handles, no
  socket but ``AF_UNIX``, ``clone3`` answered ENOSYS so that ``clone``'s flags can be checked.
- resource limits (``setrlimit``): CPU seconds, address space, the size of any file written (stdout and
  stderr included); processes: a fresh cgroup with ``pids.max`` where one can be made (root, cgroup v1
  ``pids`` or a writable v2 hierarchy), else ``RLIMIT_NPROC`` (counted in the run's user namespace).
- a wall-clock timeout: the process group is killed (``SIGKILL``), with it the PID namespace, and every
  process of the run's cgroup (:mod:`lightning_rl.sandbox_processes`).
- an audit hook (:mod:`lightning_rl.sandbox_hook`, ``audit=True``), an extra layer in Python that refuses
  shelling out, forks, sockets, ``ctypes``, reads and writes outside the folder; immune to rebinding.

``SandboxResult.layers`` says which layers a run had. Where a kernel layer cannot be had, ``run_python``
refuses (``SandboxUnavailable``, naming the layer) unless ``containment="weak"`` or the environment variable
``LIGHTNING_RL_SANDBOX=weak`` accepts less; ``SandboxResult.missing`` then says what was missing.
Not contained: disk space of many files under the size limit (bounded by time only), the machine's CPUs
and disk bandwidth, connecting to unix sockets outside the folder whose path it knows (Landlock ABI 7 does
not cover them; the mount namespace still shows the host's files). Not available inside: ``multiprocessing``
locks (``/dev/shm`` is not in the view), executing any program.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_rl.sandbox_processes import (
    kill_all,
    make_cgroup,
    remove_cgroup,
    user_processes,
    wait_gone,
    wait_unreaped,
)

CHILD = str(Path(__file__).with_name("sandbox_child.py"))  # run as a script: imports nothing of ours
CONTAINMENT_ENV, CONTAINMENTS = "LIGHTNING_RL_SANDBOX", ("strict", "weak")
NOBODY = 65534  # the user root's sandbox runs as
# layers the child is told not to set up: tests only (the refusal and the weak opt-in, on a real gap)
DISABLED_LAYERS: frozenset[str] = frozenset()
# the last stderr line of an error, and the limit it means (a signal, or an error the limit raises)
LIMIT_ERRORS = (("MemoryError", "memory"), ("File too large", "file_size"),
                ("Resource temporarily unavailable", "processes"), ("sandbox refused", "refused"),
                ("PermissionError", "refused"))


class SandboxUnavailable(RuntimeError):
    """A kernel layer of the sandbox cannot be had here, and weaker containment was not accepted."""


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run gave.

    Attributes:
        stdout, stderr: the output, cut to ``output_limit`` characters (a cut ends with ``[... cut]``).
        exit_code: the child's exit status; ``-N`` when signal N ended it.
        timed_out: the wall-clock timeout ran out and the process group was killed.
        limit: what stopped it: ``timeout``, ``cpu``, ``memory``, ``file_size``, ``processes``, ``refused``
            (the audit hook refused an operation, or the kernel answered ``PermissionError``), or None
            (exited by itself, maybe with an error).
        reason: the same in words, with the error line; ``""`` when it ran to a clean exit.
        wall_time: seconds from start to the end of the child.
        network: ``namespace`` (no network device; seccomp also refuses sockets but ``AF_UNIX``),
            ``seccomp`` (without the namespace), ``audit hook`` (sockets refused in Python only) or ``none``.
        processes: ``cgroup`` (pids.max), ``rlimit`` (RLIMIT_NPROC), ``audit hook`` (fork refused only) or
            ``none``.
        layers: the layers the run had, name -> detail: ``rlimits``, ``processes``, ``user``, ``mounts``
            (private folders covered for ``nobody``), ``namespaces``, ``proc``, ``no_new_privs``,
            ``landlock`` (its ABI), ``capabilities``, ``seccomp``, ``audit``.
        missing: the layers it lacked, name -> why (empty under ``strict`` containment, but for ``proc``).
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
    layers: dict[str, str]
    missing: dict[str, str]

    @property
    def ok(self) -> bool:
        """It exited with status 0 and no limit stopped it."""
        return self.exit_code == 0 and self.limit is None


def run_python(code: str, *, timeout: float = 5.0, cpu_seconds: int | None = None, memory_mb: int = 512,
               file_size_mb: int = 16, max_processes: int = 16, output_limit: int = 10_000,
               stdin: str = "", audit: bool = True, containment: str | None = None) -> SandboxResult:
    """Run ``code`` in a sandboxed child interpreter and wait for it, at most ``timeout`` seconds.

    Args:
        code: Python source, run as ``__main__`` from ``main.py`` in a fresh temporary folder.
        timeout: wall-clock seconds before the whole process group is killed.
        cpu_seconds: CPU-time limit (``RLIMIT_CPU``); default ``int(timeout) + 2``, so the wall clock decides.
        memory_mb: address-space limit (``RLIMIT_AS``) of each process.
        file_size_mb: largest file any process may write (``RLIMIT_FSIZE``), stdout and stderr included.
        max_processes: most processes (threads count) the code runs at once, its own included (a cgroup's
            ``pids.max``, else ``RLIMIT_NPROC``; the sandbox's own two processes come on top).
        output_limit: characters kept of stdout and of stderr.
        stdin: text the code reads on standard input.
        audit: install the audit hook (turn off only to test the kernel layers alone).
        containment: ``strict`` (every kernel layer or ``SandboxUnavailable``) or ``weak`` (run with what
            the kernel gives, reported in ``missing``); default: ``$LIGHTNING_RL_SANDBOX``, else ``strict``.

    Raises:
        SandboxUnavailable: under ``strict`` containment, where a kernel layer cannot be had.
    """
    mode = containment_mode(containment)
    cpu = cpu_seconds if cpu_seconds is not None else int(timeout) + 2
    work, private = Path(tempfile.mkdtemp(prefix="lrl-sandbox-")), Path(tempfile.mkdtemp(prefix="lrl-out-"))
    cgroup = make_cgroup(max_processes + 2)
    try:
        uid = write_code(work, code)
        nproc = "" if cgroup else user_processes(uid) + max_processes + 2  # used without a user namespace
        config = {"cpu": cpu, "memory": memory_mb << 20, "fsize": file_size_mb << 20, "nproc": nproc,
                  "processes": max_processes, "cgroup": cgroup / "cgroup.procs" if cgroup else "",
                  "audit": int(audit), "containment": mode, "disable": ",".join(sorted(DISABLED_LAYERS))}
        return supervise(config, work, private, timeout, output_limit, stdin, cgroup)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)
        if cgroup:
            remove_cgroup(cgroup)


def write_code(work: Path, code: str) -> int:
    """Write ``code`` to ``work/main.py`` and give the folder and the file to the user the child runs as:
    ``nobody`` when this process is root, else this user (nothing to give). That user's id."""
    (work / "main.py").write_text(code)
    uid = NOBODY if os.geteuid() == 0 else os.getuid()
    for path in (work, work / "main.py") if uid != os.getuid() else ():
        os.chown(path, uid, uid)  # the folder is the unprivileged user's
    return uid


def containment_mode(containment: str | None) -> str:
    """``containment``, else ``$LIGHTNING_RL_SANDBOX``, else ``strict``; an error naming where a bad value
    came from."""
    value = containment if containment is not None else os.environ.get(CONTAINMENT_ENV, "strict")
    if value not in CONTAINMENTS:
        where = f"{CONTAINMENT_ENV}={value!r}" if containment is None else f"containment={value!r}"
        raise ValueError(f"{where}: the sandbox's containment is 'strict' (the default) or 'weak'")
    return value


def supervise(config: dict[str, Any], work: Path, private: Path, timeout: float, output_limit: int,
              stdin: str, cgroup: Path | None) -> SandboxResult:
    """Start the child in ``work``, wait at most ``timeout``, kill what is left, read its results."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8"}
    start = time.monotonic()
    (private / "in").write_text(stdin)  # a file: a pipe could block on the child
    with open(private / "in", "rb") as inp, open(private / "out", "wb") as out, \
            open(private / "err", "wb") as err, open(private / "report", "wb") as report:
        argv = [f"{key}={value}" for key, value in config.items()] + [f"report={report.fileno()}"]
        proc = subprocess.Popen([sys.executable, "-I", "-S", CHILD, *argv], cwd=work, env=env, stdin=inp,
                                stdout=out, stderr=err, start_new_session=True, pass_fds=(report.fileno(),))
        timed_out = not wait_unreaped(proc.pid, start + timeout)
        kill_all(proc.pid, cgroup)  # the leader is not reaped yet, so its group id is still its own
        exit_code = proc.wait()
    layers, missing, init = read_report(private / "report")
    if init and exit_code < 0:
        wait_gone(init)  # the PID namespace's first process: its end ends the namespace
    if "refused" in missing:
        raise SandboxUnavailable(unavailable(missing))
    wall = time.monotonic() - start
    stdout, stderr = (read_cut(private / name, output_limit) for name in ("out", "err"))
    limit, reason = classify(exit_code, timed_out, stderr, timeout)
    network = next((name for key, name in (("namespaces", "namespace"), ("seccomp", "seccomp"),
                                           ("audit", "audit hook")) if key in layers), "none")
    processes = layers.get("processes", "audit hook" if "audit" in layers else "none").split(" ")[0]
    return SandboxResult(stdout, stderr, exit_code, timed_out, limit, reason, wall, network,
                         {"RLIMIT_NPROC": "rlimit"}.get(processes, processes), layers, missing)


def read_report(path: Path) -> tuple[dict[str, str], dict[str, str], int]:
    """The child's report: the layers it had, those it lacked (``refused`` among them where it refused to
    run the code), and the host pid of its PID namespace's first process (0: none)."""
    layers, missing, init = {}, {}, 0
    for line in path.read_text().splitlines():
        kind, _, rest = line.partition("\t")
        name, _, detail = rest.partition("\t")
        if kind in ("layer", "missing"):
            (layers if kind == "layer" else missing)[name] = detail
        elif kind == "init":
            init = int(name)
        elif kind == "refused":
            missing["refused"] = ""
    return layers, missing, init


def unavailable(missing: dict[str, str]) -> str:
    """Why ``run_python`` refused, and how to opt into weaker containment."""
    lacking = "; ".join(f"{name}: {why}" for name, why in missing.items() if name not in ("refused", "proc"))
    return (f"the sandbox refuses to run model-written code without its kernel layers, and here it lacks "
            f"{lacking}. To accept weaker containment (what was missing is then reported in "
            f"SandboxResult.missing), pass run_python(..., containment='weak') or set {CONTAINMENT_ENV}=weak "
            "(read by the tool lightning_rl.sandbox:python and the reward lightning_rl.sandbox:code_tests).")


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


# the reward `code_tests` is judged in lightning_rl.code_judge (the expected values never enter the
# completion's process, and the trainer decides on plain values); its names stay importable from here
from lightning_rl.code_judge import code_tests as code_tests  # noqa: E402
from lightning_rl.code_judge import extract_code as extract_code  # noqa: E402
from lightning_rl.code_judge import split_tests as split_tests  # noqa: E402
