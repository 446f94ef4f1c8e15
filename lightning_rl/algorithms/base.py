"""What every algorithm shares: the policy, its optimiser, its prompt codec and completer, greedy validation.

``PolicyModule`` is the base of every LightningModule here (SFT, DPO and the online RL family). The
``__init__`` signature is the config schema: LightningCLI turns its typed groups
(``lightning_rl.algorithms.options``) into YAML mappings under ``model.init_args``. Prompts are encoded and
completions decoded by its :class:`~lightning_rl.models.prompt_codec.PromptCodec` (``codec``); the engine is
reached through a :class:`~lightning_rl.algorithms.completer.Completer` (``completer``); its validation and
predict steps log what an :class:`~lightning_rl.algorithms.evaluation.Evaluator` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_rl.algorithms.completer import Completer
from lightning_rl.algorithms.evaluation import Evaluator, predict_sampling
from lightning_rl.algorithms.input_checks import check_prompt_lengths, check_scoring_columns
from lightning_rl.algorithms.options import PolicyOptions, ValidationOptions
from lightning_rl.algorithms.presets import BASE_MOVED_KEYS
from lightning_rl.algorithms.trained import TrainedModule
from lightning_rl.episodes.runner import EpisodeRunner
from lightning_rl.models.adapters import allow_missing_frozen, drop_frozen_weights, is_peft_model
from lightning_rl.models.generation import SamplingParams
from lightning_rl.models.loading import load_policy, with_adapters
from lightning_rl.models.prompt_codec import PromptCodec
from lightning_rl.step.engine import HFEngine, RolloutEngine
from lightning_rl.step.rewards import import_reward


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
        loaded = load_policy(policy.model, policy.dtype, policy.trust_remote_code)
        self.policy = with_adapters(loaded, policy.peft, policy.export_merged)
        if is_peft_model(self.policy.model):  # checkpoints of a PEFT model hold the adapters only
            self.register_state_dict_post_hook(drop_frozen_weights)
            self.register_load_state_dict_post_hook(allow_missing_frozen)
        self.export_merged = policy.export_merged
        if policy.gradient_checkpointing:
            self.policy.enable_gradient_checkpointing()
        self.codec = PromptCodec(self.policy, policy.chat_template, policy.max_prompt_length)
        self.max_new_tokens = validation.max_new_tokens
        # what decides val/accuracy
        self.accuracy_name = validation.accuracy_fn or "lightning_rl.step.rewards:exact_match"
        self.accuracy_fn = import_reward(self.accuracy_name)
        self.correctness_fn = self.accuracy_fn  # RL modules: the rollouts' correctness, if set apart
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.fsdp = policy.fsdp

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def encode_prompts(self, prompts: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec.encode(prompts)

    def decode(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
        return self.codec.decode(completion_ids, completion_mask)

    episodes: EpisodeRunner | None = None  # multi-turn episodes (RL modules with an environment or tools)
    refuses_long_prompts = True  # a prompt over `max_prompt_length` fails `fit` before its first step
    compact_sampling = False  # the engine may use the compacting sampler (`OnlineRL`: share_prompt_prefix)

    @property
    def completer(self) -> Completer:
        """How the engine is reached now: attached to the policy, synced as the running strategy needs."""
        return Completer(self.engine, self.policy, self.codec, self._trainer, self.max_new_tokens,
                         self.episodes, self.compact_sampling)

    def on_fit_start(self) -> None:
        """Before any validation or training step: the checks that the data fits the config (prompt
        lengths, the columns scoring functions need), after ``TrainedModule``'s."""
        super().on_fit_start()
        datamodule = getattr(self.trainer, "datamodule", None)
        if self.refuses_long_prompts:
            check_prompt_lengths(self.codec, datamodule)
        check_scoring_columns(self, datamodule)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.completer.sync()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self.completer.sync()

    def teardown(self, stage: str) -> None:
        super().teardown(stage)
        self.engine.close()  # a vLLM engine or server stops with the run; it starts again on its next use

    # ---- validation and predict: an evaluator's results, logged --------------------------------------
    @property
    def evaluator(self) -> Evaluator:
        """Greedy validation and predict with the module's completions, correctness and rewards (as now)."""
        return Evaluator(self.completer.complete, self.correctness_fn, self.sampling_params(do_sample=False),
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

    def sampling_params(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                        do_sample: bool = True) -> SamplingParams:
        return SamplingParams(self.max_new_tokens, temperature, top_p, top_k, do_sample)
