"""vLLM engines shared by the tests of one session (starting one takes ~20 s on a CPU).

``VLLMEngine`` builds its colocated backend through ``lightning_rl.step.vllm_engine.ColocatedLLM``; the
session fixture ``vllm_pool`` (tests/conftest.py) puts :class:`Pool` there instead. A closed engine's LLM
goes back to the pool, and the next engine with the same arguments (the model's config, dtype, caching...)
takes it. Sharing is safe because an engine pushes every weight before it first samples (vLLM starts with
dummy weights) and resets the prefix cache with every push. Only engines started by the main thread are
pooled (vLLM's client must stay with the thread that made it); a forked worker cannot use its parent's
engines: in another process the pool starts real ones, which die with that process.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from lightning_rl.step.vllm_colocated import ColocatedLLM


class Pooled:
    """One pooled LLM lent to one engine; ``close`` returns it."""

    def __init__(self, backend: ColocatedLLM, pool: Pool, key: str) -> None:
        self.backend, self.pool, self.key = backend, pool, key
        self.llm = backend.llm

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.backend.generate(*args, **kwargs)

    def load_weights(self, path: str, timeout: float) -> None:
        self.backend.load_weights(path, timeout)

    def reset_prefix_cache(self) -> None:
        self.backend.reset_prefix_cache()

    def close(self) -> None:
        self.pool.free.setdefault(self.key, []).append(self.backend)


class Pool:
    """Stands in for ``ColocatedLLM(args, model_key)`` (see the module docstring)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.free: dict[str, list[ColocatedLLM]] = {}
        self.started: list[ColocatedLLM] = []

    def __call__(self, args: dict[str, Any], model_key: str, stop: str) -> Any:
        if os.getpid() != self.pid or threading.current_thread() is not threading.main_thread():
            return ColocatedLLM(args, model_key, stop)  # vLLM's client stays with its process and thread
        config = json.loads((Path(args["model"]) / "config.json").read_text())
        config.pop("_name_or_path", None)
        options = {k: v for k, v in args.items() if k != "model"}
        key = json.dumps([config, options], sort_keys=True, default=str)
        free = self.free.setdefault(key, [])
        if free:
            return Pooled(free.pop(), self, key)
        # its processes hold until the pool stops them (the lending engine's folder goes when it closes)
        backend = ColocatedLLM(args, model_key, tempfile.mktemp(prefix="lightning-rl-vllm-pool-stop-"))
        self.started.append(backend)
        return Pooled(backend, self, key)

    def close(self) -> None:
        for backend in self.started:
            backend.close()
        self.started, self.free = [], {}
