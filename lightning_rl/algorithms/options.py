"""The option groups: what a YAML sets under ``model.init_args``, one small frozen dataclass per concern,
each checking its own fields when built and naming the YAML key that is wrong. A preset (GRPO, DAPO, PPO...)
is the same module with other default groups; a YAML that sets one field of a group keeps the preset's
others, as ``DAPO.configured(objective={...})`` does from Python.

Here the groups every algorithm has: ``PolicyOptions`` and ``ValidationOptions``. The online step's are in
two rooms named for its halves: the sampler's (``sampling``, ``rewards``, ``episodes``) in
:mod:`lightning_rl.algorithms.sampler_options`, the learner's (``objective``, ``filters``, ``logprobs``,
``update``) in :mod:`lightning_rl.algorithms.learner_options`; PPO's critic: ``models.critic.CriticOptions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from lightning_rl.maths.checks import require as require_in
from lightning_rl.models.sharding import FSDPOptions

OnError = Literal["raise", "zero"]


def require(group: str, **checks: tuple[bool, Any, str]) -> None:
    """Raise ``ValueError`` naming ``model.<group>.<key>``, its valid range and the value, for the first
    check ``key=(ok, value, expected)`` that fails."""
    require_in(f"model.{group}", **checks)


@dataclass(frozen=True)
class PolicyOptions:
    """The trained policy: what is loaded and how it is held.

    Args:
        model: hub id, local ``save_pretrained`` folder, or ``builtin:tiny-sort`` / ``builtin:tiny-scratch``.
        dtype: weights dtype (``float32``, ``bfloat16``, ``float16``, ``auto``); ``None`` loads float32
            whatever the checkpoint holds, ``auto`` keeps the checkpoint's.
        trust_remote_code: allow model code from the hub (off by default).
        gradient_checkpointing: trade compute for memory in the forward pass (the critic's too).
        chat_template: render plain-string prompts with the tokenizer's chat template.
        max_prompt_length: longest prompt in tokens; longer ones fail before training, naming the row.
        peft: train adapters only: a ``peft.PeftConfig`` subclass as ``class_path`` + ``init_args`` (e.g.
            ``peft.LoraConfig``), applied right after loading. The KL / DPO reference is then the same
            weights with the adapters disabled, and checkpoints hold the adapters and optimiser state only.
            From Python a ``peft.PeftConfig`` instance works too. Needs ``pip install 'lightning-rl[peft]'``.
        export_merged: with adapters, the exported policy folder holds the merged weights instead of the
            adapter folder.
        fsdp: under FSDP2, CPU offload and the mixed-precision dtypes
            (:class:`~lightning_rl.models.sharding.FSDPOptions`: ``cpu_offload``, ``param_dtype``,
            ``reduce_dtype``); ``null``: FSDP2's defaults.
    """

    model: str = "builtin:tiny-sort"
    dtype: str | None = None
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    chat_template: bool = False
    max_prompt_length: int = 512
    peft: dict[str, Any] | None = None
    export_merged: bool = False
    fsdp: FSDPOptions | None = None

    def __post_init__(self) -> None:
        require("policy", max_prompt_length=(self.max_prompt_length >= 1, self.max_prompt_length, ">= 1"))


@dataclass(frozen=True)
class ValidationOptions:
    """How held-out prompts (and predict) are completed and judged (SFT, DPO; the online family sets these
    from ``sampling`` and ``rewards``).

    Args:
        max_new_tokens: completion budget of greedy validation and predict.
        accuracy_fn: ``module:function`` scoring greedy completions; ``val/accuracy`` is its mean
            (``None``: ``lightning_rl.step.rewards:exact_match``).
    """

    max_new_tokens: int = 64
    accuracy_fn: str | None = None

    def __post_init__(self) -> None:
        require("validation", max_new_tokens=(self.max_new_tokens >= 1, self.max_new_tokens, ">= 1"))
