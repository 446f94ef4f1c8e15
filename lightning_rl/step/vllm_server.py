"""``mode: server`` of :class:`~lightning_rl.step.vllm_engine.VLLMEngine`: :class:`VLLMServer`, an
OpenAI-compatible vLLM server in its own process (its own session, so a Ctrl-C to the terminal reaches the
trainer alone), started from a configured interpreter or command and stopped with the run, or an existing
one at a URL, behind the interface :class:`~lightning_rl.step.vllm_colocated.ColocatedLLM` also has
(``generate``, ``load_weights``, ``reset_prefix_cache``, ``close``). Every call has a timeout; a server that
does not come up, or dies, is reported with the last lines of its log and, last, what happened.

It loads weights through the worker extension :class:`lightning_rl.step.vllm_worker.WeightLoader` behind its
``/collective_rpc`` route, which needs ``VLLM_SERVER_DEV_MODE=1`` (a started server gets it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_rl.step.vllm_colocated import EXTENSION, KEY, OWNER, SHUTDOWN_SECONDS, STOP, Sample

SERVED_NAME = "lightning-rl-policy"


@dataclass(frozen=True)
class VLLMServerOptions:
    """``model.engine.init_args.server``: the vLLM server of ``mode: server``.

    Args:
        url: an already running server (``http://host:port``), started with
            ``--worker-extension-cls lightning_rl.step.vllm_worker.WeightLoader`` and
            ``VLLM_SERVER_DEV_MODE=1`` so that weights can be pushed; ``None``: lightning-rl starts one per
            rank and stops it with the run. With a URL every rank shares the server and rank 0 pushes the
            weights (identical on every rank).
        python: the interpreter that runs ``-m vllm.entrypoints.openai.api_server`` (a virtualenv of its
            own, say); ``None``: this one.
        command: the whole command that starts a server instead (``[vllm, serve]``); the model, port and
            engine flags are appended.
        host: the address a started server listens on.
        port: its port; ``None``: a free one.
        startup_timeout: seconds a started server (or the URL) has to answer ``/health``.
        request_timeout: seconds one generation request may take.
    """

    url: str | None = None
    python: str | None = None
    command: list[str] | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    startup_timeout: float = 600.0
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        for name in ("startup_timeout", "request_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"`{KEY}.server.{name}` must be > 0 seconds, got {getattr(self, name)}")
        if self.url is not None and (self.python is not None or self.command is not None):
            raise ValueError(f"`{KEY}.server.url` is a running server: `server.python` and `server.command` "
                             "start one; set one or the other")


class VLLMServer:
    """A vLLM server: started here (``args``: the engine's arguments, as command-line flags) or at
    ``options.url``. ``folder``: the model folder it serves (config only: the weights are pushed)."""

    def __init__(self, options: VLLMServerOptions, args: dict[str, Any], log_path: str, stop: str) -> None:
        self.options, self.process, self.log_path, self.stop = options, None, log_path, stop
        self.model = SERVED_NAME
        if options.url is not None:
            self.url = options.url.rstrip("/")
            self.wait_healthy()
            self.model = self.served_model()
        else:
            port = options.port or free_port(options.host)
            self.url = f"http://{options.host}:{port}"
            self.start(args, port)
        self.check_extension()

    # ---- process -------------------------------------------------------------------------------
    def start(self, args: dict[str, Any], port: int) -> None:
        command = (list(self.options.command) if self.options.command is not None else
                   [self.options.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
        flags = {**args, "served_model_name": SERVED_NAME, "host": self.options.host, "port": port,
                 "disable_uvicorn_access_log": True}
        # dies with the trainer (PR_SET_PDEATHSIG survives the exec) and in its own session
        guard = ["-c", "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
                       "os.execvp(sys.argv[1], sys.argv[1:])"]
        env = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": SHUTDOWN_SECONDS, **os.environ,
               "VLLM_SERVER_DEV_MODE": "1", OWNER: str(os.getpid()), STOP: self.stop,
               "PYTHONPATH": os.pathsep.join(filter(None, [package_root(), os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([sys.executable, *guard, *command, *cli_flags(flags)], stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                            start_new_session=True)
        self.wait_healthy()

    def wait_healthy(self) -> None:
        """Wait for ``/health`` (``server.startup_timeout``); a started server's exit is reported at once."""
        deadline = time.monotonic() + self.options.startup_timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        tail = self.log_tail()  # before close(): the log goes with the folder
        self.close()
        raise RuntimeError(f"{tail}the vLLM server at {self.url} did not answer /health within "
                           f"{self.options.startup_timeout:g} s (`{KEY}.server.startup_timeout`)")

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            code = self.process.returncode
            self.process = None
            raise RuntimeError(f"{self.log_tail()}the vLLM server exited with code {code}")

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` of a started server's log, as the head of an error whose last line says
        what happened."""
        if self.options.url is not None or not Path(self.log_path).exists():
            return ""
        with open(self.log_path, errors="replace") as f:
            tail = "".join(deque(f, maxlen=lines))
        return f"the last lines of the vLLM server's log ({self.log_path}):\n{tail.rstrip()}\n"

    def close(self) -> None:
        """Stop a started server and everything it started (its session), at most ~30 s."""
        process, self.process = self.process, None
        if process is None:
            return
        Path(self.stop).touch()
        stop_group(process)

    # ---- calls ---------------------------------------------------------------------------------
    def call(self, route: str, body: dict[str, Any] | None, timeout: float, what: str) -> Any:
        """POST ``body`` to ``route`` (GET without a body); the JSON reply. Failures name ``what``."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{route}", data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                text = reply.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:500]
            raise RuntimeError(f"the vLLM server refused {what} ({err.code}: {detail})") from err
        except (urllib.error.URLError, OSError) as err:
            self.check_alive()
            if isinstance(getattr(err, "reason", err), TimeoutError) or isinstance(err, TimeoutError):
                raise TimeoutError(f"the vLLM server at {self.url} did not answer {what} within {timeout:g} s"
                                   ) from err
            raise RuntimeError(f"the vLLM server at {self.url} is unreachable for {what} ({err})") from err
        return json.loads(text) if text else None

    def served_model(self) -> str:
        return self.call("/v1/models", None, 30, "the model list")["data"][0]["id"]

    def check_extension(self) -> None:
        try:
            reply = self.call("/collective_rpc", {"method": "lrl_ping"}, 60, "a weight-loader check")
        except RuntimeError as err:
            raise RuntimeError(f"the vLLM server at {self.url} cannot take weights: it must run with "
                               f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION} ({err})"
                               ) from err
        if "lightning-rl" not in json.dumps(reply):
            raise RuntimeError(f"the vLLM server at {self.url} runs without --worker-extension-cls "
                               f"{EXTENSION}")

    def generate(self, prompts: list[list[int]], params: dict[str, Any], n: int,
                 seeds: list[int] | None) -> list[list[Sample]]:
        """One request per prompt (each its own seed), sent concurrently."""
        body = {"model": self.model, "n": n, "return_token_ids": True, "detokenize": False,
                "return_tokens_as_token_ids": True, **completion_params(params)}

        def one(i: int) -> list[Sample]:
            request = {**body, "prompt": prompts[i], **({} if seeds is None else {"seed": seeds[i]})}
            reply = self.call("/v1/completions", request, self.options.request_timeout,
                              f"a generation request (`{KEY}.server.request_timeout`)")
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            return [(c["token_ids"], None if c.get("logprobs") is None else c["logprobs"]["token_logprobs"])
                    for c in choices]

        if not prompts:
            return []
        with ThreadPoolExecutor(max_workers=min(32, len(prompts))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def load_weights(self, path: str, timeout: float) -> None:
        self.call("/collective_rpc", {"method": "lrl_load_weights", "args": [path], "timeout": timeout},
                  timeout, f"a weight push (`{KEY}.weight_timeout`)")

    def reset_prefix_cache(self) -> None:
        self.call("/reset_prefix_cache", {}, 60, "a prefix-cache reset")


def completion_params(params: dict[str, Any]) -> dict[str, Any]:
    """``SamplingParams`` keywords as the completions API spells them."""
    out = dict(params)
    if "logprobs" in out and out["logprobs"] is None:
        del out["logprobs"]
    return out


def cli_flags(args: dict[str, Any]) -> list[str]:
    """``{"max_model_len": 64, "enforce_eager": True}`` -> ``["--max-model-len", "64", "--enforce-eager"]``
    (``False``: ``--no-<flag>``; ``None``: left out; lists spread; mappings as JSON)."""
    flags: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list | tuple):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def package_root() -> str:
    """The folder holding the ``lightning_rl`` package (a server in another virtualenv imports the worker
    extension from it)."""
    return str(Path(__file__).resolve().parents[2])


def stop_group(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to ``process``'s session (vLLM shuts its engine down), then SIGKILL to whatever of it is left
    after ``grace`` seconds (its engine core, when the server itself died first)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)  # anyone of the session left?
        except ProcessLookupError:
            break
        process.poll()
        time.sleep(0.2)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
