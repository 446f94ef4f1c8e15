"""What every algorithm shares: the policy, its optimiser, prompt rendering and greedy validation.

``PolicyModule`` is the base of every LightningModule here (SFT, DPO and the online RL family). The
``__init__`` signature is the config schema: LightningCLI turns its typed groups
(``lightning_rl.algorithms.options``) into YAML mappings under ``model.init_args``. Its
validation and predict steps log what an :class:`~lightning_rl.algorithms.evaluation.Evaluator` returns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_rl.algorithms.evaluation import Completions, Evaluator, predict_sampling
from lightning_rl.algorithms.input_checks import check_scoring_columns
from lightning_rl.algorithms.options import PolicyOptions, ValidationOptions
from lightning_rl.algorithms.presets import BASE_MOVED_KEYS
from lightning_rl.algorithms.trained import TrainedModule
from lightning_rl.episodes.runner import EpisodeRunner
from lightning_rl.episodes.sampler import PolicyIO, run_episodes
from lightning_rl.errors import InputError
from lightning_rl.models.adapters import (
    allow_missing_frozen,
    drop_frozen_weights,
    is_peft_model,
    parameter_counts,
    wrap_model,
)
from lightning_rl.models.generation import Generation, SamplingParams
from lightning_rl.models.loading import load_policy
from lightning_rl.models.policy import Policy
from lightning_rl.models.sharding import (
    needs_synced_generation,
    validate_fsdp_args,
)
from lightning_rl.step.collectives import Collectives
from lightning_rl.step.engine import HFEngine, RolloutEngine
from lightning_rl.step.rewards import import_reward
from lightning_rl.text.prompts import render_prompts

# a sampler thread (`model.sampling.worker: thread`) tokenises beside the learner's validation: a fast
# tokenizer's padding / truncation settings are not safe to change from two threads at once
TOKENIZER_LOCK = threading.RLock()


class PolicyModule(TrainedModule):
    """Base LightningModule: owns the ``Policy`` and evaluates it greedily on held-out prompts.

    Args:
        policy: the model, its dtype, adapters and sharding
            (:class:`~lightning_rl.algorithms.options.PolicyOptions`).
        validation: greedy validation and predict: token budget and accuracy function
            (:class:`~lightning_rl.algorithms.options.ValidationOptions`).
        engine: what samples completions (validation, predict; rollouts in RL modules): a
            ``lightning_rl.step.engine.RolloutEngine`` as ``class_path`` + ``init_args``; ``None``: the
            in-process ``HFEngine`` (``BF16Engine`` samples from a bf16 copy).
        optimizer: optimiser factory (YAML ``class_path`` + ``init_args``); AdamW by default. It gets the
            trainable parameters only (the adapters when ``policy.peft`` is set).
        lr_scheduler: optional LR scheduler factory, stepped once per optimiser step.
    """

    moved_keys: ClassVar[dict[str, str]] = BASE_MOVED_KEYS
    accuracy_name: str
    correctness_fn: Any  # what decides `val/accuracy` and predictions' `correct` (``accuracy_fn`` unless set)
    reward_pipeline: Any = None  # RL modules: their rewards (a ``RewardPipeline``); else correctness is shown

    def __init__(
        self,
        policy: PolicyOptions = PolicyOptions(),
        validation: ValidationOptions = ValidationOptions(),
        engine: RolloutEngine | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        self.policy_options = policy
        self.engine = engine if engine is not None else HFEngine()
        validate_fsdp_args(policy.fsdp_param_dtype, policy.fsdp_reduce_dtype)
        loaded = load_policy(policy.model, policy.dtype, policy.trust_remote_code)
        self.policy = self.load_with_adapters(loaded, policy.peft, policy.export_merged)
        self.export_merged = policy.export_merged
        if policy.gradient_checkpointing:
            self.policy.enable_gradient_checkpointing()
        self.chat_template = policy.chat_template
        self.max_prompt_length, self.max_new_tokens = policy.max_prompt_length, validation.max_new_tokens
        # what decides val/accuracy
        self.accuracy_name = validation.accuracy_fn or "lightning_rl.step.rewards:exact_match"
        self.accuracy_fn = import_reward(self.accuracy_name)
        self.correctness_fn = self.accuracy_fn  # RL modules: the rollouts' correctness, if set apart
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.fsdp_cpu_offload = policy.fsdp_cpu_offload
        self.fsdp_param_dtype, self.fsdp_reduce_dtype = policy.fsdp_param_dtype, policy.fsdp_reduce_dtype

    def load_with_adapters(self, policy: Policy, peft: Any, export_merged: bool) -> Policy:
        """The policy wrapped with ``peft`` adapters (before any reference is built: it is then this model
        with adapters disabled); checkpoints of a PEFT model hold the adapters only."""
        if peft is not None:
            policy = Policy(wrap_model(policy.model, peft), policy.tokenizer)
        if is_peft_model(policy.model):  # from `peft`, or a PeftModel built by the user
            self.register_state_dict_post_hook(drop_frozen_weights)
            self.register_load_state_dict_post_hook(allow_missing_frozen)
            trainable, total = parameter_counts(policy)
            rank_zero_info(f"PEFT: training {trainable:,} of {total:,} parameters ({trainable / total:.2%})")
        elif export_merged:
            rank_zero_warn("`model.policy.export_merged` has no effect without adapters "
                           "(`model.policy.peft`): "
                           "the policy folder holds the full weights anyway")
        return policy

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def on_fit_start(self) -> None:
        """Before any validation or training step: the checks that the data fits the config (prompt
        lengths, the columns scoring functions need), after ``TrainedModule``'s."""
        super().on_fit_start()
        self.check_prompt_lengths()
        check_scoring_columns(self, getattr(self.trainer, "datamodule", None))

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.sync_engine()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self.sync_engine()

    def sync_engine(self) -> None:
        """The engine samples with the trained weights as they are now (an engine with its own copy skips
        the copy when it already holds this optimiser step's weights)."""
        version = self._trainer.global_step if self._trainer is not None else None  # None: always copy
        self.attach_engine().sync_weights(self.policy, version=version)

    def teardown(self, stage: str) -> None:
        super().teardown(stage)
        self.engine.close()  # a vLLM engine or server stops with the run; it starts again on its next use

    def check_prompt_lengths(self) -> None:
        """Fail before the first step if any train / val prompt exceeds ``max_prompt_length``, naming
        the file line (or row index) of the first one."""
        from lightning_rl.data.rows import row_locator

        dm = getattr(self.trainer, "datamodule", None)
        sources = {"train": getattr(dm, "path", None), "val": getattr(dm, "val_path", None)}
        for split, source in sources.items():
            rows = getattr(dm, f"{split}_rows", None) or []
            for start in range(0, len(rows), 1024):
                chunk = [r["prompt"] for r in rows[start : start + 1024]]
                for i, n in enumerate(self.prompt_lengths(chunk)):
                    if n > self.max_prompt_length:
                        where = row_locator(source)(start + i) + (f" of {source}" if source else "")
                        raise InputError(
                            f"{split} prompt at {where} is {n} tokens, longer than "
                            f"`model.policy.max_prompt_length`={self.max_prompt_length}"
                        )

    def prompt_lengths(self, prompts: Sequence[Any]) -> list[int]:
        """Token counts of ``prompts`` exactly as ``encode_prompts`` will feed them (one batched call per
        special-token setting)."""
        texts = render_prompts(self.tokenizer, prompts, self.chat_template, tools=self.prompt_tools)
        special = self.add_special_tokens(prompts)
        lengths = [0] * len(texts)
        for flag in (True, False):
            index = [i for i, f in enumerate(special) if f == flag]
            if index:
                encoded = self.tokenizer([texts[i] for i in index], add_special_tokens=flag)["input_ids"]
                for i, ids in zip(index, encoded, strict=True):
                    lengths[i] = len(ids)
        return lengths

    # ---- validation and predict: an evaluator's results, logged --------------------------------------
    @property
    def evaluator(self) -> Evaluator:
        """Greedy validation and predict with the module's completions, correctness and rewards (as now)."""
        return Evaluator(self.complete, self.correctness_fn, self.sampling_params(do_sample=False),
                         self.reward_pipeline)

    def validation_step(self, batch: dict[str, list], batch_idx: int) -> dict[str, Any]:
        """``val/accuracy`` (and ``val/reward_mean`` with rewards) of greedy completions; returns what
        callbacks may show (``LogSamples``)."""
        means, shown = self.evaluator.validate(batch)
        for name, (value, rows) in means.items():
            self.log_val_mean(name, value.to(self.device), rows)
        return shown

    def predict_step(self, batch: dict[str, list], batch_idx: int) -> list[dict[str, Any]]:
        """Scored completions of the batch's prompts, as the ``WritePredictions`` callback asks (greedy, or
        ``num_generations`` samples each at its temperature): one row per sample of a real prompt."""
        n, sampling = predict_sampling(self.trainer.callbacks, getattr(self, "sampling", None),
                                       self.sampling_params)
        return self.evaluator.predict(batch, n, sampling)

    # ---- prompts ---------------------------------------------------------------------------------
    def add_special_tokens(self, prompts: Sequence[Any]) -> list[bool]:
        """Per prompt: chat templates already hold BOS and friends; plain prompts get the tokenizer's
        specials (decided row by row, so a row's tokens never depend on the rest of its batch)."""
        return [not self.chat_template and isinstance(p, str) for p in prompts]

    prompt_tools: list[dict] | None = None  # tool schemas rendered into prompts by the chat template
    episodes: EpisodeRunner | None = None  # multi-turn episodes (RL modules with an environment or tools)

    def encode_prompts(self, prompts: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        with TOKENIZER_LOCK:
            texts = render_prompts(self.tokenizer, prompts, self.chat_template, tools=self.prompt_tools)
            return self.policy.encode_prompts(texts, self.max_prompt_length,
                                              add_special_tokens=self.add_special_tokens(prompts))

    def decode(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
        ids = completion_ids.masked_fill(completion_mask == 0, self.policy.pad_token_id)
        with TOKENIZER_LOCK:
            return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def render_for_reward_model(self, prompts: Sequence[Any]) -> tuple[list[str], bool]:
        """Prompts as text for a reward model's own tokenizer, and whether it adds special tokens."""
        texts = render_prompts(self.tokenizer, prompts, self.chat_template)
        return texts, all(self.add_special_tokens(prompts))

    def shown_prompts(self, prompts: Sequence[Any]) -> list[str]:
        """Prompts as the model sees them, as text: rendered (chat template), cut to ``max_prompt_length``
        and decoded like a rollout's prompt ids, so train and validation sample tables show them alike."""
        return self.decode(*self.encode_prompts(prompts))

    def sampling_params(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                        do_sample: bool = True) -> SamplingParams:
        return SamplingParams(self.max_new_tokens, temperature, top_p, top_k, do_sample)

    def compact_sampling_allowed(self) -> bool:
        """Whether the engine may use the compacting sampler (``OnlineRL``: ``share_prompt_prefix``)."""
        return False

    def attach_engine(self) -> RolloutEngine:
        """Bind the engine to the policy (cheap, every time: the strategy decides ``synced``)."""
        self.engine.attach(self.policy, synced=needs_synced_generation(self._trainer, self.policy.model),
                           compact=self.compact_sampling_allowed())
        return self.engine

    def generate(self, prompts: Sequence[Any], *, num_samples: int = 1, sampling: SamplingParams,
                 seed: int | None = None) -> Generation:
        """Completions of ``prompts`` from the module's engine (attached to the policy here: sharded weights
        make every rank keep generating until all finish, whatever their lengths)."""
        ids, mask = self.encode_prompts(prompts)
        return self.generate_tokens(ids, mask, num_samples=num_samples, sampling=sampling, seed=seed)

    def generate_tokens(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, num_samples: int = 1,
                        sampling: SamplingParams, seed: int | None = None) -> Generation:
        """:meth:`generate` for prompts already encoded (left-padded ids and mask)."""
        self.attach_engine()
        return self.engine.generate(prompt_ids, prompt_mask, num_samples=num_samples, sampling=sampling,
                                    seed=seed)

    def greedy(self, prompts: Sequence[Any]) -> tuple[list[str], list[int]]:
        """Greedy completions of ``prompts`` and their lengths in tokens (EOS included)."""
        done = self.complete({"prompt": list(prompts)}, sampling=self.sampling_params(do_sample=False))
        return done.texts, done.lengths

    def policy_io(self) -> PolicyIO:
        """How samplers and episodes reach the policy: through the engine attached now."""
        engine = self.attach_engine()
        return PolicyIO(self.encode_prompts, engine.generate, self.decode, engine.synced)

    def complete(self, batch: dict[str, list], *, num_samples: int = 1, sampling: SamplingParams,
                 seed: int | None = None) -> Completions:
        """``num_samples`` completions of each prompt row of ``batch`` (validation and predict): the engine's
        texts, or whole episodes when the module has an environment or tools (``episodes``)."""
        if self.episodes is not None:
            done = run_episodes(self.episodes, batch, self.policy_io(), num_samples=num_samples,
                                sampling=sampling, seed=seed, collectives=Collectives(self._trainer))
            lengths = done.generation.lengths.tolist()
            return Completions(done.texts, lengths, done.turns, done.returns.tolist(), done.failed.tolist())
        gen = self.generate(batch["prompt"], num_samples=num_samples, sampling=sampling, seed=seed)
        return Completions(self.decode(gen.completion_ids, gen.completion_mask), gen.lengths.tolist())
