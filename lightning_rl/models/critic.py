"""The PPO critic: a token-classification model with one label, predicting a value per completion token.

By default it starts from the policy's own weights (the backbone copied, a fresh scalar head), as verl and
OpenRLHF do; ``critic_model`` may instead name a folder or hub id, e.g. a reward model trained with
``configs/reward_model.yaml`` (its backbone and ``score`` weights load; a token-classification head also
has a bias, which starts at 0). The critic reads the policy's token ids, so its vocabulary must match.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForTokenClassification

from lightning_rl.maths.checks import require
from lightning_rl.models.adapters import base_state_dict, is_peft_model
from lightning_rl.models.loading import load_pretrained, torch_dtype
from lightning_rl.models.model_utils import base_model, disable_dropout, position_ids
from lightning_rl.models.policy import Policy


def _head(model: nn.Module) -> nn.Linear | None:
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    return head if isinstance(head, nn.Linear) else None


class Critic(nn.Module):
    """A value model over the policy's tokens.

    Args:
        model: a Hugging Face ``*ForTokenClassification`` model with ``num_labels == 1``.
        tokenizer: the policy's tokenizer (padding, export).
    """

    def __init__(self, model: nn.Module, tokenizer: Any) -> None:
        super().__init__()
        if getattr(model.config, "num_labels", None) != 1:
            raise ValueError(f"the critic must have one label, got num_labels={model.config.num_labels}")
        self.model = model
        self.tokenizer = tokenizer
        disable_dropout(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def values(
        self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
    ) -> Tensor:
        """``[N, C]`` float32 values of the states before each completion token (0 on padding).

        Position ``t`` of the completion is scored from the hidden state that predicted token ``t`` (the
        same shift as the policy's log-probs, as verl's critic does).
        """
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
        out = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                         use_cache=False)
        keep = completion_ids.shape[1] + 1
        values = out.logits[:, -keep:-1, 0].float()
        return values.masked_fill(completion_mask == 0, 0.0)

    forward = values  # DDP / FSDP wrappers route through forward

    def save_pretrained(self, path: str) -> None:
        """Write the critic as a folder that ``AutoModelForTokenClassification`` loads, with the tokenizer."""
        self.model.save_pretrained(path)
        side = self.tokenizer.padding_side
        self.tokenizer.padding_side = getattr(self.tokenizer, "_export_padding_side", side)
        try:
            self.tokenizer.save_pretrained(path)
        finally:
            self.tokenizer.padding_side = side


def critic_from_policy(policy: Policy) -> Critic:
    """A critic whose backbone is a copy of the policy's and whose scalar head is fresh (bias 0).

    A PEFT policy's critic copies the base weights (the adapters are not merged in) and trains all of them.
    """
    peft = is_peft_model(policy.model)
    lm = policy.model.get_base_model() if peft else base_model(policy.model)
    config = copy.deepcopy(lm.config)
    config.num_labels = 1
    config.id2label, config.label2id = {0: "value"}, {"value": 0}
    model = AutoModelForTokenClassification.from_config(config, dtype=lm.dtype)
    backbone = getattr(model, model.base_model_prefix)
    if peft:  # the base weights under their own names, without the adapters' wrappers
        prefix = f"{lm.base_model_prefix}."
        base = base_state_dict(policy.model)
        weights = {k[len(prefix) :]: v for k, v in base.items() if k.startswith(prefix)}
    else:
        weights = getattr(lm, lm.base_model_prefix).state_dict()
    missing, unexpected = backbone.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"could not copy the policy's backbone into the critic: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    head = _head(model)
    if head is not None and head.bias is not None:
        nn.init.zeros_(head.bias)
    return Critic(model, policy.tokenizer)


def load_critic(
    source: str | None, policy: Policy, dtype: str | None = None, trust_remote_code: bool = False,
    key: str = "model.critic.model",
) -> Critic:
    """The critic named by ``source`` (the config key ``key``, for messages), or one from the policy.

    ``source`` may be ``None`` (the policy's weights), ``builtin:tiny-sort``, a local folder or a hub id
    of any model ``AutoModelForTokenClassification`` can build (a causal LM, a reward model, a critic),
    loaded by :func:`~lightning_rl.models.loading.load_pretrained` (a missing folder or an unreachable hub
    fails at
    once, naming ``key``). ``dtype`` None: the policy's dtype, whatever the checkpoint holds (a bf16
    critic beside a float32 policy would train without a float32 master copy).
    """
    if source is None:
        return critic_from_policy(policy)
    kwargs: dict[str, Any] = {"num_labels": 1, "trust_remote_code": trust_remote_code,
                              "dtype": policy.model.dtype if dtype is None else torch_dtype(dtype, key)}

    def load(path: str, offline: bool) -> tuple[nn.Module, dict[str, Any]]:
        # the config first: offline and not cached, it fails at once, where the model's own lookup of an
        # adapter config asked huggingface.co with retries for ~20 s (transformers 5)
        AutoConfig.from_pretrained(path, local_files_only=offline, trust_remote_code=trust_remote_code)
        return AutoModelForTokenClassification.from_pretrained(
            path, output_loading_info=True, local_files_only=offline, **kwargs
        )

    model, info = load_pretrained(source, load, key=key, builtins=("builtin:tiny-sort",))
    ours = policy.model.get_input_embeddings().num_embeddings
    theirs = model.get_input_embeddings().num_embeddings
    if theirs != ours:
        raise ValueError(f"`{key}`: the critic's vocabulary ({theirs} embeddings) does not match the "
                         f"policy's ({ours}): the critic reads the policy's token ids")
    head = _head(model)
    fresh = set(info.get("missing_keys", ()))
    if head is not None and head.bias is not None and any("score" in k and k.endswith("bias") for k in fresh):
        nn.init.zeros_(head.bias)  # a reward model's head has no bias: start the critic's at 0
    return Critic(model, policy.tokenizer)


@dataclass(frozen=True)
class CriticOptions:
    """PPO's value model, trained beside the policy with its own optimiser.

    Args:
        model: where it starts: ``None`` copies the policy's weights (fresh scalar head); else a folder or
            hub id that ``AutoModelForTokenClassification`` loads with one label (a causal LM, a reward model
            from ``configs/reward_model.yaml``, a saved critic) with the policy's vocabulary.
        optimizer: its optimiser factory (``class_path`` + ``init_args``).
        lr_scheduler: its LR scheduler factory, stepped with its optimiser.
        vf_coef: weight of the value loss.
        value_clip: clip range around the rollout-time values (``None``: off).
        warmup: rollouts at the start during which only the critic learns.
    """

    model: str | None = None
    optimizer: OptimizerCallable = torch.optim.AdamW
    lr_scheduler: LRSchedulerCallable | None = None
    vf_coef: float = 0.5
    value_clip: float | None = 0.2
    warmup: int = 0

    def __post_init__(self) -> None:
        require("model.critic", vf_coef=(self.vf_coef > 0, self.vf_coef, "> 0"),
                warmup=(self.warmup >= 0, self.warmup, ">= 0"),
                value_clip=(self.value_clip is None or self.value_clip > 0, self.value_clip, "> 0 or null"))
