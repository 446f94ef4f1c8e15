"""What every algorithm shares: the policy, its optimiser, prompt rendering and greedy validation.

``PolicyModule`` is the base of every LightningModule here (SFT, DPO and the online RL family). The
``__init__`` signature is the config schema: LightningCLI turns it into YAML keys under ``model:``. Its
validation and predict steps are the mixin :class:`~lightning_rl.algorithms.evaluation.EvaluationSteps`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_rl.algorithms.evaluation import Completions, EvaluationSteps
from lightning_rl.algorithms.input_checks import InputError, check_scoring_columns, warn_if_lr_is_zero
from lightning_rl.models.adapters import (
    allow_missing_frozen,
    drop_frozen_weights,
    is_peft_model,
    parameter_counts,
    trainable_parameters,
    wrap_model,
)
from lightning_rl.models.generation import Generation, SamplingParams
from lightning_rl.models.loading import load_policy
from lightning_rl.models.policy import Policy
from lightning_rl.models.sharding import (
    needs_synced_generation,
    refuse_fsdp1,
    shard_policy_model,
    strategy_is,
    validate_fsdp_args,
)
from lightning_rl.step.engine import HFEngine, RolloutEngine
from lightning_rl.step.rewards import import_reward
from lightning_rl.step.rng import collect_rng_states, restore_rng_states
from lightning_rl.text.prompts import render_prompts


class PolicyModule(EvaluationSteps, L.LightningModule):
    """Base LightningModule: owns the ``Policy`` and evaluates it greedily on held-out prompts.

    Args:
        model: hub id, local ``save_pretrained`` folder, or ``builtin:tiny-sort`` / ``builtin:tiny-scratch``.
        dtype: weights dtype (``float32``, ``bfloat16``, ``float16``, ``auto``); ``None`` loads float32
            whatever the checkpoint holds, ``auto`` keeps the checkpoint's.
        trust_remote_code: allow model code from the hub (off by default).
        gradient_checkpointing: trade compute for memory in the policy's forward pass.
        chat_template: render plain-string prompts with the tokenizer's chat template.
        max_prompt_length: longest prompt in tokens; longer ones fail before training, naming the row.
        max_new_tokens: completion budget for generation (validation here; rollouts in RL modules).
        accuracy_fn: ``module:function`` scoring greedy validation completions; ``val/accuracy`` is its mean.
            ``None``: ``exact_match``, except in online RL modules, where it follows the main reward function
            (correct at its full score); the first validation line says which function decides.
        optimizer: optimiser factory (YAML ``class_path`` + ``init_args``); AdamW by default. It gets the
            trainable parameters only (the adapters when ``peft`` is set).
        lr_scheduler: optional LR scheduler factory, stepped once per optimiser step.
        fsdp_cpu_offload: under FSDP2 (``ModelParallelStrategy``), keep the sharded parameters, gradients
            and optimiser state in CPU memory.
        fsdp_param_dtype: under FSDP2, the compute dtype of gathered parameters (``MixedPrecisionPolicy``);
            ``None`` keeps the weights' dtype.
        fsdp_reduce_dtype: under FSDP2, the dtype of the gradient reduce-scatter; ``None``: the param dtype.
        peft: train adapters only: a ``peft.PeftConfig`` subclass as ``class_path`` + ``init_args``
            (e.g. ``peft.LoraConfig`` with ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``),
            applied with ``peft.get_peft_model`` right after loading ``model``. The KL / DPO reference is
            then the same weights with the adapters disabled, and checkpoints hold the adapters and
            optimiser state only (see ``lightning_rl.models.adapters``). From Python, a ``peft.PeftConfig``
            instance works too. Needs ``pip install 'lightning-rl[peft]'``.
        export_merged: with adapters, the exported policy folder holds the merged weights (a plain causal LM
            for ``AutoModelForCausalLM``) instead of the adapter folder (``adapter_config.json`` +
            ``adapter_model.safetensors``, loaded with ``peft`` on top of the base model).
        engine: what samples completions (rollouts, validation, predict): a ``lightning_rl.step.engine``
            ``RolloutEngine`` as ``class_path`` + ``init_args``; default the in-process ``HFEngine``.
    """

    def __init__(
        self,
        model: str = "builtin:tiny-sort",
        dtype: str | None = None,
        trust_remote_code: bool = False,
        gradient_checkpointing: bool = False,
        chat_template: bool = False,
        max_prompt_length: int = 512,
        max_new_tokens: int = 64,
        accuracy_fn: str | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        lr_scheduler: LRSchedulerCallable | None = None,
        fsdp_cpu_offload: bool = False,
        fsdp_param_dtype: str | None = None,
        fsdp_reduce_dtype: str | None = None,
        peft: dict[str, Any] | None = None,
        export_merged: bool = False,
        engine: RolloutEngine | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine if engine is not None else HFEngine()
        validate_fsdp_args(fsdp_param_dtype, fsdp_reduce_dtype)
        if max_prompt_length < 1 or max_new_tokens < 1:
            raise ValueError("`model.max_prompt_length` and `model.max_new_tokens` must be >= 1")
        policy = load_policy(model, dtype, trust_remote_code)
        self.policy = self.load_with_adapters(policy, peft, export_merged)
        self.export_merged = export_merged
        if gradient_checkpointing:
            self.policy.enable_gradient_checkpointing()
        self.chat_template = chat_template
        self.max_prompt_length, self.max_new_tokens = max_prompt_length, max_new_tokens
        # what decides val/accuracy
        self.accuracy_name = accuracy_fn or "lightning_rl.step.rewards:exact_match"
        self.accuracy_fn = import_reward(self.accuracy_name)
        self.optimizer_factory, self.scheduler_factory = optimizer, lr_scheduler
        self.fsdp_cpu_offload = fsdp_cpu_offload
        self.fsdp_param_dtype, self.fsdp_reduce_dtype = fsdp_param_dtype, fsdp_reduce_dtype

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
            rank_zero_warn("`model.export_merged` has no effect without adapters (`model.peft`): the policy "
                           "folder holds the full weights anyway")
        return policy

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    # ---- setup -------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """FSDP2: ``fully_shard`` each decoder layer, then the policy's model, on the data-parallel mesh.

        Only under ``ModelParallelStrategy`` (which sets ``device_mesh``); idempotent. The frozen reference
        stays whole on each rank (see ``lightning_rl.models.sharding``). Lightning's FSDP1 strategy is
        refused.
        """
        refuse_fsdp1(self.trainer.strategy)
        mesh = self.device_mesh
        if mesh is None:
            return
        shard_policy_model(self.policy.model, mesh, cpu_offload=self.fsdp_cpu_offload,
                           param_dtype=self.fsdp_param_dtype, reduce_dtype=self.fsdp_reduce_dtype)

    def setup(self, stage: str) -> None:
        """Under DeepSpeed, fill the engine config's keys this module decides (see ``deepspeed_defaults``).

        Runs before the strategy formats its config. A key the user's DeepSpeed config sets wins (a warning
        says so when it differs). Without ``train_micro_batch_size_per_gpu`` Lightning reads it from the
        train loader's batch sampler, which our streamed prompt loaders do not have (it is only used for
        DeepSpeed's throughput logs).
        """
        strategy = self.trainer.strategy
        config = getattr(strategy, "config", None)
        if not strategy_is(strategy, ("DeepSpeedStrategy",)) or not isinstance(config, dict):
            return
        for key, value in self.deepspeed_defaults().items():
            if key in config and config[key] != value and key != "train_micro_batch_size_per_gpu":
                rank_zero_warn(f"the DeepSpeed config sets `{key}: {config[key]}`, used instead of {value} "
                               "from the model's settings")
            config.setdefault(key, value)

    def deepspeed_defaults(self) -> dict[str, Any]:
        """DeepSpeed config entries implied by this module's settings (see ``setup``)."""
        return {"train_micro_batch_size_per_gpu": 1}

    def on_fit_start(self) -> None:
        """Before any validation or training step: the policy in train mode, and the checks that the data
        fits the config (prompt lengths, the columns scoring functions need) and that ``lr`` is not 0."""
        self.policy.train()  # HF models load in eval mode and Lightning keeps it
        self.check_prompt_lengths()
        check_scoring_columns(self, getattr(self.trainer, "datamodule", None))
        warn_if_lr_is_zero(self.trainer.optimizers,
                           [config.scheduler for config in self.trainer.lr_scheduler_configs])

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
                            f"`model.max_prompt_length`={self.max_prompt_length}"
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

    # ---- checkpoints: RNG states travel with the weights, optimiser and data position -------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """This rank's RNG states, and with several ranks every rank's (``rng_states_by_rank``): Lightning
        writes the checkpoint rank 0 built (one metadata file under sharded checkpoints too), so the other
        ranks' states are gathered into it (every rank builds the checkpoint, so all join the gather)."""
        checkpoint["rng_states"] = collect_rng_states()
        trainer = self._trainer
        if trainer is not None and trainer.world_size > 1 and torch.distributed.is_initialized():
            by_rank: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(by_rank, checkpoint["rng_states"])
            checkpoint["rng_states_by_rank"] = by_rank

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Each rank restores its own RNG states when resumed on the same world size; otherwise the saved
        rank's (rank 0's)."""
        by_rank = checkpoint.get("rng_states_by_rank")
        trainer = self._trainer
        if by_rank and trainer is not None and len(by_rank) == trainer.world_size:
            self._rng_states = by_rank[trainer.global_rank]
        else:
            self._rng_states = checkpoint.get("rng_states")

    def on_train_start(self) -> None:
        if getattr(self, "_rng_states", None) is not None:  # after sanity validation, so it can't shift them
            restore_rng_states(self._rng_states)
            self._rng_states = None

    def configure_callbacks(self) -> list[L.Callback]:
        """What every run gets unless the user configured the same callback: the final policy's export, a
        checkpoint on Ctrl-C / SIGTERM, logging at optimiser steps, and Lightning's stock progress bar and
        checkpoint callback swapped for one that counts optimiser steps and for :class:`Checkpoints` (one
        ``last.ckpt``; a checkpoint callback or progress bar configured by the user is left alone)."""
        from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

        from lightning_rl import callbacks as cbs
        from lightning_rl.callbacks.checkpoints import is_stock_model_checkpoint

        wanted = [cbs.ExportPolicy(), cbs.CheckpointOnInterrupt(), cbs.LogAtOptimizerStep()]
        wanted.append(cbs.BatchGeometry())  # a resume with another batch size / G / world size is refused
        if self.trainer.predicting:  # predict writes its rows (the CLI adds one, set by `--predictions.*`)
            wanted.append(cbs.WritePredictions())
        callbacks = [cb for cb in wanted if not has_callback(self.trainer, type(cb))]
        stock = [cb for cb in self.trainer.checkpoint_callbacks if is_stock_model_checkpoint(cb)]
        if stock and len(self.trainer.checkpoint_callbacks) == 1:  # Lightning's default: our policy instead
            self.trainer.callbacks.remove(stock[0])
            callbacks.append(cbs.Checkpoints())
        bar = self.trainer.progress_bar_callback
        if type(bar) in (TQDMProgressBar, RichProgressBar):
            # removed here rather than overridden by type, which only covers subclasses (Rich is the default)
            self.trainer.callbacks.remove(bar)
            # TQDM's refresh rate counts batches; Rich's counts redraws per second (default 100), which as a
            # batch count would freeze the bar for 100 steps: a Rich bar becomes one refresh per step
            rate = bar.refresh_rate if isinstance(bar, TQDMProgressBar) else int(bar.refresh_rate > 0)
            callbacks.append(cbs.StepProgressBar(refresh_rate=rate))
        return callbacks

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(trainable_parameters(self.policy))
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- prompts and validation ----------------------------------------------------------------
    def add_special_tokens(self, prompts: Sequence[Any]) -> list[bool]:
        """Per prompt: chat templates already hold BOS and friends; plain prompts get the tokenizer's
        specials (decided row by row, so a row's tokens never depend on the rest of its batch)."""
        return [not self.chat_template and isinstance(p, str) for p in prompts]

    prompt_tools: list[dict] | None = None  # tool schemas rendered into prompts by the chat template

    def encode_prompts(self, prompts: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        texts = render_prompts(self.tokenizer, prompts, self.chat_template, tools=self.prompt_tools)
        return self.policy.encode_prompts(texts, self.max_prompt_length,
                                          add_special_tokens=self.add_special_tokens(prompts))

    def decode(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> list[str]:
        ids = completion_ids.masked_fill(completion_mask == 0, self.policy.pad_token_id)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

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

    def complete(self, batch: dict[str, list], *, num_samples: int = 1, sampling: SamplingParams,
                 seed: int | None = None) -> Completions:
        """``num_samples`` completions of each prompt row of ``batch`` (validation and predict): the engine's
        texts here; whole episodes in modules with an environment or tools (``OnlineRL``)."""
        gen = self.generate(batch["prompt"], num_samples=num_samples, sampling=sampling, seed=seed)
        return Completions(self.decode(gen.completion_ids, gen.completion_mask), gen.lengths.tolist())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.trainer.optimizers[0] if self.trainer.optimizers else None
        if optimizer is not None:  # the learning rate this step's (first) optimiser step uses
            self.log("optim/lr", float(optimizer.param_groups[0]["lr"]), on_step=True, on_epoch=False,
                     batch_size=1)

    def save_pretrained(self, path: str) -> None:
        """Write the policy and tokenizer as a folder that ``transformers`` loads directly (with adapters: the
        adapter folder, or the merged weights when ``export_merged``)."""
        if getattr(self, "export_merged", False):  # RewardModel has its own __init__ and no adapters
            self.policy.save_pretrained(path, merged=True)
        else:
            self.policy.save_pretrained(path)


def has_callback(trainer: L.Trainer, kind: type) -> bool:
    return any(isinstance(cb, kind) for cb in trainer.callbacks)
