"""Tests for lightning_rl.sandbox: model-written code that loops, forks, hogs memory, writes 1 GB, writes
outside its folder, opens a connection, shells out or looks for secrets is contained and reported, and the
next run goes on; the ``python`` tool and the ``code_tests`` reward."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from lightning_rl import sandbox
from lightning_rl.episodes.tools import ToolCall, execute, load_tools
from lightning_rl.sandbox import code_tests, extract_code, run_python, split_tests

ROOT = Path(__file__).resolve().parents[1]
WHERE = "import os\nprint(os.getcwd(), flush=True)\n"  # each run names its folder on its first line


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


def test_a_clean_run_sees_a_minimal_environment_and_no_secrets(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_123")
    code = WHERE + ("print(sorted(os.environ))\n"
                    "open(f'/proc/{os.getppid()}/environ').read()\n")
    result = run_python(code, timeout=5)
    assert result.stdout.split("\n")[1] == "['HOME', 'LANG', 'PATH']"
    assert "hf_secret_123" not in result.stdout + result.stderr
    assert result.limit == "refused" and "environ" in result.reason and not result.ok


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
    """The kernel layer alone: forks stop at ``max_processes``; children that left the process group with
    ``setsid`` are killed too where there is a pids cgroup (as root here)."""
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
    lines = result.stdout.split("\n")
    assert lines[1] == "[Errno 11] Resource temporarily unavailable" and int(lines[2]) <= 7
    if result.processes != "cgroup":
        pytest.skip("no pids cgroup here: children that call setsid outlive the group kill")
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
    assert not touched.exists()


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
        kernel = run_python(code, audit=False)  # the namespace alone
        if kernel.network != "namespace":
            pytest.skip("no network namespace here: only the audit hook refuses sockets")
        assert kernel.limit is None and "Network is unreachable" in kernel.reason
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


@pytest.mark.slow
def test_the_cpu_time_limit_stops_a_loop_before_the_timeout():
    result = run_python("while True:\n    pass\n", timeout=10, cpu_seconds=1)
    assert result.limit == "cpu" and not result.timed_out and result.wall_time < 5


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK),
                    reason="needs root to start an unprivileged user and a system python it can read")
def test_an_unprivileged_user_gets_a_user_and_network_namespace_and_rlimit_nproc():
    """What a user who is not root gets: no cgroup, so ``RLIMIT_NPROC``; the network namespace through a
    user namespace where the kernel allows it."""
    bomb = ("import os, time\nn = 0\nfor _ in range(100):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(3)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
            "        break\nprint(n)\n")
    script = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
              "from lightning_rl.sandbox import run_python\n"
              f"r = run_python({bomb!r}, timeout=10, max_processes=8, audit=False)\n"
              "print(r.processes, r.stdout.strip())\n"
              "r = run_python(\"import socket\\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\","
              " audit=False)\n"
              "print(r.network, r.reason)\n")
    out = subprocess.run(["/usr/bin/python3", "-I", "-c", script], user=65534, group=65534, cwd="/",
                         capture_output=True, text=True, timeout=60)
    lines = out.stdout.split("\n")
    assert lines[0].startswith("rlimit ") and int(lines[0].split()[1]) <= 8, out.stdout + out.stderr[-2000:]
    assert lines[1] in ("namespace exit code 1: OSError: [Errno 101] Network is unreachable",
                        "audit hook exit code 1: ConnectionRefusedError: [Errno 111] Connection refused")


# ------------------------------------------------------------------------------------ tool and reward
def test_the_python_tool_loads_by_import_path_and_answers_output_or_the_error():
    (tool,) = load_tools(["lightning_rl.sandbox:python"])
    assert tool.name == "python" and tool.schema["function"]["parameters"]["required"] == ["code"]
    ok = execute({"python": tool}, ToolCall("python", {"code": "print(sum(range(10)))"}), timeout=10)
    assert (ok.content, ok.error) == ("45\n", False)
    bad = execute({"python": tool}, ToolCall("python", {"code": "import os\nos.system('ls')"}), timeout=10)
    assert bad.error and "sandbox refused os.system" in bad.content


def test_extract_code_and_split_tests():
    assert extract_code("Here:\n```python\nx = 1\n```\nand\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("x = 3") == "x = 3"
    two = ["assert f(1) == 2", "assert f(\n    2) == 3"]
    assert split_tests("assert f(1) == 2\nassert f(\n    2) == 3\n") == two
    assert split_tests(["assert True"]) == ["assert True"]
    with pytest.raises(ValueError, match="`tests` column"):
        split_tests("assert (")


def test_code_tests_scores_the_fraction_of_asserts_passed(monkeypatch):
    monkeypatch.setattr(sandbox, "TEST_TIMEOUT", 0.5)
    three = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 5"]
    completions = [
        "Sure:\n```python\ndef add(a, b):\n    return a + b\n```",  # 1 and 2 pass, 3 is wrong: 2/3
        "def add(a, b):\n    return a - b",  # only add(0, 0): 1/3
        "def add(a, b):\n    while True:\n        pass",  # hangs on the first test: 0 before the timeout
        "print('pass')\nimport sys\nsys.exit(0)",  # forged output without the nonce: 0
        "import builtins\nbuiltins.exec = builtins.compile = lambda *a: None",  # tests skipped: 0
        "def add(a, b):\n    return a + b",  # the tests as one string: 2/2
    ]
    tests = [three] * 5 + ["assert add(1, 1) == 2\nassert add(-1, 1) == 0"]
    scores = code_tests(["p"] * 6, completions, tests=tests, answer=["unused"] * 6)
    assert [round(s, 4) for s in scores] == [0.6667, 0.3333, 0.0, 0.0, 0.0, 1.0]


def test_code_tests_by_import_path_through_the_reward_scorer_reads_the_tests_column():
    from lightning_rl.step.reward_scorer import RewardScorer

    scorer = RewardScorer(["lightning_rl.sandbox:code_tests"], weights=[2.0])
    totals, failed = scorer(["p", "q"], ["x = 1", "x = 2"], tests=[["assert x == 1"], ["assert x == 1"]])
    assert (totals, failed) == ([2.0, 0.0], 0)
