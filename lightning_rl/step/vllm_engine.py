"""vLLM as the rollout engine: :class:`VLLMEngine` (``model.engine.class_path:
lightning_rl.step.vllm_engine.VLLMEngine``), in-process (``mode: colocate``) or as a server (``mode:
server``), for training rollouts, episodes, validation and ``predict``, synchronous or sampling ahead.

Token in, token out: each prompt row goes to vLLM as its token ids (padding stripped, never re-tokenised)
with its own seed, and the sampled ids come back with the log-probs of the distribution they were drawn
from (vLLM's ``processed_logprobs``: temperature, top-k and top-p applied): ``rollout_logp``. vLLM is
another implementation of the same model, so those differ from the trainer's by rounding: the rollout
correction weighs the gap and logs it (``rollout/mismatch_*``); with one update per rollout the trainer's
own log-probs at the update are the behaviour's (no separate pass), with several the step recomputes them.
Sampling stops at the policy's EOS token only (``generation_config: vllm``: a checkpoint's
``generation_config.json`` changes nothing), after at most ``max_new_tokens``; greedy is temperature 0, as
for :class:`~lightning_rl.step.engine.HFEngine`.

vLLM starts with the model's config and no weights (``load_format: dummy``, no tokenizer): the weights come
from the trained module (a hub model, a folder, a resumed checkpoint, LoRA merged, FSDP2 shards gathered one
at a time) through :mod:`lightning_rl.step.vllm_weights`, after every optimiser step that precedes a rollout
or a validation (synchronous), or once per published version (sampling ahead); the prefix cache is reset
with every new version. Each rank has its own engine (or shares a server given by URL). The engine starts
on first use, in the process that samples, and stops with the run (:meth:`close`).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from lightning_rl.models.adapters import is_peft_model
from lightning_rl.models.generation import Generation, SamplingParams, make_generation
from lightning_rl.models.model_utils import DTYPES, base_model
from lightning_rl.models.sharding import is_sharded
from lightning_rl.step.engine import RolloutEngine
from lightning_rl.step.vllm_colocated import EXTENSION, KEY, ColocatedLLM
from lightning_rl.step.vllm_server import VLLMServer, VLLMServerOptions
from lightning_rl.step.vllm_weights import (
    Weight,
    model_weights,
    tensor_weights,
    transfer_folder,
    write_safetensors,
)

if TYPE_CHECKING:
    from lightning_rl.models.policy import Policy

INHERITED: list[Any] = []  # engines a forked process inherited from its parent: kept, never used


class VLLMEngine(RolloutEngine):
    """Rollouts, validation and predictions sampled by vLLM (see the module docstring).

    Args:
        mode: ``colocate`` (a ``vllm.LLM`` in the process that samples) or ``server`` (``server``).
        dtype: the engine's weights: ``auto`` (the trained weights' dtype), ``float32``, ``bfloat16`` or
            ``float16``; training keeps its own.
        max_model_len: prompt plus completion tokens per sequence; ``None``: the model's context.
        kv_cache_gib: the KV cache in GiB; ``None``: 1 GiB on a CPU, ``gpu_memory_utilization`` on a GPU.
        gpu_memory_utilization: the fraction of GPU memory vLLM takes (weights and KV cache) on a GPU.
        enforce_eager: no CUDA graphs or compilation (faster start; always so on a CPU).
        prefix_caching: reuse the KV of shared prefixes (a group's prompt, an episode's earlier turns)
            within a weight version.
        seed: the engine's own seed (requests carry the step's seeds; this one serves unseeded calls).
        weight_timeout: seconds one weight push may take.
        engine_args: more ``vllm.LLM`` / ``vllm serve`` arguments by their Python names
            (``{max_num_seqs: 256}``).
        server: the server of ``mode: server`` (:class:`~lightning_rl.step.vllm_server.VLLMServerOptions`).
    """

    returns_logprobs = True
    is_trained_module = False
    corrects_in_loss = True  # one update per rollout: no separate behaviour pass, the gap weighed in the loss

    def __init__(self, mode: Literal["colocate", "server"] = "colocate", dtype: str = "auto",
                 max_model_len: int | None = None, kv_cache_gib: float | None = None,
                 gpu_memory_utilization: float = 0.3, enforce_eager: bool = True, prefix_caching: bool = True,
                 seed: int = 0, weight_timeout: float = 300.0, engine_args: dict[str, Any] | None = None,
                 server: VLLMServerOptions = VLLMServerOptions()) -> None:
        checks = {"mode": (mode in ("colocate", "server"), mode, "colocate or server"),
                  "dtype": (dtype == "auto" or dtype in DTYPES, dtype, f"auto or one of {sorted(DTYPES)}"),
                  "max_model_len": (max_model_len is None or max_model_len > 1, max_model_len, "> 1"),
                  "kv_cache_gib": (kv_cache_gib is None or kv_cache_gib > 0, kv_cache_gib, "> 0"),
                  "gpu_memory_utilization": (0 < gpu_memory_utilization <= 1, gpu_memory_utilization,
                                             "in (0, 1]"),
                  "weight_timeout": (weight_timeout > 0, weight_timeout, "> 0 seconds")}
        for name, (ok, value, expected) in checks.items():
            if not ok:
                raise ValueError(f"`{KEY}.{name}` must be {expected}, got {value!r}")
        if mode == "colocate" and server != VLLMServerOptions():
            raise ValueError(f"`{KEY}.server` configures `mode: server`; this engine is `mode: colocate`")
        self.mode, self.dtype, self.max_model_len = mode, dtype, max_model_len
        self.kv_cache_gib, self.gpu_memory_utilization = kv_cache_gib, gpu_memory_utilization
        self.enforce_eager, self.prefix_caching, self.seed = enforce_eager, prefix_caching, seed
        self.weight_timeout, self.engine_args, self.server = weight_timeout, dict(engine_args or {}), server
        self.policy: Any = None
        self.backend: Any = None
        self.folder: str | None = None
        self.pid = os.getpid()  # the process its backend belongs to (a forked worker starts its own)
        self.sync_time = 0.0  # seconds of the last weight push (``perf/weight_sync_time``)
        self.loads = 0  # weight versions this process had vLLM load (rank 0 alone for a shared server)

    # ---- the protocol ----------------------------------------------------------------------------
    def attach(self, policy: Policy, *, synced: bool = False, compact: bool = False) -> None:
        """Bind to ``policy``; nothing starts here (a worker forked after this starts its own engine). vLLM's
        generation is never a collective: every rank samples from its own engine."""
        if os.getpid() != self.pid:  # forked (a worker sampling ahead): the parent's engine is not ours,
            INHERITED.append(self.backend)  # and never collected here (its finalizer would stop it)
            self.backend, self.folder, self.version, self.pid = None, None, None, os.getpid()
        if policy is not self.policy:
            self.policy, self.version = policy, None

    def sampling_model(self) -> None:
        return None  # the weights that sample live in vLLM

    def sample_ahead(self) -> None:
        if self.server.url is not None:
            raise ValueError(f"`model.sampling.max_staleness` >= 1 with `{KEY}.server.url`: the worker "
                             "sampling ahead and the learner's validation would push different weights to "
                             "one server; leave `server.url` unset so that each starts its own")
        self.samples_ahead = True

    def worker_copy(self) -> VLLMEngine:
        """An engine of its own for a sampler thread, started here (vLLM's client is then created by the
        thread that also stops it); the frozen base of a LoRA policy is read from a copy of the model the
        thread alone holds."""
        import copy

        twin = copy.copy(self)
        twin.backend, twin.folder, twin.version = None, None, None
        if is_peft_model(self.policy.model):
            from lightning_rl.models.policy import Policy

            model = copy.deepcopy(self.policy.model).requires_grad_(False).eval()
            twin.policy = Policy(model, self.policy.tokenizer)
        twin.start()
        return twin

    def weights(self, names: list[str]) -> dict[str, Tensor]:
        """Empty tensors of the trained parameters' full shapes (the worker's weight slots)."""
        mine = dict(self.policy.model.named_parameters())
        return {name: torch.empty(mine[name].shape, dtype=mine[name].dtype) for name in names}

    def set_weights(self, version: int, weights: dict[str, Tensor]) -> None:
        """Push published version ``version``: the trained parameters by name (LoRA's adapters merged into
        the worker's frozen base)."""
        self.attach(self.policy)
        if version == self.version:
            return
        if is_peft_model(self.policy.model):
            mine = dict(self.policy.model.named_parameters())
            for name, tensor in weights.items():
                mine[name].data = tensor
            self.push(model_weights(self.policy.model, adapters_only=self.version is not None))
        else:
            sent = tensor_weights(weights)
            if self.version is None:  # vLLM holds no weights yet: the untrained ones too
                sent += [w for w in model_weights(self.policy.model) if w.name not in weights]
            self.push(sent)
        self.version = version

    def sync_weights(self, policy: Policy, version: int | None = None) -> None:
        """Push the trained weights (every rank calls it: under FSDP2 each parameter is gathered alone)."""
        self.attach(policy)
        if version is not None and version == self.version:
            return
        if is_peft_model(policy.model) and is_sharded(policy.model):
            raise ValueError("`model.engine: VLLMEngine` merges LoRA adapters into whole base layers, which "
                             "FSDP2 shards: use LoRA without FSDP2, or full weights under FSDP2")
        lora_again = self.version is not None and is_peft_model(policy.model)
        self.push(model_weights(policy.model, adapters_only=lora_again))
        self.version = version if version is not None else (self.version or 0) + 1

    def close(self) -> None:
        self.attach(self.policy)  # in a forked worker: the parent's engine is left to the parent
        backend, self.backend, self.version = self.backend, None, None
        if backend is not None:
            backend.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    # ---- sampling --------------------------------------------------------------------------------
    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, *, num_samples: int = 1,
                 sampling: SamplingParams, seed: int | None = None) -> Generation:
        if self.policy is None:
            raise RuntimeError("the engine is not attached to a policy: call `attach(policy)` first")
        self.attach(self.policy)
        if self.version is None:
            self.sync_weights(self.policy)
        prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids.cpu(), prompt_mask.cpu(),
                                                                   strict=True)]
        self.check_lengths(prompts, sampling.max_new_tokens)
        params = {"max_tokens": sampling.max_new_tokens, "stop_token_ids": [self.policy.eos_token_id],
                  "temperature": 0.0 if sampling.greedy else sampling.temperature,
                  "top_p": 1.0 if sampling.greedy else sampling.top_p,
                  "top_k": 0 if sampling.greedy else sampling.top_k,
                  "logprobs": None if sampling.greedy else 0}
        seeds = None if seed is None else [(seed + i * num_samples) % 2**31 for i in range(len(prompts))]
        samples = [s for per_prompt in self.backend.generate(prompts, params, num_samples, seeds)
                   for s in per_prompt]
        return self.as_generation(prompt_ids, prompt_mask, num_samples, samples,
                                  with_logprobs=not sampling.greedy)

    def as_generation(self, prompt_ids: Tensor, prompt_mask: Tensor, num_samples: int,
                      samples: list[tuple[list[int], list[float] | None]], with_logprobs: bool) -> Generation:
        """vLLM's samples (``num_samples`` per prompt, in order) as a :class:`Generation` on the prompts'
        device: right-padded ids, masks up to the first EOS, ``rollout_logp`` 0 on padding."""
        width = max((len(ids) for ids, _ in samples), default=1) or 1
        pad, device = self.policy.pad_token_id, prompt_ids.device
        ids = torch.full((len(samples), width), pad, dtype=torch.long)
        logp = torch.zeros(len(samples), width)
        for row, (tokens, values) in enumerate(samples):
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            if values is not None:
                logp[row, :len(values)] = torch.tensor(values, dtype=torch.float32)
        gen = make_generation(prompt_ids.repeat_interleave(num_samples, 0),
                              prompt_mask.repeat_interleave(num_samples, 0), ids.to(device),
                              self.policy.eos_token_id, pad)
        if with_logprobs:
            gen.rollout_logp = logp.to(device) * gen.completion_mask
        return gen

    def check_lengths(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        limit = self.max_model_len or self.policy.context_length
        longest = max((len(p) for p in prompts), default=0)
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(f"a prompt of {longest} tokens plus {max_new_tokens} new tokens exceeds the "
                             f"vLLM engine's {limit} (`{KEY}.max_model_len`, or the model's context)")

    # ---- the engine itself -----------------------------------------------------------------------
    def push(self, weights: list[Weight]) -> None:
        """Write ``weights`` to the transfer file and have vLLM load them; the prefix cache is reset. A
        server shared by URL is written by rank 0 alone, every rank waits for it (a barrier)."""
        start = time.perf_counter()
        shared = self.server.url is not None and torch.distributed.is_available() \
            and torch.distributed.is_initialized()
        writer = not shared or torch.distributed.get_rank() == 0
        if writer:
            self.start()
        path = os.path.join(self.folder, "weights.safetensors") if writer else ""
        write_safetensors(path, weights, self.engine_dtype(), write=writer)  # every rank joins the gathers
        if writer:
            self.loads += 1
            try:
                self.backend.load_weights(path, self.weight_timeout)
            except TimeoutError as err:
                raise TimeoutError(f"a weight push to vLLM took over {self.weight_timeout:g} s "
                                   f"(`{KEY}.weight_timeout`)") from err
            self.backend.reset_prefix_cache()
        if shared:
            torch.distributed.barrier()
            if not writer:
                self.start()
        self.sync_time = time.perf_counter() - start

    def engine_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        return next(self.policy.model.parameters()).dtype

    def start(self) -> None:
        """Start vLLM for the attached policy (once): its config in a private folder, no weights."""
        if self.backend is not None:
            return
        model = base_model(self.policy.model)
        size = sum(p.numel() for p in model.parameters()) * self.engine_dtype().itemsize
        self.folder = transfer_folder(size)
        model.config.save_pretrained(self.folder)
        args = self.engine_arguments(self.folder)
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        stop = os.path.join(self.folder, "stop")
        if self.mode == "colocate":
            self.backend = ColocatedLLM(args, model_key=f"model.policy.model ({name})", stop=stop)
        else:
            self.backend = VLLMServer(self.server, args, os.path.join(self.folder, "server.log"), stop=stop)

    def engine_arguments(self, folder: str) -> dict[str, Any]:
        """``vllm.LLM``'s arguments (a server gets them as flags)."""
        on_gpu = torch.cuda.is_available() and self.policy.device.type == "cuda"
        kv = self.kv_cache_gib if self.kv_cache_gib is not None else (None if on_gpu else 1.0)
        dtype = str(self.engine_dtype()).removeprefix("torch.")
        args = {"model": folder, "dtype": dtype, "load_format": "dummy", "skip_tokenizer_init": True,
                "worker_extension_cls": EXTENSION, "logprobs_mode": "processed_logprobs",
                "generation_config": "vllm", "seed": self.seed, "enforce_eager": self.enforce_eager,
                "enable_prefix_caching": self.prefix_caching, "max_model_len": self.max_model_len,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "kv_cache_memory_bytes": None if kv is None else int(kv * 2**30)}
        if self.mode == "colocate":
            args["disable_log_stats"] = True
        return {**args, **self.engine_args}

