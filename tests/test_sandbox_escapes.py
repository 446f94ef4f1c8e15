"""Escapes from the sandbox, each run as a model would write it, as this test's user (root here) and as an
unprivileged user, with the audit hook and without it (the kernel layers alone): each fails, and nothing
happened outside (no file created, moved or removed, no secret printed, no connection reached, no process
left behind or killed).

Each escape prints its folder first and ``ESCAPED <what>`` for whatever got through."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from string import Template

import pytest

from lightning_rl.sandbox import run_python

ROOT = Path(__file__).resolve().parents[1]
SECRET = "lrl-secret-5f3a9c"
SYSTEM_PYTHON = "/usr/bin/python3"  # one the unprivileged user can run (the test's may be under /root)
REBIND = "import __main__\n__main__.refusal = lambda *a, **k: ''\n"  # what switched the old hook off
TRY = """
for what, act in attempts:
    try:
        print("ESCAPED", what, act())
    except OSError as err:
        print(what, err)
"""
ESCAPES = {
    "the trainer's environment": REBIND + """
attempts = [(pid, lambda pid=pid: open(f"/proc/{pid}/environ").read()) for pid in (os.getppid(), $trainer)]
""" + TRY,
    "os.popen": REBIND + "print('ESCAPED', os.popen('env; touch $outside/popen').read())\n",
    "a write outside": REBIND + "open('$outside/written', 'w').write('x')\nprint('ESCAPED write')\n",
    "dir_fd": """
fd = os.open("$outside", os.O_PATH)
attempts = [("open", lambda: os.open("x", os.O_WRONLY | os.O_CREAT, dir_fd=fd)),
            ("rename", lambda: os.rename("main.py", "moved", dst_dir_fd=fd)),
            ("remove", lambda: os.remove("victim", dir_fd=fd)),
            ("mkdir", lambda: os.mkdir("made", dir_fd=fd))]
""" + TRY,
    "a symbolic link out": """
os.symlink("$outside/via_link", "out")
os.symlink("$outside/secret.txt", "in")
attempts = [("write", lambda: open("out", "w").write("x")), ("read", lambda: open("in").read())]
""" + TRY,
    "a hard link out": """
open("mine", "w").write("x")
attempts = [("out", lambda: os.link("mine", "$outside/hardlink")),
            ("in", lambda: os.link("$outside/secret.txt", "stolen") or open("stolen").read())]
""" + TRY,
    "a fork bomb": """
import time
n = 0
for _ in range(100):
    try:
        if os.fork() == 0:
            os.setsid()
            time.sleep(30)
            os._exit(0)
        n += 1
    except OSError:
        break
print("forked", n)
""",
    "a connection": REBIND + """
import socket
socket.create_connection(("127.0.0.1", $port), timeout=1)
print("ESCAPED connected")
""",
    "ctypes system calls": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for what, call in [("unshare", lambda: libc.unshare(0x10000000 | 0x40000000)),
                   ("syscall unshare", lambda: libc.syscall(272, 0x20000)),
                   ("setns", lambda: libc.syscall(308, 0, 0)),
                   ("mount", lambda: libc.mount(b"none", b".", b"tmpfs", 0, None)),
                   ("ptrace", lambda: libc.ptrace(16, $sentinel, 0, 0)),  # PTRACE_ATTACH
                   ("keyctl", lambda: libc.syscall(250, 0, -3, 0))]:
    print("ESCAPED" if call() != -1 else "refused", what, ctypes.get_errno())
""",
    "a 1 GB write": """
def write(name):
    with open(name, "wb") as f:
        for _ in range(1024):
            f.write(b"0" * 2**20)
attempts = [(name, lambda name=name: write(name)) for name in ("big", "$outside/big")]
""" + TRY.replace('print("ESCAPED", what, act())', 'act()\n        print("ESCAPED 1 GB in", what)'),
    "secret files": """
attempts = [(path, lambda path=path: open(path).read())
            for path in ("/etc/shadow", "$outside/secret.txt", "$checkout")]
""" + TRY,
    "the trainer in /proc": """
try:
    pids = os.listdir("/proc")
    print("ESCAPED" if "$trainer" in pids else "hidden", pids)
except OSError as err:
    print(err)
""",
    # a process of the sandbox's user: not kill(-1), which a sandbox broken to run as root would obey
    "killing a process outside": "import signal\nos.kill($sentinel, signal.SIGKILL)\nprint('ESCAPED kill')\n",
}


@pytest.fixture
def outside():
    """A folder anyone may write, holding a secret anyone may read: only the sandbox keeps code out."""
    path = Path(tempfile.mkdtemp(prefix="lrl-outside-"))
    path.chmod(0o777)
    (path / "secret.txt").write_text(SECRET)
    (path / "victim").write_text("still here")
    for child in path.iterdir():
        child.chmod(0o666)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def sentinel():
    """A process of the sandbox's user (``nobody``) outside the sandbox: it must survive every escape."""
    if os.geteuid() != 0:
        yield None
        return
    proc = subprocess.Popen(["sleep", "60"], user=65534, group=65534, extra_groups=[])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def server():
    """A listening loopback server: no connection from the sandbox may reach it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.setblocking(False)
    yield sock
    sock.close()


def programs(outside: Path, port: int, sentinel: subprocess.Popen | None) -> dict[str, str]:
    """Every escape, filled in; each first prints its folder."""
    fill = {"outside": outside, "port": port, "trainer": os.getpid(), "checkout": ROOT / "pyproject.toml",
            "sentinel": sentinel.pid if sentinel else 1}  # no sentinel: its test is skipped
    return {name: "import os\nprint(os.getcwd(), flush=True)\n" + Template(code).substitute(fill)
            for name, code in ESCAPES.items()}


def assert_contained(name: str, stdout: str, stderr: str, outside: Path, server: socket.socket) -> None:
    """Nothing got through: no ``ESCAPED``, no secret, the folder outside as it was, no connection, no
    process left in the run's folder."""
    assert "ESCAPED" not in stdout and SECRET not in stdout + stderr, (name, stdout, stderr)
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt", "victim"], name
    assert (outside / "victim").read_text() == "still here"
    with pytest.raises(BlockingIOError):
        server.accept()
    folder = stdout.split("\n")[0]
    assert folder.startswith(os.path.realpath(tempfile.gettempdir())), (name, stdout, stderr)
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and cwd_of(p).startswith(folder)]
    assert left == [], name
    if name == "a fork bomb":
        assert int(stdout.split("forked ")[1]) < 8  # the code's own process and 7 forks at most


def cwd_of(proc: Path) -> str:
    try:
        return os.readlink(proc / "cwd")
    except OSError:
        return ""


@pytest.mark.parametrize("audit", [True, False], ids=["hook", "kernel-only"])
@pytest.mark.parametrize("name", list(ESCAPES))
def test_an_escape_fails_and_nothing_happens_outside(name, audit, outside, server, sentinel, monkeypatch):
    monkeypatch.setenv("LRL_TRAINER_SECRET", SECRET)
    if name == "killing a process outside" and sentinel is None:
        pytest.skip("needs root to start a process as the sandbox's user")
    result = run_python(programs(outside, server.getsockname()[1], sentinel)[name], audit=audit, timeout=5,
                        memory_mb=256, file_size_mb=8, max_processes=8)
    assert not result.timed_out, result
    assert_contained(name, result.stdout, result.stderr, outside, server)
    assert sentinel is None or sentinel.poll() is None


@pytest.fixture
def readable_copy():
    """The package copied where the unprivileged user can read it (the checkout may be in a private
    folder); the sandbox and what it imports need the standard library only."""
    path = Path(tempfile.mkdtemp(prefix="lrl-copy-"))
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "lightning_rl", path / "lightning_rl", ignore=skip)
    for p in [path, *path.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    yield path
    shutil.rmtree(path)


RUNNER = """\
import json, sys
sys.path.insert(0, sys.argv[1])
from lightning_rl.sandbox import run_python
for name, code in json.loads(sys.stdin.read()).items():
    r = run_python(code, audit=sys.argv[2] == "1", timeout=5, memory_mb=256, file_size_mb=8, max_processes=8)
    print(json.dumps([name, r.stdout, r.stderr, r.timed_out, r.layers]), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("audit", [True, False], ids=["hook", "kernel-only"])
@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs root to start an unprivileged user, and a system python it can run")
def test_every_escape_fails_as_an_unprivileged_user(audit, outside, server, sentinel, readable_copy,
                                                     monkeypatch):
    """The trainer as ``nobody``, from a copy it can read: the same escapes, the same checks."""
    monkeypatch.setenv("LRL_TRAINER_SECRET", SECRET)
    codes = programs(outside, server.getsockname()[1], sentinel)
    out = subprocess.run([SYSTEM_PYTHON, "-I", "-c", RUNNER, str(readable_copy), str(int(audit))],
                         input=json.dumps(codes), user=65534, group=65534, extra_groups=[], cwd="/",
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r[0] for r in results] == list(codes)
    for name, stdout, stderr, timed_out, layers in results:
        assert not timed_out and layers["user"] == "uid 65534 (the caller; not root)", (name, layers)
        assert_contained(name, stdout, stderr, outside, server)
    assert sentinel.poll() is None
