"""Rollout engines: what samples completions for the RL step, validation and predict.

An engine takes left-padded prompts and returns a :class:`Generation`. The module attaches it to the
policy once (``attach``), asks it to sample (``generate``) and tells it after every optimiser step that
precedes a rollout (``sync_weights``; a no-op for an engine that samples with the trained module itself).
An engine that keeps its own weights (a lower-precision copy, a server) sets ``returns_logprobs`` when
its generations carry the sampled tokens' log-probs (``rollout_logp``) and ``is_trained_module = False``,
so the step recomputes or corrects behaviour log-probs instead of assuming the sampler is the trainer.

:class:`HFEngine` is the in-process engine: transformers' ``generate`` (with each prompt prefilled once
for its group's samples), or :func:`lightning_rl.models.sampling.sample_compacting` (finished rows leave the
batch) where forwards are not collectives. It owns ``synced_gpus``: sharded weights keep every rank
stepping until all ranks finish.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_rl.models.generation import Generation, SamplingParams, hf_generate
from lightning_rl.models.model_utils import DTYPES, base_model
from lightning_rl.models.sampling import drawing_from

if TYPE_CHECKING:
    from lightning_rl.models.policy import Policy


class RolloutEngine:
    """The rollout-engine seam. Subclass and name it in YAML: ``model.init_args.engine.class_path``.

    Every capability the step, the asynchronous worker and distillation use is declared here with its
    default; an engine that has one overrides it, and nothing probes an engine with ``hasattr``.

    Attributes:
        returns_logprobs: generations carry ``rollout_logp``, the sampled tokens' log-probs under the
            distribution they were drawn from (behaviour log-probs ``from_engine``, the correction's input).
        is_trained_module: the engine samples with the very module being trained (the ratio of a single
            update per rollout is then exactly 1 and behaviour log-probs may be skipped).
        samples_ahead: sampling runs ahead of the learner (``model.sampling.max_staleness``, after
            :meth:`sample_ahead`): the weights that sample are a published version, not the trained ones.
        synced: generation is a collective over ranks (sharded weights): every rank keeps generating until
            all finish (set by :meth:`attach`).
        corrects_in_loss: its log-probs are the trained weights' up to numerics (another implementation of
            the same model), so with one update per rollout ``logprobs.behaviour: auto`` takes the trainer's
            own log-probs at the update as the behaviour's (no separate pass) and the correction weighs the
            gap in the loss.
        version: the weight version the engine samples with (the trainer's optimiser step of its last
            :meth:`sync_weights`, or the version :meth:`set_weights` received); ``None`` before any.
    """

    returns_logprobs: bool = False
    is_trained_module: bool = True
    samples_ahead: bool = False
    synced: bool = False
    corrects_in_loss: bool = False
    version: int | None = None

    def attach(self, policy: Policy, *, synced: bool = False, compact: bool = False) -> None:
        """Bind to the trained policy. ``synced``: forwards are collectives (sharded weights), so every
        rank must keep generating until all finish; ``compact``: the compacting sampler is allowed. Called
        before every use, so it must be cheap; it must not start anything that a fork would not survive."""
        raise NotImplementedError

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, *, num_samples: int = 1,
                 sampling: SamplingParams, seed: int | None = None) -> Generation:
        """``num_samples`` completions per prompt; ``seed`` makes the draw reproducible (resume)."""
        raise NotImplementedError

    def sync_weights(self, policy: Policy, version: int | None = None) -> None:
        """Sample with the trained policy's current weights from now on (after an optimiser step, before a
        rollout, validation or predictions). ``version``: the trainer's optimiser step; an engine already
        holding that version may skip the copy. A no-op for an engine that samples with the module itself.
        Under sharded weights every rank calls it (it may gather)."""

    def keep_logprobs(self) -> bool:
        """Ask for ``rollout_logp`` on every sampled generation (distillation's student log-probs). Returns
        whether the engine gives them (``False``: the step scores the rollout itself)."""
        return self.returns_logprobs

    def sample_ahead(self) -> None:
        """Prepare to sample ahead of the learner (``model.sampling.max_staleness`` >= 1) through the worker
        protocol (:meth:`weights`, :meth:`set_weights`, :meth:`close`)."""
        raise ValueError(f"`model.sampling.max_staleness` >= 1 samples with an older copy of the weights: "
                         f"{type(self).__name__} cannot (it does not implement the worker protocol of "
                         "lightning_rl.step.engine.RolloutEngine: sample_ahead, weights, set_weights)")

    def sampling_model(self) -> nn.Module | None:
        """The transformers model that samples in this process (``None``: the weights live elsewhere, e.g.
        in a vLLM engine)."""
        return None

    def worker_copy(self) -> RolloutEngine:
        """This engine for a sampler *thread* beside the learner (``model.sampling.worker: thread``): it
        samples with the versions it receives while this one keeps serving validation."""
        raise ValueError(f"`model.sampling.worker: thread` needs an engine with its own copy of the weights: "
                         f"{type(self).__name__} has no worker_copy (use `worker: process`)")

    # ---- the worker protocol: an engine that samples ahead of the learner (`model.sampling.max_staleness`)
    def weights(self, names: list[str]) -> dict[str, Tensor]:
        """Tensors shaped like the trained parameters ``names`` (full shapes, the dtype the engine wants
        them in): the weight slots a worker receives versions in are allocated like them."""
        raise NotImplementedError(f"{type(self).__name__} cannot sample ahead of the learner")

    def set_weights(self, version: int, weights: dict[str, Tensor]) -> None:
        """Sample with ``weights`` (by parameter name: the trained ones, all or the adapters) from now on;
        they are weight version ``version`` (the trainer step that published them). An in-process engine
        points its parameters at these tensors (no copy); vLLM loads them."""
        raise NotImplementedError(f"{type(self).__name__} cannot sample ahead of the learner")

    def close(self) -> None:
        """Release what the engine holds (a vLLM engine, a server) when the run or the worker stops; the
        engine starts again on its next use."""


class HFEngine(RolloutEngine):
    """In-process sampling with the trained module itself (see the module docstring).

    Args:
        compact: use the compacting sampler when forwards are not collectives: ``None`` follows the
            module's ``share_prompt_prefix``; ``False`` always uses transformers' ``generate``.
    """

    def __init__(self, compact: bool | None = None) -> None:
        self.compact_option = compact
        self.policy: Any = None
        self.synced, self.compact = False, False

    def attach(self, policy: Policy, *, synced: bool = False, compact: bool = False) -> None:
        self.policy, self.synced = policy, synced
        self.compact = (compact if self.compact_option is None else self.compact_option) and not synced

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, *, num_samples: int = 1,
                 sampling: SamplingParams, seed: int | None = None) -> Generation:
        if self.policy is None:
            raise RuntimeError("the engine is not attached to a policy: call `attach(policy)` first")
        with seeded(seed, prompt_ids.device, global_rng=not self.compact):
            return hf_generate(self.policy, prompt_ids, prompt_mask, num_samples=num_samples,
                               sampling=sampling, compact=self.compact, synced_gpus=self.synced,
                               return_logprobs=self.returns_logprobs and not sampling.greedy)

    def sampling_model(self) -> nn.Module:
        """The transformers model that samples: the attached policy's."""
        return self.policy.model

    def weights(self, names: list[str]) -> dict[str, Tensor]:
        mine = dict(self.sampling_model().named_parameters())
        return {name: mine[name] for name in names}

    def set_weights(self, version: int, weights: dict[str, Tensor]) -> None:
        mine = dict(self.sampling_model().named_parameters())
        for name, tensor in weights.items():
            mine[name].data = tensor
        self.version = version

    def worker_copy(self) -> HFEngine:
        """This engine with its own frozen copy of the sampling weights, for a sampler thread beside the
        learner (``model.sampling.worker: thread``): it samples with the versions it receives
        (``set_weights``) while the module's engine keeps the trained weights for validation."""
        from lightning_rl.models.policy import Policy

        twin = copy.copy(self)
        model = copy.deepcopy(self.sampling_model()).requires_grad_(False).eval()
        twin.policy = Policy(model, self.policy.tokenizer)
        twin.policy.share_prompts = self.policy.share_prompts
        twin.synced = False
        return twin

    def keep_logprobs(self) -> bool:
        """Generations carry the sampled tokens' log-probs (``rollout_logp``) for a stage that reads them
        (distillation's advantages): free from the compacting sampler's own logits, one scoring pass after
        transformers' ``generate``. The engine still samples with the trained module."""
        self.returns_logprobs = True
        return True

    def sample_ahead(self) -> None:
        """Sampling runs ahead of the learner (``model.sampling.max_staleness``): the weights that sample
        are not the trained module's, so generations carry their log-probs (the behaviour policy's) and
        the step recomputes its own and corrects the gap."""
        self.returns_logprobs, self.is_trained_module, self.samples_ahead = True, False, True


@contextmanager
def seeded(seed: int | None, device: torch.device, *, global_rng: bool = True) -> Iterator[None]:
    """Draw from ``seed`` without disturbing the global RNG streams (nothing happens for ``None``): the
    compacting sampler draws from its own generator; ``global_rng`` also seeds the global streams for the
    length of the block (transformers' ``generate`` draws from them), then restores them. Both give the
    same draws for the same seed. ``global_rng`` is refused off the main thread (a sampler thread beside the
    learner, ``model.sampling.worker: thread``): the streams are the process's, the learner's too."""
    if seed is None:
        yield
        return
    if global_rng and threading.current_thread() is not threading.main_thread():
        raise RuntimeError("`model.sampling.worker: thread` samples beside the learner, but transformers' "
                           "`generate` (used when `model.sampling.share_prompt_prefix` or "
                           "`model.engine.init_args.compact` is off) draws from the process-global RNG, "
                           "which a thread would reseed under the learner: keep `share_prompt_prefix: true` "
                           "(the compacting sampler draws from its own generator) or use "
                           "`model.sampling.worker: process`")
    with drawing_from(torch.Generator(device).manual_seed(seed)):
        if not global_rng:
            yield
            return
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            yield


class CopyEngine(HFEngine):
    """Samples with its own copy of the policy's weights in ``dtype`` (bf16 by default): AMX / tensor-core
    arithmetic for rollouts while training keeps fp32 master weights. Its log-probs (``rollout_logp``)
    differ from the trainer's, so the step recomputes behaviour log-probs and corrects the gap
    (``model.logprobs.correction``) and logs it (``rollout/mismatch_*``).

    ``sync_weights`` copies the trained weights into the copy in place (cast), once per step before
    sampling: one parameter at a time, so under FSDP2 each is gathered alone (every rank joins each gather,
    in the same order) and never the whole model at once; under LoRA only the trained (adapter) weights are
    copied. The copy is a plain attribute: out of checkpoints, optimisers and the module tree.

    Args:
        dtype: ``bfloat16``, ``float16`` or ``float32`` (``float32``: an exact copy, for checks).
        compact: as :class:`HFEngine`.
    """

    returns_logprobs = True
    is_trained_module = False

    def __init__(self, dtype: str = "bfloat16", compact: bool | None = None) -> None:
        super().__init__(compact)
        if dtype not in DTYPES:
            raise ValueError(f"`model.engine.init_args.dtype` must be one of {sorted(DTYPES)}, "
                             f"got {dtype!r}")
        self.dtype = DTYPES[dtype]
        self.copy: Any = None  # a Policy around the engine's own model
        self.source: Any = None  # the trained Policy it copies

    def attach(self, policy: Policy, *, synced: bool = False, compact: bool = False) -> None:
        if self.source is not policy:
            self.source, self.copy, self.version = policy, self.build(policy), None
            self.sync_weights(policy)
        # the copy is whole on every rank: its forwards are local, never collectives
        super().attach(self.copy, synced=False, compact=compact)

    def build(self, policy: Policy) -> Policy:
        """A frozen copy of the policy's model in ``dtype`` on its device (weights: ``sync_weights``)."""
        from lightning_rl.models.policy import Policy
        from lightning_rl.models.sharding import is_sharded

        model = policy.model
        if is_sharded(model):  # FSDP2: the same architecture, built whole; weights arrive layer by layer
            if hasattr(model, "peft_config"):
                raise ValueError("`model.engine: CopyEngine` under FSDP2 needs a model without "
                                 "adapters "
                                 "(`model.policy.peft`); use the default engine with LoRA under FSDP2")
            from transformers import AutoModelForCausalLM

            device = policy.device if policy.device.type != "meta" else torch.device("cpu")
            engine_model = AutoModelForCausalLM.from_config(base_model(model).config, dtype=self.dtype)
            engine_model.to(device)
        else:
            engine_model = copy.deepcopy(model).to(self.dtype)
        engine_model.requires_grad_(False).eval()
        engine = Policy(engine_model, policy.tokenizer)
        engine.share_prompts = policy.share_prompts
        return engine

    def sampling_model(self) -> nn.Module:
        return self.copy.model

    def worker_copy(self) -> CopyEngine:
        twin = super().worker_copy()
        assert isinstance(twin, CopyEngine)
        twin.copy = twin.policy
        return twin

    @torch.no_grad()
    def sync_weights(self, policy: Policy, version: int | None = None) -> None:
        """Copy (and cast) the trained weights into the engine's; only trainable ones under LoRA."""
        if self.copy is None or (version is not None and version == self.version):
            return
        self.version = version
        from lightning_rl.models.sharding import full_value

        mine = dict(self.copy.model.named_parameters())
        peft = hasattr(policy.model, "peft_config")
        for name, param in policy.model.named_parameters():
            if peft and not param.requires_grad:
                continue
            target = mine[name]
            target.copy_(full_value(param.detach()).to(device=target.device, dtype=target.dtype))

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, *, num_samples: int = 1,
                 sampling: SamplingParams, seed: int | None = None) -> Generation:
        if self.copy is None:
            raise RuntimeError("the engine is not attached to a policy: call `attach(policy)` first")
        device_type = prompt_ids.device.type
        # its weights are already in their dtype: an enclosing autocast (bf16-mixed) would only re-cast
        with seeded(seed, prompt_ids.device, global_rng=not self.compact), \
                torch.autocast(device_type, enabled=False):
            return hf_generate(self.copy, prompt_ids, prompt_mask, num_samples=num_samples, sampling=sampling,
                               compact=self.compact, return_logprobs=not sampling.greedy)
