"""The kernel's side of the sandbox: an unprivileged user, namespaces, a fresh ``/proc``, no capabilities,
Landlock and seccomp, each a few system calls made through ``ctypes``.

:mod:`lightning_rl.sandbox_child` loads this file by path before it runs any model-written code; the child
runs as ``python -I -S``, so this module imports the standard library only. Every function raises
``OSError`` (with the call that failed) where the kernel refuses; the child decides whether that refuses the
run (``containment="strict"``) or is reported as a missing layer (``"weak"``). What each layer stops is in
the README's containment table.
"""

from __future__ import annotations

import ctypes
import os
import stat
import struct

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long
LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
LIBC.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
NOBODY = 65534
CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x2000000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
NAMESPACES = {"user": CLONE_NEWUSER, "pid": CLONE_NEWPID, "mount": CLONE_NEWNS, "net": CLONE_NEWNET,
              "ipc": CLONE_NEWIPC, "uts": CLONE_NEWUTS}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 16384, 1 << 18
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
# Landlock (include/uapi/linux/landlock.h); the three system calls have the same numbers on x86-64 and arm64
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2


def syscall(number: int, *args: int | bytes | None) -> int:
    """``syscall(2)`` with integer arguments passed as ``long`` (varargs would pass a C ``int``)."""
    return LIBC.syscall(ctypes.c_long(number), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))


def check(result: int, call: str) -> int:
    """``result`` of a libc call, or ``OSError`` naming ``call`` where it returned -1."""
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{call}: {os.strerror(err)}")
    return result


# ------------------------------------------------------------------------------- the user and its view
def allows(path: str, uid: int, gid: int, need: int) -> bool:
    """Whether the mode bits of ``path`` give ``uid``/``gid`` (no other groups, no capabilities) the
    ``need`` bits (4 read, 1 search)."""
    st = os.stat(path)
    shift = 6 if st.st_uid == uid else 3 if st.st_gid == gid else 0
    return (st.st_mode >> shift) & need == need


def readable_by(path: str, uid: int, gid: int) -> bool:
    """Whether ``uid``/``gid`` can reach and read ``path``: every folder above it searchable, itself
    readable (and searchable, for a folder)."""
    path = os.path.realpath(path)
    return first_closed(path, uid, gid) == "" and allows(path, uid, gid, 5 if os.path.isdir(path) else 4)


def expose(paths: list[str], writable: str, uid: int, gid: int) -> list[str]:
    """Make the folders among ``paths`` reachable for ``uid`` where a private folder above them hides them
    (the interpreter under ``/root``, a 0700 temporary folder): in a new mount namespace of its own (as
    root, before dropping privileges), a tmpfs covers the first folder ``uid`` cannot search and each
    path is bound back at its place, read-only but for ``writable``. The rest of that folder is then
    hidden. Returns the covered folders; raises ``PermissionError`` for a folder itself unreadable."""
    hidden = [os.path.realpath(p) for p in paths if os.path.isdir(p) and not readable_by(p, uid, gid)]
    hidden = [p for p in hidden if not any(p.startswith(os.path.join(q, "")) for q in hidden)]
    if not hidden:
        return []
    tops = {path: first_closed(path, uid, gid) for path in hidden}
    for path, top in tops.items():
        if not top or not allows(path, uid, gid, 5):
            raise PermissionError(13, f"{path} itself is not readable by uid {uid}")
    check(LIBC.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(LIBC.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount(/, MS_PRIVATE)")  # nothing leaks
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in hidden}
    for top in sorted(set(tops.values())):
        check(LIBC.mount(b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=0755,size=64k"),
              f"mount(tmpfs, {top})")
    for path, fd in fds.items():
        os.makedirs(path, mode=0o755, exist_ok=True)
        check(LIBC.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC, None),
              f"mount(bind, {path})")
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | (0 if path == writable else MS_RDONLY)
        check(LIBC.mount(None, path.encode(), None, flags, None), f"mount(remount, {path})")
        os.close(fd)
    return sorted(set(tops.values()))


def first_closed(path: str, uid: int, gid: int) -> str:
    """The first folder above ``path`` (from ``/`` down) that ``uid`` cannot search; ``""`` where none."""
    parts = path.split("/")[1:-1]
    for i in range(len(parts) + 1):
        here = "/" + "/".join(parts[:i])
        if not allows(here, uid, gid, 1):
            return here
    return ""


def drop_privileges(uid: int = NOBODY, gid: int = NOBODY) -> None:
    """Become ``uid``/``gid`` for good (real, effective and saved ids; no supplementary groups)."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def unshare_namespaces() -> None:
    """New user, PID, mount, network, IPC and UTS namespaces, this user mapped to itself inside (so the code
    sees its own uid, not root). The PID namespace holds the next child forked, not this process."""
    uid, gid = os.getuid(), os.getgid()
    check(LIBC.unshare(sum(NAMESPACES.values())), "unshare(CLONE_NEWUSER|NEWPID|NEWNS|NEWNET|NEWIPC|NEWUTS)")
    check(LIBC.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")  # /proc/self/*_map is ours
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    check(LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def mount_proc() -> None:
    """A fresh ``/proc`` for this PID namespace (call from its first process): it lists only the run's own
    processes. Refused where the outer ``/proc`` is partly covered (containers mask some of its files)."""
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    check(LIBC.mount(b"proc", b"/proc", b"proc", flags, None), "mount(proc, /proc)")


def drop_capabilities() -> None:
    """Clear every capability (the ones a new user namespace gave, over that namespace's objects)."""
    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0))  # _LINUX_CAPABILITY_VERSION_3
    check(LIBC.capset(header, ctypes.create_string_buffer(24)), "capset")


def no_new_privs() -> None:
    """``PR_SET_NO_NEW_PRIVS``: no exec may gain privileges (a condition of Landlock and seccomp)."""
    check(LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


# ------------------------------------------------------------------------------------------- Landlock
def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (an old kernel, or turned off)."""
    return max(syscall(LANDLOCK_CREATE_RULESET, None, 0, 1), 0)  # LANDLOCK_CREATE_RULESET_VERSION


def landlock(read: list[str], write: str, devices: dict[str, bool]) -> int:
    """Restrict this process and its children for good to reading ``read`` (files and folders), reading
    and writing ``write`` (a folder) and ``devices`` (path -> writable), with nothing executable anywhere;
    from ABI 4 no TCP bind or connect, from ABI 6 no signals or abstract unix sockets beyond the domain.
    Call after :func:`no_new_privs`. Returns the ABI used; raises ``OSError`` where there is none."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError(95, "Landlock is not available in this kernel (or is disabled)")
    fs = (1 << 13) - 1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (
        FS_IOCTL_DEV if abi >= 5 else 0)
    attr = struct.pack("QQQ", fs, NET_BIND_TCP | NET_CONNECT_TCP, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL)
    size = 8 if abi < 4 else 16 if abi < 6 else 24  # the attribute grew with the ABI
    ruleset = check(syscall(LANDLOCK_CREATE_RULESET, attr[:size], size, 0), "landlock_create_ruleset")
    file_rights = FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)
    rules = [(p, FS_READ_FILE | FS_READ_DIR) for p in read]
    rules += [(write, fs & ~FS_EXECUTE)]
    rules += [(path, file_rights if writable else FS_READ_FILE) for path, writable in devices.items()]
    try:
        for path, rights in rules:
            add_rule(ruleset, path, rights)
        check(syscall(LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    finally:
        os.close(ruleset)
    return abi


def add_rule(ruleset: int, path: str, rights: int) -> None:
    """Allow ``rights`` beneath ``path`` (only the file rights where it is a file); a missing path is
    skipped."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
        rule = struct.pack("=Qi", rights, fd)  # struct landlock_path_beneath_attr is packed
        check(syscall(LANDLOCK_ADD_RULE, ruleset, 1, rule, 0), f"landlock_add_rule({path})")
    finally:
        os.close(fd)


# -------------------------------------------------------------------------------------------- seccomp
AUDIT_ARCH_X86_64, AUDIT_ARCH_AARCH64, X32_SYSCALL_BIT = 0xC000003E, 0xC00000B7, 0x40000000
RET_ALLOW, RET_EPERM, RET_ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_ERRNO | errno
LD_W_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|J*|K, BPF_RET|K
CLONE_NEW_ANY = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | (
    CLONE_NEWNET)  # CLONE_NEWTIME (0x80) is the exit signal's byte in clone(2): only clone3/unshare take it
AF_UNIX = 1
# (x86-64, arm64) numbers of what answers EPERM: tracing, namespaces, mounts, keyrings, BPF, perf,
# userfaultfd, kexec, modules, io_uring (it bypasses this filter), file handles
REFUSED_CALLS = {
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438), "kcmp": (312, 272), "unshare": (272, 97), "setns": (308, 268),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431),
    "fsmount": (432, 432), "fspick": (433, 433), "mount_setattr": (442, 442), "keyctl": (250, 219),
    "add_key": (248, 217), "request_key": (249, 218), "bpf": (321, 280), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264)}
CLONE, CLONE3, SOCKET, SOCKETPAIR = (56, 220), (435, 435), (41, 198), (53, 199)


def bpf(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    """One classic BPF instruction (``struct sock_filter``)."""
    return struct.pack("HBBI", code, jt, jf, k)


def arch_rules(arch: int) -> list[bytes]:
    """The filter for one architecture's system call numbers (``arch``: 0 x86-64, 1 arm64); the
    syscall number is in the accumulator."""
    rules = [bpf(JEQ, CLONE3[arch], 0, 1), bpf(RET, RET_ENOSYS)]  # libc falls back to clone(2)
    # clone: its flags (argument 0, low word at offset 16) may hold no CLONE_NEW*
    rules += [bpf(JEQ, CLONE[arch], 0, 4), bpf(LD_W_ABS, 16), bpf(JSET, CLONE_NEW_ANY, 0, 1),
              bpf(RET, RET_EPERM), bpf(RET, RET_ALLOW)]
    for call in (SOCKET, SOCKETPAIR):  # sockets: only AF_UNIX (argument 0)
        rules += [bpf(JEQ, call[arch], 0, 4), bpf(LD_W_ABS, 16), bpf(JEQ, AF_UNIX, 0, 1),
                  bpf(RET, RET_ALLOW), bpf(RET, RET_EPERM)]
    for numbers in REFUSED_CALLS.values():
        rules += [bpf(JEQ, numbers[arch], 0, 1), bpf(RET, RET_EPERM)]
    return [*rules, bpf(RET, RET_ALLOW)]


def seccomp_program() -> bytes:
    """The whole filter: the architecture checked first (any other, i386 from x86-64 included, and x32
    numbers answer EPERM), then :func:`arch_rules` for x86-64 or arm64."""
    x86 = [bpf(LD_W_ABS, 0), bpf(JGE, X32_SYSCALL_BIT, 0, 1), bpf(RET, RET_EPERM), *arch_rules(0)]
    arm = [bpf(LD_W_ABS, 0), *arch_rules(1)]
    program = [bpf(LD_W_ABS, 4), bpf(JEQ, AUDIT_ARCH_X86_64, 0, len(x86)), *x86,
               bpf(JEQ, AUDIT_ARCH_AARCH64, 0, len(arm)), *arm, bpf(RET, RET_EPERM)]
    return b"".join(program)


def install_seccomp() -> None:
    """Load :func:`seccomp_program` for this process and its children, for good (after
    :func:`no_new_privs`)."""
    program = seccomp_program()

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = SockFprog(len(program) // 8, program)
    address = ctypes.addressof(prog)
    check(LIBC.prctl(22, 2, address, 0, 0), "prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)")
