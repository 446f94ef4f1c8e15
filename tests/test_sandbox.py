"""Tests for lightning_rl.sandbox: model-written code that loops, forks, hogs memory, writes 1 GB, writes
outside its folder, opens a connection, shells out or looks for secrets is contained and reported, and the
next run goes on; the layers a run had, the refusal where one is missing and the weak opt-in; the audit hook
alone against rebinding; the ``python`` tool. The escapes, as root and as an unprivileged user, are in
``test_sandbox_escapes.py``; the ``code_tests`` reward in ``test_code_judge.py``."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from lightning_rl import sandbox
from lightning_rl.episodes.tools import ToolCall, execute, load_tools
from lightning_rl.sandbox import SandboxUnavailable, run_python
from lightning_rl.sandbox_processes import user_processes

ROOT = Path(__file__).resolve().parents[1]
WHERE = "import os\nprint(os.getcwd(), flush=True)\n"  # each run names its folder on its first line
KERNEL = {"user", "namespaces", "no_new_privs", "landlock", "capabilities", "seccomp", "processes", "rlimits"}
SYSTEM_PYTHON = "/usr/bin/python3"  # one an unprivileged user can run (the test's may be under /root)


def left_in(result) -> list[int]:
    """Processes still running whose working folder is the run's folder (named on its first line)."""
    folder = result.stdout.split("\n")[0]
    assert folder.startswith(os.path.join(os.path.realpath(tempfile.gettempdir()), "lrl-sandbox-"))
    assert not os.path.exists(folder)  # the folder is removed afterwards
    found = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and os.readlink(p / "cwd").startswith(folder):
                found.append(int(p.name))
        except OSError:
            continue
    return found


def test_a_clean_run_sees_a_minimal_environment_and_reports_every_layer(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_123")
    code = WHERE + "print(sorted(os.environ), os.getpid(), os.getppid())\n"
    result = run_python(code, timeout=5)
    assert result.ok and result.stdout.split("\n")[1] == "['HOME', 'LANG', 'PATH'] 2 1"  # PID 2 of its own
    assert KERNEL | {"proc", "audit"} <= set(result.layers) and result.missing == {}
    assert result.layers["namespaces"] == "user pid mount net ipc uts" and result.network == "namespace"
    assert int(result.layers["landlock"].split()[1].rstrip(":")) >= 1  # "ABI 7: files, tcp, ..."
    if os.geteuid() == 0:
        assert result.layers["user"] == "uid 65534 (nobody; the caller is root)"
        assert result.processes == "cgroup" and result.layers["processes"] == "cgroup pids.max 18"


def test_stdin_carries_only_the_code_input_even_rewound():
    """The configuration comes in ``argv``: a rewound stdin holds only what the caller gave."""
    code = "import os, sys\nprint(repr(sys.stdin.read()))\nos.lseek(0, 0, 0)\nprint(repr(sys.stdin.read()))\n"
    assert run_python(code, stdin="abc\n").stdout == "'abc\\n'\n'abc\\n'\n"


def test_exit_codes_and_signals_pass_through_the_namespace_init():
    assert run_python("import sys\nsys.exit(7)").exit_code == 7
    killed = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", audit=False)
    assert killed.exit_code == -15 and killed.reason == "exit code -15"


def test_threads_and_the_standard_library_work_inside():
    """Threads (``clone3`` answers ENOSYS, libc falls back to ``clone``), extension modules with their
    shared libraries, time zones and a temporary file in the folder."""
    code = ("import threading, ssl, sqlite3, hashlib, zlib, decimal, json, lzma, bz2, zoneinfo, tempfile\n"
            "out = []\nthreads = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]\n"
            "[t.start() for t in threads]\n[t.join() for t in threads]\n"
            "with tempfile.TemporaryFile() as f:\n    f.write(b'x')\n"
            "print(sorted(out), hashlib.sha256(b'').hexdigest()[:8], zoneinfo.ZoneInfo('Europe/Paris'),\n"
            "      sqlite3.connect(':memory:').execute('select 1 + 1').fetchone()[0], zlib.crc32(b'a'))\n")
    result = run_python(code)
    assert result.stdout == "[0, 1, 2, 3] e3b0c442 Europe/Paris 2 3904355907\n", result.stderr


def test_an_infinite_loop_is_killed_at_the_wall_clock_timeout():
    start = time.monotonic()
    result = run_python(WHERE + "while True:\n    pass\n", timeout=0.3)
    assert result.timed_out and result.limit == "timeout" and result.exit_code == -9
    assert "0.3 s" in result.reason and 0.3 <= result.wall_time < 2 and time.monotonic() - start < 3
    assert left_in(result) == []


def test_a_fork_bomb_is_refused_by_the_audit_hook():
    result = run_python(WHERE + "while True:\n    os.fork()\n", timeout=2)
    assert result.limit == "refused" and "os.fork" in result.reason and left_in(result) == []


def test_a_fork_bomb_without_the_audit_hook_is_capped_and_every_process_killed():
    """The kernel layers alone: forks stop at ``max_processes`` (the code's own process and 7 forks);
    children that left the process group with ``setsid`` end with the PID namespace."""
    code = WHERE + ("import time\nn = 0\n"
                    "for _ in range(200):\n"
                    "    try:\n"
                    "        if os.fork() == 0:\n"
                    "            os.setsid()\n"
                    "            time.sleep(5)\n"
                    "            os._exit(0)\n"
                    "        n += 1\n"
                    "    except OSError as err:\n"
                    "        print(err)\n"
                    "        break\n"
                    "print(n, flush=True)\n")
    result = run_python(code, timeout=3, max_processes=8, audit=False)
    assert result.stdout.split("\n")[1:3] == ["[Errno 11] Resource temporarily unavailable", "7"]
    assert left_in(result) == []


def test_a_memory_hog_stops_at_the_memory_limit():
    hog = "hog = []\nwhile True:\n    hog.append(bytearray(5 * 10**7))\n"
    result = run_python(WHERE + hog, memory_mb=200)
    assert result.limit == "memory" and result.reason == "MemoryError" and left_in(result) == []


def test_a_1gb_write_and_an_output_flood_stop_at_the_file_size_limit():
    code = WHERE + "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2**20)\n"
    result = run_python(code, file_size_mb=4)
    assert result.limit == "file_size" and "File too large" in result.reason and left_in(result) == []
    flood = run_python("while True:\n    print('x' * 10**5)\n", file_size_mb=1, output_limit=1000)
    assert flood.limit == "file_size" and flood.stdout.endswith("\n[... cut]") and len(flood.stdout) < 1100


def test_writes_outside_the_folder_are_refused(tmp_path):
    outside = tmp_path / "outside.txt"
    result = run_python(f"open({str(outside)!r}, 'w').write('x')\n")
    assert result.limit == "refused" and "for writing outside the sandbox folder" in result.reason
    tricks = (f"import os\nos.symlink({str(outside)!r}, 'link')\n"  # a link inside, then write through it
              "for attempt in (lambda: open('link', 'a').write('x'),\n"
              f"                lambda: os.rename('main.py', {str(outside)!r}),\n"
              f"                lambda: os.mkdir({str(tmp_path / 'dir')!r})):\n"
              "    try:\n        attempt()\n    except PermissionError:\n        print('refused')\n")
    assert run_python(tricks).stdout == "refused\n" * 3
    assert run_python(tricks, audit=False).stdout == "refused\n" * 3  # Landlock alone
    assert list(tmp_path.iterdir()) == []


def test_os_system_subprocess_ctypes_and_native_modules_are_refused(tmp_path):
    touched = tmp_path / "touched"
    result = run_python(f"import os\nos.system('touch {touched}')\n")
    assert result.limit == "refused" and result.reason == "PermissionError: sandbox refused os.system"
    assert result.stderr.startswith("Traceback") and "sandbox_child.py" not in result.stderr  # its own frames
    tricks = ("import _json, shutil, subprocess, sys\n"  # `native` copies a native module into the folder
              "lib, so = _json.__file__, '_json' + _json.__file__.rsplit('_json', 1)[1]\n"
              "def native():\n    shutil.copyfile(lib, so)\n    sys.path.insert(0, '.')\n"
              "    del sys.modules['_json']\n    import _json\n"
              f"for attempt in (lambda: subprocess.run(['touch', {str(touched)!r}]),\n"
              "                lambda: __import__('ctypes').CDLL(None).system(b'true'), native):\n"
              "    try:\n        attempt()\n    except PermissionError as err:\n        print(err)\n")
    shell, ctypes, native = run_python(tricks).stdout.split("\n")[:3]
    assert (shell, ctypes) == ("sandbox refused subprocess.Popen", "sandbox refused ctypes.dlopen")
    assert native.startswith("sandbox refused loading the native module") and "lrl-sandbox-" in native
    kernel = run_python(tricks, audit=False).stdout.split("\n")  # no exec anywhere: not even a shell
    assert kernel[0] == "[Errno 13] Permission denied: 'touch'" and not touched.exists()


def test_a_network_connection_fails_and_reaches_nothing():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        refused = run_python(code)
        assert refused.limit == "refused" and "socket" in refused.reason
        kernel = run_python(code, audit=False)  # seccomp: no socket but AF_UNIX; no device in the namespace
        assert kernel.limit == "refused" and kernel.reason.endswith("[Errno 1] Operation not permitted")
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


# ------------------------------------------------------------------------- refusal and the weak opt-in
def test_a_missing_layer_is_refused_by_default_and_reported_when_weak_is_accepted(monkeypatch):
    """Landlock turned off in the child (as where the kernel has none): ``strict`` refuses before any
    code runs, naming the layer and the opt-in; ``weak`` (argument or environment variable, which the
    tool reads) runs without it, and the gap is real: a world-readable file outside is then readable."""
    code = "print(open('/etc/passwd').read()[:5])"
    assert run_python(code, audit=False).limit == "refused"  # with every layer: Landlock keeps it out
    monkeypatch.setattr(sandbox, "DISABLED_LAYERS", frozenset({"landlock"}))
    with pytest.raises(SandboxUnavailable, match=r"lacks landlock: turned off .*containment='weak'.*"
                                                 r"LIGHTNING_RL_SANDBOX=weak"):
        run_python(code, audit=False)
    (tool,) = load_tools(["lightning_rl.sandbox:python"])
    call = ToolCall("python", {"code": "print(6 * 7)"})
    refused = execute({"python": tool}, call, timeout=10)
    assert refused.error and "lacks landlock" in refused.content
    weak = run_python(code, audit=False, containment="weak")
    assert weak.stdout == "root:\n" and "landlock" not in weak.layers
    assert weak.missing == {"landlock": "turned off by the caller (sandbox.DISABLED_LAYERS)"}
    monkeypatch.setenv("LIGHTNING_RL_SANDBOX", "weak")
    ok = execute({"python": tool}, call, timeout=10)
    assert (ok.content, ok.error) == ("42\n", False)


def test_a_bad_containment_names_where_it_came_from(monkeypatch):
    with pytest.raises(ValueError, match=r"containment='loose': .*'strict' \(the default\) or 'weak'"):
        run_python("pass", containment="loose")
    monkeypatch.setenv("LIGHTNING_RL_SANDBOX", "off")
    with pytest.raises(ValueError, match=r"LIGHTNING_RL_SANDBOX='off'"):
        run_python("pass")


def test_the_audit_hook_alone_holds_against_rebinding(tmp_path, monkeypatch):
    """Every kernel layer off but the limits: rebinding names the old hook looked up (in ``__main__``,
    the child module's globals through a frame, ``builtins``, ``os``), reaching its closure (``gc``, a
    trace function, a traceback's frame) and ``dir_fd`` writes change nothing."""
    kernel = {"user", "namespaces", "no_new_privs", "landlock", "capabilities", "seccomp"}
    monkeypatch.setattr(sandbox, "DISABLED_LAYERS", frozenset(kernel))
    target = str(tmp_path / "escaped")
    attacks = [
        "import __main__\n__main__.refusal = lambda *a: ''",
        "import sys\nsys._getframe(1).f_globals.update(refusal=lambda *a: '', under=lambda *a: True)",
        "import builtins\nbuiltins.isinstance = lambda *a: False\nbuiltins.any = lambda *a: True",
        "import os, posixpath\nposixpath.realpath = lambda p, **k: os.getcwd()\nos.lstat = os.getcwd = None",
        "import gc\ngc.get_objects()",
        "import sys\nsys.settrace(lambda *a: None)",
        "try:\n    open('/etc/shadow')\nexcept PermissionError as e:\n    tb = e.__traceback__.tb_next\n"
        "    print(sorted(tb.tb_frame.f_locals))",
        "import os\nos.mkdir('made', dir_fd=os.open(os.path.dirname(os.__file__), os.O_RDONLY))",
    ]
    for attack in attacks:
        result = run_python(attack + f"\nopen({target!r}, 'w').write('x')\n", containment="weak")
        assert result.limit == "refused" and "sandbox refused" in result.stderr, (attack, result.stderr)
        assert "landlock" in result.missing and not os.path.exists(target)
    assert "['args', 'event', 'what']" in run_python(attacks[6], containment="weak").stdout
    assert "os.mkdir with a dir_fd" in run_python(attacks[7], containment="weak").reason


# --------------------------------------------------------------- private folders and other users
def test_the_sandbox_works_when_the_interpreter_and_its_folder_are_private(tmp_path, monkeypatch):
    """Root's ``nobody`` cannot search a 0700 folder: the child covers it with a tmpfs in a mount namespace
    of its own and binds the interpreter's library and the run's folder back (here the interpreter lives
    under /root, and the run's folder under a private temporary folder)."""
    if os.geteuid() != 0:
        pytest.skip("only root drops to another user")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    code = "import json, os\nopen('n', 'w').write(json.dumps([1]))\nprint(open('n').read(), os.getcwd())"
    result = run_python(code)
    assert result.ok and result.stdout.startswith(f"[1] {private}/lrl-sandbox-"), result.stderr
    covered = result.layers["mounts"].split(": ")[1].split(", ")
    assert str(tmp_path.parents[-2]) in covered or any(str(private).startswith(c) for c in covered)
    assert "/proc" not in covered and result.layers["user"].startswith("uid 65534")


def test_user_processes_counts_threads_as_the_kernel_does():
    """``RLIMIT_NPROC`` counts tasks: a process of an otherwise unused user with 3 threads counts 4."""
    if os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip("needs root to start a process as another user")
    code = ("import sys, threading\nfor _ in range(3):\n    threading.Thread(target=sys.stdin.read).start()\n"
            "print('up', flush=True)\n")
    assert user_processes(54321) == 0
    proc = subprocess.Popen([SYSTEM_PYTHON, "-c", code], user=54321, group=54321, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        assert user_processes(54321) == 4
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


@pytest.mark.slow
def test_the_cpu_time_limit_stops_a_loop_before_the_timeout():
    result = run_python("while True:\n    pass\n", timeout=10, cpu_seconds=1)
    assert result.limit == "cpu" and not result.timed_out and result.wall_time < 5


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs root to start an unprivileged user and a system python it can run")
def test_an_unprivileged_user_gets_every_layer_and_rlimit_nproc_for_the_run():
    """A trainer that is not root, run from a copy it can read (the checkout may be private): its own user,
    the namespaces, Landlock and seccomp, and ``RLIMIT_NPROC`` counted in the run's user namespace."""
    copy = Path(tempfile.mkdtemp(prefix="lrl-copy-"))
    try:
        skip = shutil.ignore_patterns("__pycache__")
        shutil.copytree(ROOT / "lightning_rl", copy / "lightning_rl", ignore=skip)
        for p in [copy, *copy.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        bomb = ("import os, time\nn = 0\nfor _ in range(100):\n    try:\n        if os.fork() == 0:\n"
                "            time.sleep(3)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
                "        break\nprint(n)\n")
        script = (f"import sys; sys.path.insert(0, {str(copy)!r})\n"
                  "from lightning_rl.sandbox import run_python\n"
                  f"r = run_python({bomb!r}, timeout=10, max_processes=8, audit=False)\n"
                  "print(r.layers['user'], '|', r.layers['processes'], '|', r.stdout.strip())\n"
                  "r = run_python('import socket; socket.socket()', audit=False)\n"
                  "print(r.network, r.reason, sorted(r.layers))\n")
        out = subprocess.run([SYSTEM_PYTHON, "-I", "-c", script], user=65534, group=65534, extra_groups=[],
                             cwd="/", capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(copy)
    lines = out.stdout.split("\n")
    user, processes, forks = (lines[0].split(" | ") + ["", ""])[:3]
    assert (user, processes) == ("uid 65534 (the caller; not root)", "RLIMIT_NPROC 10 (this run's threads)")
    assert forks == "7", out.stderr  # the code's own process and 7 forks: 8
    every = sorted(KERNEL | {"proc"})
    assert lines[1] == f"namespace PermissionError: [Errno 1] Operation not permitted {every}"


# ---------------------------------------------------------------------------------------------- the tool
def test_the_python_tool_loads_by_import_path_and_answers_output_or_the_error():
    (tool,) = load_tools(["lightning_rl.sandbox:python"])
    assert tool.name == "python" and tool.schema["function"]["parameters"]["required"] == ["code"]
    ok = execute({"python": tool}, ToolCall("python", {"code": "print(sum(range(10)))"}), timeout=10)
    assert (ok.content, ok.error) == ("45\n", False)
    bad = execute({"python": tool}, ToolCall("python", {"code": "import os\nos.system('ls')"}), timeout=10)
    assert bad.error and "sandbox refused os.system" in bad.content

