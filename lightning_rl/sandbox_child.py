"""What runs inside the sandbox of :mod:`lightning_rl.sandbox`: the child interpreter's side (started as
``python -I -S`` on this file, the standard library only; nothing of ``lightning_rl`` is imported, and
:mod:`lightning_rl.sandbox_kernel` and :mod:`lightning_rl.sandbox_hook` are loaded by their paths, before
the child drops root: the checkout may be in a folder ``nobody`` cannot read).

The child (its configuration in ``argv``, so that stdin carries only the code's own input) contains itself
before it runs ``main.py`` of its folder, in this order:

1. resource limits (CPU, address space, file size, no core files) and, as root, its pids cgroup;
2. an unprivileged user: as root it drops to ``nobody`` (65534), first exposing the interpreter's library
   where a private folder hides it (a mount namespace of its own); a user who is not root stays itself;
3. new user, PID, mount, network, IPC and UTS namespaces, then ``RLIMIT_NPROC`` where there is no cgroup;
4. a fork: the first process of the PID namespace (a small init that mounts a fresh ``/proc``, reaps, and
   passes the code's exit status back) forks the code as PID 2;
5. in the code's process: ``no_new_privs``, Landlock (the library and devices read-only, the folder
   read-write, nothing executable, no TCP, no signals out), no capabilities, and seccomp last;
6. the audit hook of :mod:`lightning_rl.sandbox_hook` (``audit=1``), immune to rebinding from inside;
7. the code, as ``__main__`` (a module of its own: ``import __main__`` does not reach this file).

Each layer it gets is reported on the ``report`` file descriptor (``layer``/``missing`` lines) before the
code runs; with ``containment=strict`` a missing layer ends the child (exit 125) before any code runs.
A run takes ~35-40 ms from start to exit (a reward runs one per completion): startup costs count.
"""

from __future__ import annotations

import _signal  # the C module: ``signal`` imports ``enum``, ~4 ms at each start
import os
import resource
import struct
import sys

TYPE_CHECKING = False  # ``typing`` costs 5 ms at each start: annotations only
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

REFUSED_EXIT = 125
REQUIRED = ("rlimits", "processes", "user", "namespaces", "no_new_privs", "landlock", "capabilities",
            "seccomp")
DEVICES = {"/dev/null": True, "/dev/zero": False, "/dev/urandom": False, "/dev/random": False}
ZONEINFO = "/usr/share/zoneinfo"


class Report:
    """The layers the run has, written to the parent's ``report`` descriptor (``os.write``: unbuffered, so
    nothing is written twice by forked processes)."""

    def __init__(self, fd: int, strict: bool, disabled: set[str]) -> None:
        self.fd, self.strict, self.disabled = fd, strict, disabled

    def have(self, layer: str, detail: str) -> None:
        os.write(self.fd, f"layer\t{layer}\t{detail}\n".encode())

    def lack(self, layer: str, why: str) -> None:
        """A missing layer: with ``strict`` containment (and a required layer) the run ends here."""
        os.write(self.fd, f"missing\t{layer}\t{why}\n".encode())
        if self.strict and layer in REQUIRED:
            os.write(self.fd, b"refused\n")
            os._exit(REFUSED_EXIT)

    def attempt(self, layer: str, make: Callable[[], object]) -> bool:
        """Run ``make`` (which reports what it set up) for ``layer``; False where it is turned off (by
        tests, see ``sandbox.DISABLED_LAYERS``) or the kernel refused it."""
        if layer in self.disabled:
            self.lack(layer, "turned off by the caller (sandbox.DISABLED_LAYERS)")
            return False
        try:
            make()
        except OSError as err:
            self.lack(layer, str(err))
            return False
        return True


def child_main() -> None:
    """In the child (this file run as a script): contain itself, run ``main.py``, exit. ``argv`` holds
    ``key=value`` pairs: ``cpu``, ``memory``, ``fsize`` (seconds, bytes), ``processes`` (at most, the
    code's own included), ``nproc`` (``RLIMIT_NPROC`` without a user namespace; empty: none), ``cgroup``
    (its ``cgroup.procs``, or empty), ``audit`` (``1``/``0``), ``report`` (a descriptor),
    ``containment`` and ``disable`` (layers not to set up, for tests)."""
    cfg = dict(arg.split("=", 1) for arg in sys.argv[1:])
    report = Report(int(cfg["report"]), cfg["containment"] == "strict", set(cfg["disable"].split(",")))
    kernel, hook = load("sandbox_kernel"), load("sandbox_hook") if cfg["audit"] == "1" else None
    with open("main.py") as f:
        code = f.read()
    set_limits(cfg, report)
    read, work = readable(), os.getcwd()
    become_unprivileged(kernel, report, read + [work], work)
    namespaces = report.attempt("namespaces", kernel.unshare_namespaces)
    limit_processes(cfg, report, namespaces)
    if not namespaces:  # the code runs in this process
        return contain_and_run(kernel, hook, report, code, read, work)
    status_r, status_w = os.pipe()
    init_pid = os.fork()
    if init_pid == 0:  # PID 1 of the new namespace
        os.close(status_r)
        init(kernel, report, status_w, lambda: contain_and_run(kernel, hook, report, code, read, work))
    os.close(status_w)
    os.write(report.fd, f"init\t{init_pid}\n".encode())
    relay(init_pid, status_r)


def load(name: str) -> Any:
    """A module of this folder (``sandbox_kernel``, ``sandbox_hook``) loaded from its path: no package is
    on ``sys.path`` here, and it is not put in ``sys.modules`` (the code cannot import it)."""
    import importlib.machinery  # not importlib.util: 3 ms more at each start

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    module = type(sys)(name)
    module.__file__ = path
    importlib.machinery.SourceFileLoader(name, path).exec_module(module)
    return module


def set_limits(cfg: dict[str, str], report: Report) -> None:
    """The resource limits, and the pids cgroup where the parent made one (before dropping root)."""
    for kind, value in ((resource.RLIMIT_CPU, cfg["cpu"]), (resource.RLIMIT_AS, cfg["memory"]),
                        (resource.RLIMIT_FSIZE, cfg["fsize"]), (resource.RLIMIT_CORE, "0")):
        hard = resource.getrlimit(kind)[1]  # a user who is not root cannot raise a hard limit
        hard = sys.maxsize if hard == resource.RLIM_INFINITY else hard
        top = int(value) + (kind == resource.RLIMIT_CPU)  # CPU: SIGXCPU at the soft limit, SIGKILL after
        resource.setrlimit(kind, (min(int(value), hard), min(top, hard)))
    report.have("rlimits", f"cpu {cfg['cpu']} s, address space {int(cfg['memory']) >> 20} MB, "
                           f"file size {int(cfg['fsize']) >> 20} MB, no core files")
    if cfg["cgroup"] and "processes" not in report.disabled:
        with open(cfg["cgroup"], "w") as f:
            f.write(str(os.getpid()))
        report.have("processes", f"cgroup pids.max {int(cfg['processes']) + 2}")


def readable() -> list[str]:
    """What the code may read besides its folder: the interpreter's library (``sys.path`` under ``-I -S``
    and ``os.__file__``'s folder), the folders of the shared libraries it has loaded (extension modules
    load more from there) with ``ld.so.cache``, and the time zones."""
    found = [p for p in sys.path if p] + [os.path.dirname(os.__file__), "/etc/ld.so.cache", ZONEINFO]
    with open("/proc/self/maps") as maps:
        found += [os.path.dirname(line.split(None, 5)[5].strip()) for line in maps if "/" in line]
    return sorted({os.path.realpath(p) for p in found if os.path.exists(p)})


def become_unprivileged(kernel: Any, report: Report, needed: list[str], work: str) -> None:
    """As root: expose ``needed`` to ``nobody`` where a private folder hides it, then drop to ``nobody``;
    otherwise the caller's own unprivileged user."""
    if os.geteuid() != 0:
        return report.have("user", f"uid {os.getuid()} (the caller; not root)")

    def drop() -> None:
        try:
            covered = kernel.expose(needed, work, kernel.NOBODY, kernel.NOBODY)
        except OSError as err:
            raise OSError(err.errno, f"the interpreter's library is not readable by uid {kernel.NOBODY} "
                          f"(nobody) and cannot be exposed to it: {err}; install Python where nobody can "
                          "read it") from err
        kernel.drop_privileges()
        if covered:
            report.have("mounts", "private folders covered for nobody: " + ", ".join(covered))
        report.have("user", f"uid {kernel.NOBODY} (nobody; the caller is root)")

    report.attempt("user", drop)


def limit_processes(cfg: dict[str, str], report: Report, namespaces: bool) -> None:
    """``RLIMIT_NPROC`` where there is no cgroup: in a user namespace the kernel counts only the tasks
    (threads) of this run, else all of the user's (the parent counted them into ``nproc``)."""
    if namespaces:
        report.have("namespaces", "user pid mount net ipc uts")
    if "processes" in report.disabled:
        return report.lack("processes", "turned off by the caller (sandbox.DISABLED_LAYERS)")
    if cfg["cgroup"]:
        return None
    value = int(cfg["processes"]) + 2 if namespaces else int(cfg["nproc"] or 0)
    if not value:
        return report.lack("processes", "no pids cgroup, and RLIMIT_NPROC does not bind root")
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(resource.RLIMIT_NPROC, (value, value))
    report.have("processes", f"RLIMIT_NPROC {value} ({'this run' if namespaces else 'the user'}'s threads)")


def init(kernel: Any, report: Report, status_w: int, run: Callable[[], None]) -> None:
    """PID 1 of the namespace: mount a fresh ``/proc``, fork the code (PID 2), reap every process until
    the code ends, send its wait status to :func:`relay`. Its exit ends every process of the namespace."""
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)  # PID 1 ignores what it has no handler for
    if "proc" not in report.disabled:
        try:
            kernel.mount_proc()
            report.have("proc", "a fresh /proc of the PID namespace")
        except OSError as err:
            report.lack("proc", str(err))
    code_pid = os.fork()
    if code_pid == 0:
        os.close(status_w)
        run()  # raises SystemExit: the interpreter's own exit (atexit, threads) ends the code's process
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == code_pid:
            os.write(status_w, struct.pack("i", status))
            os._exit(0)


def relay(init_pid: int, status_r: int) -> None:
    """Outside the namespace: wait for its init and end as the code ended (its exit code or signal)."""
    _, status = os.waitpid(init_pid, 0)
    sent = os.read(status_r, 4)
    status = struct.unpack("i", sent)[0] if len(sent) == 4 else status
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (_signal.SIGKILL, _signal.SIGSTOP):
            _signal.signal(sig, _signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def contain_and_run(kernel: Any, hook: Any, report: Report, code: str, read: list[str], work: str) -> None:
    """In the code's process: the filters (Landlock, no capabilities, seccomp last), the audit hook, then
    the code as ``__main__`` (a module of its own: ``import __main__`` does not reach this file)."""
    report.attempt("no_new_privs", lambda: kernel.no_new_privs() or report.have("no_new_privs", "set"))
    report.attempt("landlock", lambda: landlock(kernel, report, read, work))
    report.attempt("capabilities", lambda: kernel.drop_capabilities() or report.have("capabilities", "none"))
    report.attempt("seccomp", lambda: kernel.install_seccomp() or report.have("seccomp", "BPF filter"))
    if hook is not None:
        sys.addaudithook(hook.make_hook(work, [*read, *DEVICES]))
        report.have("audit", "Python audit hook")
    os.close(report.fd)
    main = type(sys)("__main__")
    main.__file__, main.__builtins__ = "main.py", __builtins__
    sys.modules["__main__"] = main
    try:
        exec(compile(code, "main.py", "exec"), main.__dict__)
    except Exception as err:
        show_error(err)
        sys.exit(1)
    sys.exit(0)


def landlock(kernel: Any, report: Report, read: list[str], work: str) -> None:
    """Landlock over ``read``, ``work`` and ``DEVICES``; reports the ABI and what it covers."""
    abi = kernel.landlock(read, work, DEVICES)
    covers = ["files"] + ["tcp"] * (abi >= 4) + ["signals", "abstract unix sockets"] * (abi >= 6)
    report.have("landlock", f"ABI {abi}: " + ", ".join(covers))


def show_error(err: BaseException) -> None:
    """Print the code's traceback as Python would, without this file's frames (``contain_and_run`` above
    the code's, the hook's below a refusal)."""
    entries, tb = [], err.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    if isinstance(err, PermissionError) and str(err).startswith("sandbox refused") and len(entries) > 2:
        entries[-2].tb_next = None
    err.__traceback__ = entries[1] if len(entries) > 1 else None
    sys.__excepthook__(type(err), err, err.__traceback__)


if __name__ == "__main__":
    child_main()
