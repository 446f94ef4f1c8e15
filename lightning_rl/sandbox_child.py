"""What runs inside the sandbox of :mod:`lightning_rl.sandbox`: the child interpreter's side (started as
``python -I -S`` on this file, the standard library only; nothing of ``lightning_rl`` is imported).

It reads its limits from standard input, sets the kernel limits (``setrlimit``), joins its cgroup, leaves
the network (a new network namespace where the kernel allows it), installs the audit hook that refuses
what the kernel does not stop (see :mod:`lightning_rl.sandbox`), then runs ``main.py`` of its folder as
``__main__``. It starts in ~40 ms: a reward runs one per completion.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable

CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
NETNS_NOTE = "sandbox: network namespace\n"  # the child's first stderr line where it has one
REFUSED = {"os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
           "socket.__new__", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen", "ctypes.dlsym",
           "ctypes.cdata", "pty.spawn"}
WRITE_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod",
                "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
READ_EVENTS = {"os.listdir", "os.scandir"}
DEVICES = ("/dev/null/", "/dev/zero/", "/dev/urandom/", "/dev/random/", "/usr/share/zoneinfo/")  # readable


# ------------------------------------------------------------------------------- the child's side
def child_main() -> None:
    """In the child (this file run as a script): confine itself, run ``main.py``, exit.

    Its first stdin line is the configuration, tab-separated: CPU seconds, address-space and file-size
    bytes, ``RLIMIT_NPROC`` (empty: none), the audit hook (``1``/``0``) and the cgroup's ``cgroup.procs``.
    """
    cpu, memory, fsize, nproc, audit, cgroup = sys.stdin.readline().rstrip("\n").split("\t")
    if cgroup:
        with open(cgroup, "w") as f:
            f.write(str(os.getpid()))
    if unshare_network():
        print(NETNS_NOTE, file=sys.stderr, end="", flush=True)
    for kind, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory),
                        (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NPROC, nproc)):
        hard = resource.getrlimit(kind)[1]  # a user who is not root cannot raise a hard limit
        hard = sys.maxsize if hard == resource.RLIM_INFINITY else hard
        if value:  # CPU: SIGXCPU at the soft limit, SIGKILL a second later
            top = int(value) + (kind == resource.RLIMIT_CPU)
            resource.setrlimit(kind, (min(int(value), hard), min(top, hard)))
    with open("main.py") as f:
        code = f.read()
    if audit == "1":
        sys.addaudithook(make_hook(os.getcwd(), [*sys.path, os.path.dirname(os.__file__)]))
    globs = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(compile(code, "main.py", "exec"), globs)
    except Exception as err:
        show_error(err)
        sys.exit(1)
    sys.exit(0)  # before the parent's imports below


def show_error(err: BaseException) -> None:
    """Print the code's traceback as Python would, without this file's frames (``child_main`` above the
    code's, the hook's below a refusal)."""
    entries, tb = [], err.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    if isinstance(err, PermissionError) and str(err).startswith("sandbox refused") and len(entries) > 2:
        entries[-2].tb_next = None
    err.__traceback__ = entries[1] if len(entries) > 1 else None
    sys.__excepthook__(type(err), err, err.__traceback__)


def unshare_network() -> bool:
    """Move this process into a new network namespace (no interface up); whether the kernel allowed it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    flags = [CLONE_NEWNET] if os.geteuid() == 0 else [CLONE_NEWUSER | CLONE_NEWNET]
    return any(libc.unshare(f) == 0 for f in flags)


def make_hook(work: str, readable: list[str]) -> Callable[[str, tuple], None]:
    """The audit hook: raises ``PermissionError`` where ``refusal`` names a reason."""
    inside = [os.path.join(os.path.realpath(work), "")]
    may_read = inside + [os.path.join(os.path.realpath(p), "") for p in readable if p] + list(DEVICES)

    def hook(event: str, args: tuple) -> None:  # raises itself: show_error drops exactly one frame
        what = refusal(event, args, inside, may_read)
        if what:
            raise PermissionError(f"sandbox refused {what}")

    return hook


def refusal(event: str, args: tuple, inside: list[str], may_read: list[str]) -> str:
    """Why the hook refuses an event, or ``""``: the ``REFUSED`` events, writes outside ``inside`` (the
    folder), reads outside ``may_read`` (the folder, the interpreter's library, ``DEVICES``), and native
    modules from outside the library (they could do anything)."""
    if event in REFUSED:
        return event
    if event == "import" and not under(args[1], may_read[1:]):
        return f"loading the native module {args[1]!r} from outside the standard library"
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        writing = any(c in str(mode or "") for c in "wax+") or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
        if not under(path, inside if writing else may_read):
            return f"opening {path!r} {'for writing ' if writing else ''}outside the sandbox folder"
    if event in WRITE_EVENTS or event in READ_EVENTS:
        roots = [inside if event in WRITE_EVENTS else may_read] * 2
        roots[0] = {"os.symlink": [], "shutil.copyfile": may_read}.get(event, roots[0])  # a source is read
        if not all(under(path, r) for path, r in zip(args[:2], roots, strict=False) if r):
            return f"{event} outside the sandbox folder"
    return ""


def under(path: object, roots: list[str]) -> bool:
    """Whether ``path`` (symbolic links resolved) lies under one of ``roots``; true for what is not a path
    (a file descriptor, a mode)."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return True
    full = os.path.join(os.path.realpath(os.fsdecode(path)), "")
    return any(full.startswith(root) for root in roots)


if __name__ == "__main__":
    child_main()
