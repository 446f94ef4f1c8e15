"""The sandbox's Python audit hook (``sys.addaudithook``): an extra layer inside the code's own process, over
the kernel's (see :mod:`lightning_rl.sandbox_kernel`). :mod:`lightning_rl.sandbox_child` loads this file by
path, so it imports the standard library only.

The hook is immune to rebinding from inside: its functions hold what they use (the immutable tables below,
the builtins, the ``os`` functions) as positional defaults, bound when it is made; they look nothing up in
globals, ``__main__``, ``os`` or ``builtins`` at call time and have no closure cells to rewrite. Rewriting
their ``__defaults__`` or ``__code__`` is an audited event it refuses, as are the ways to reach objects or
live frames' variables (``gc``'s object walks, trace and profile functions); its frame holds nothing of it
when it raises. It cannot see everything: ``os.open(..., dir_fd=)`` raises an ``open`` event without the
descriptor, and Python's documentation calls audit hooks no sandbox; Landlock holds those in the kernel.
"""

from __future__ import annotations

import os
import stat

TYPE_CHECKING = False  # ``typing`` and ``collections`` cost the child's start: annotations only
if TYPE_CHECKING:
    from collections.abc import Callable

REFUSED = frozenset({
    "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
    "socket.__new__", "os.kill", "os.killpg", "signal.pthread_kill", "ctypes.dlopen", "ctypes.dlsym",
    "ctypes.cdata", "pty.spawn",  # and what reaches objects or live frames' variables:
    "sys.settrace", "sys.setprofile", "gc.get_objects", "gc.get_referrers", "gc.get_referents"})
WRITE_EVENTS = frozenset({
    "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod", "os.chown",
    "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"})
READ_EVENTS = frozenset({"os.listdir", "os.scandir"})
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC
# where an event carries a dir_fd (-1: none): a path relative to a descriptor is not the path it names
DIR_FD_ARGS = (("os.remove", (1,)), ("os.rmdir", (1,)), ("os.mkdir", (2,)), ("os.symlink", (2,)),
               ("os.chmod", (2,)), ("os.rename", (2, 3)), ("os.link", (2, 3)), ("os.chown", (3,)),
               ("os.utime", (3,)))


def make_hook(work: str, readable: list[str]) -> Callable[[str, tuple], None]:
    """The audit hook: raises ``PermissionError`` for the ``REFUSED`` events, ``dir_fd`` arguments, writes
    outside ``work``, reads outside ``work`` and ``readable``, and native modules from outside ``readable``
    (the library).

    Its functions hold everything they use as positional defaults (immutable tuples; setting
    ``__defaults__`` or ``__code__`` is an audited event it refuses for them), not in closure cells (which
    code reaching one of its frames could rewrite) nor in globals."""
    resolve, under = make_resolve(), make_under()
    inside = (resolve(work),)
    may_read = inside + tuple(resolve(p) for p in readable if p)
    refusal = make_refusal(inside, may_read, resolve, under)
    guarded = (resolve, under, refusal)

    def hook(event: str, args: tuple, refusal=refusal, guarded=guarded) -> None:
        what = refusal(event, args)
        if not what and event == "object.__setattr__":
            for function in guarded:
                what = "rewriting the audit hook" if args[0] is function else what
        if what:
            del refusal, guarded  # nothing of the hook's left in its frame, which the traceback holds
            raise PermissionError(f"sandbox refused {what}")

    return hook


def make_refusal(inside: tuple[str, ...], may_read: tuple[str, ...], resolve: Callable[[str], str],
                 under: Callable[..., bool]) -> Callable[[str, tuple], str]:
    """The hook's check of one event: why it is refused, ``""`` when it is not. Refused: the ``REFUSED``
    events, ``dir_fd`` arguments, writes outside ``inside`` (the work folder, resolved), reads outside
    ``may_read`` (the work folder, then the readable roots), native modules from outside ``may_read[1:]``
    (the library).

    Like the hook, it holds what it uses as positional defaults, not in closure cells nor in globals."""

    def refusal(event: str, args: tuple, refused=REFUSED, writes=WRITE_EVENTS, reads=READ_EVENTS,
                dir_fds=DIR_FD_ARGS, inside=inside, may_read=may_read, under=under, resolve=resolve, len_=len,
                str_=str, int_=int, isinstance_=isinstance, tuple_=tuple, write_flags=WRITE_FLAGS) -> str:
        if event in refused:
            return event
        for name, positions in dir_fds:
            for i in positions if name == event else ():
                if len_(args) > i and not (isinstance_(args[i], int_) and args[i] == -1):
                    return f"{event} with a dir_fd"
        if event == "import" and not under(args[1], may_read[1:], resolve):
            return f"loading the native module {args[1]!r} from outside the standard library"
        if event == "open":
            path, mode, flags = (tuple_(args) + (None, None))[:3]
            writing = isinstance_(mode, str_) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode)
            writing = writing or (isinstance_(flags, int_) and flags & write_flags)
            if not under(path, inside if writing else may_read, resolve):
                return f"opening {path!r} {'for writing ' if writing else ''}outside the sandbox folder"
        if event in writes or event in reads:  # a path (or two); other arguments are not paths
            target = inside if event in writes else may_read
            first = () if event == "os.symlink" else may_read if event == "shutil.copyfile" else target
            for position, roots in ((0, first), (1, target)):
                if roots and len_(args) > position and not under(args[position], roots, resolve):
                    return f"{event} outside the sandbox folder"
        return ""

    return refusal


def make_resolve() -> Callable[[str], str]:
    """``os.path.realpath`` (ending in ``/``) from functions bound as defaults."""

    def resolve(path: str, getcwd=os.getcwd, lstat=os.lstat, readlink=os.readlink, islink=stat.S_ISLNK,
                error=OSError, list_=list) -> str:
        todo, done, hops = (path if path[:1] == "/" else getcwd() + "/" + path).split("/"), list_(), 0
        while todo:
            part = todo.pop(0)
            if part in ("", ".", ".."):
                done = done[:-1] if part == ".." else done
                continue
            here = "/" + "/".join([*done, part])
            try:
                link = islink(lstat(here).st_mode) and hops < 40
            except error:
                link = False
            if link:
                hops, target = hops + 1, readlink(here)
                todo, done = target.split("/") + todo, list_() if target[:1] == "/" else done
            else:
                done = [*done, part]
        return "/" + "/".join(done) + "/"

    return resolve


def make_under() -> Callable[..., bool]:
    """Whether a path lies under one of some roots (true for what is not a path: a descriptor)."""

    def under(path: object, roots: tuple[str, ...], resolve: Callable[[str], str], isinstance_=isinstance,
              path_types=(str, bytes, os.PathLike), fsdecode=os.fsdecode) -> bool:
        if not isinstance_(path, path_types):
            return True
        full = resolve(fsdecode(path))
        for root in roots:
            if full.startswith(root):
                return True
        return False

    return under
