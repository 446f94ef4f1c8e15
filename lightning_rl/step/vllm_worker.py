"""What lightning-rl adds to a vLLM worker (``worker_extension_cls``): loading a weight version from the
safetensors file :mod:`lightning_rl.step.vllm_weights` wrote, by vLLM's own loading path.

vLLM imports this module in its worker process (the engine core of a colocated ``vllm.LLM``, or a server's
worker), so it imports nothing from lightning-rl but this file's own needs (torch and safetensors), and a
server in another virtualenv can load it from the package folder alone.

It also makes the vLLM processes lightning-rl starts *hold*: each dies with the process that started it
(``PR_SET_PDEATHSIG``: a trainer killed outright leaves no engine behind), ignores SIGINT, and ignores
SIGTERM while that process lives and has not asked it to stop (the file ``LIGHTNING_RL_VLLM_STOP`` names
exists). So a Ctrl-C to the terminal's process group, or a scheduler's SIGTERM to every process of the job,
reaches the trainer alone, which finishes its step, saves its checkpoint and only then stops the engine
(or dies, and the engine with it). :func:`plugin` is registered as a vLLM general plugin (loaded by every vLLM
process, after vLLM installed its own signal handlers) and acts only in processes started under the
trainer whose pid ``LIGHTNING_RL_VLLM_OWNER`` names, never in the trainer itself or in a vLLM the user runs
otherwise; the worker's first call holds it again (a server from another virtualenv lacks the plugin).
Importing this module does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Any

import torch

PR_SET_PDEATHSIG = 1
OWNER = "LIGHTNING_RL_VLLM_OWNER"  # the pid of the process that starts the vLLM engine
STOP = "LIGHTNING_RL_VLLM_STOP"  # a file that exists once the owner stops the engine


def plugin() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: hold this process if lightning-rl started it."""
    owner = os.environ.get(OWNER, "")
    if owner.isdigit() and int(owner) != os.getpid():
        hold_process()


def hold_process() -> None:
    """Die with the parent (SIGTERM: vLLM's own clean shutdown), leave SIGINT to the trainer, and take
    SIGTERM only once the parent is gone or asked for it (see the module docstring). Idempotent."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the trainer's close() is then the only stop
        pass
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "holds", False):
        return
    parent, stop = os.getppid(), os.environ.get(STOP, "")

    def on_sigterm(signum: int, frame: Any) -> None:
        if os.getppid() == parent and not (stop and os.path.exists(stop)):
            return  # the trainer lives: it saves its checkpoint, then stops this engine itself
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    on_sigterm.holds = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, on_sigterm)


class WeightLoader:
    """Mixed into vLLM's worker class: the methods ``collective_rpc`` calls by name."""

    model_runner: Any

    def lrl_ping(self) -> str:
        """The engine runs with this extension (checked before the first step); the process holds."""
        hold_process()
        return "lightning-rl"

    @torch.no_grad()
    def lrl_load_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file at ``path`` by its Hugging Face name; returns how many.

        ``reload_weights`` runs the model's ``load_weights`` (name mapping, fused projections) and re-runs
        each layer's processing (CPU kernels re-packed). On the CPU it does not re-pack a language-model
        head tied to the embeddings, which would keep sampling from the first weights: it is re-packed
        here (idempotent where nothing was stale).
        """
        from safetensors import safe_open

        hold_process()
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            self.model_runner.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names))
        repack_embedding_heads(self.model_runner.model)
        return len(names)


def repack_embedding_heads(model: torch.nn.Module) -> None:
    """Rebuild the packed CPU kernels of every embedding-shaped layer (the input embeddings and the output
    head) from its current weight; nothing happens off the CPU."""
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.platforms import current_platform
    except ImportError:
        return
    if not current_platform.is_cpu():
        return
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
