"""PEFT adapters (LoRA and friends) on the policy, switched on from the config's ``model.policy.peft`` key.

``model.policy.peft`` names a ``peft.PeftConfig`` subclass the way ``model.optimizer`` names an optimiser::

    peft:
      class_path: peft.LoraConfig
      init_args: {r: 16, lora_alpha: 32, lora_dropout: 0.0, target_modules: [q_proj, v_proj]}

``PolicyModule`` wraps the loaded causal LM with ``peft.get_peft_model`` before anything else sees it, so
that only the adapters train (the optimiser gets ``requires_grad`` parameters only), the KL / DPO
reference is the same weights with the adapters disabled (``Policy.reference``: no second copy), the
checkpoints hold the adapters without the frozen base (:func:`drop_frozen_weights`) and the export is
either the adapter folder or the merged weights (:func:`merged_model`).

``peft`` is an optional extra: nothing here imports it until a config asks for it, and then a missing
package fails with the command that installs it.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

PEFT_EXTRA = "pip install 'lightning-rl[peft]'"
CAUSAL_LM = "CAUSAL_LM"


def require_peft(key: str = "model.policy.peft") -> Any:
    """The ``peft`` module, or an ImportError naming ``key`` and the extra that installs it."""
    try:
        import peft
    except ImportError as err:
        raise ImportError(f"`{key}` needs the optional `peft` package: {PEFT_EXTRA}") from err
    return peft


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (False when peft is not installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _resolve_class(class_path: str, peft: Any, key: str) -> type:
    module_name, _, name = class_path.rpartition(".")
    try:
        owner = importlib.import_module(module_name) if module_name else peft  # `LoraConfig` = peft's
        cls = getattr(owner, name)
    except (ImportError, AttributeError) as err:
        if module_name.split(".")[0] == "peft":
            raise ValueError(f"`{key}.class_path`: peft {peft.__version__} has no `{class_path}`") from err
        raise ValueError(f"`{key}.class_path`: cannot import `{class_path}` ({err})") from err
    if not (isinstance(cls, type) and issubclass(cls, peft.PeftConfig)):
        raise ValueError(f"`{key}.class_path`: `{class_path}` is not a peft.PeftConfig subclass "
                         "(e.g. peft.LoraConfig)")
    return cls


def _config_from_mapping(spec: Mapping, peft: Any, key: str) -> Any:
    """The ``peft.PeftConfig`` of the YAML form ``{"class_path": ..., "init_args": {...}}`` (see
    :func:`peft_config`).

    Raises:
        ValueError: no ``class_path``, an unknown class, or arguments the config class rejects.
    """
    if not isinstance(spec.get("class_path"), str):
        raise ValueError(f"`{key}` takes `class_path` (e.g. peft.LoraConfig) and `init_args`, got "
                         f"{sorted(spec)}")
    cls = _resolve_class(spec["class_path"], peft, key)
    # other keys are init args too: jsonargparse puts `--model.init_args.policy.peft.init_args.r 8` there
    extra = {k: v for k, v in spec.items() if k not in ("class_path", "init_args")}
    init_args = {**(spec.get("init_args") or {}), **extra}
    try:
        return cls(**init_args)
    except (TypeError, ValueError) as err:
        raise ValueError(f"`{key}.init_args`: {cls.__name__} rejected {init_args}: {err}") from err


def peft_config(spec: Any, key: str = "model.policy.peft") -> Any:
    """Build the ``peft.PeftConfig`` that ``spec`` describes.

    Args:
        spec: ``{"class_path": "peft.LoraConfig", "init_args": {...}}`` (the YAML form; a bare class name is
            looked up in ``peft``; other keys beside ``init_args`` count as init args, which is where
            jsonargparse puts a command-line ``--model.init_args.policy.peft.init_args.r 8``), or a
            ``peft.PeftConfig`` instance (copied).
        key: the config key, for messages.

    Returns:
        The config, with ``task_type`` set to ``CAUSAL_LM`` when it was unset (the policy is a causal LM;
        ``AutoPeftModelForCausalLM`` needs it to reload the adapter folder).

    Raises:
        ImportError: peft is not installed (naming the extra).
        ValueError: an unknown class, unknown keys, arguments the config class rejects, or another task type.
    """
    peft = require_peft(key)
    if isinstance(spec, peft.PeftConfig):
        config = copy.deepcopy(spec)
    elif isinstance(spec, Mapping):
        config = _config_from_mapping(spec, peft, key)
    else:
        raise ValueError(f"`{key}` must be a mapping with `class_path` / `init_args` or a peft.PeftConfig, "
                         f"got {type(spec).__name__}")
    task = getattr(config, "task_type", None)
    if task is None:
        config.task_type = CAUSAL_LM
    elif str(getattr(task, "value", task)) != CAUSAL_LM:
        raise ValueError(f"`{key}.init_args.task_type` must be CAUSAL_LM (or unset) for a policy, got {task}")
    return config


def wrap_model(model: nn.Module, spec: Any, key: str = "model.policy.peft") -> nn.Module:
    """``peft.get_peft_model(model, peft_config(spec))``: adapters added, every base weight frozen.

    Raises:
        ValueError: naming ``key`` when the config matches no module of the model (e.g. a
            ``target_modules`` name the architecture does not have) or leaves nothing to train.
    """
    peft = require_peft(key)
    config = peft_config(spec, key)
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as err:  # e.g. "Target modules {...} not found in the base model"
        linear = (name for name, m in model.named_modules() if isinstance(m, nn.Linear))
        names = sorted({name.rsplit(".", 1)[-1] for name in linear})
        raise ValueError(f"`{key}`: {err} (the model's linear layers are named {names})") from err
    if not any(p.requires_grad for p in wrapped.parameters()):
        raise ValueError(f"`{key}`: the adapter config leaves no trainable parameter")
    return wrapped


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimiser should hold: those with ``requires_grad`` (all of them without PEFT)."""
    return [p for p in module.parameters() if p.requires_grad]


def named_trainable_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """:func:`trainable_parameters` by name (what a worker sampling ahead receives each step)."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def parameter_counts(module: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts (tied weights counted once; global sizes under FSDP2)."""
    params = list(module.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


# ---- checkpoints: adapters (and optimiser state) only; the frozen base is reloaded from `model` ----------
def frozen_names(policy: nn.Module, prefix: str) -> set[str]:
    """State-dict names (under ``prefix``) of the policy's frozen base weights, tied aliases included.

    Adapter parameters stay in even when frozen (LoRA-FA freezes ``lora_A``): they are not in ``model``.
    """
    adapters = set(getattr(policy.model, "peft_config", None) or {})
    return {f"{prefix}{name}" for name, p in policy.named_parameters(remove_duplicate=False)
            if not p.requires_grad and not _adapter_key(name, adapters)}


def drop_frozen_weights(
    owner: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post hook of a ``PolicyModule`` with a PEFT policy: leave the frozen base weights out.

    They never change during training and are rebuilt from ``model`` when the module is built (a resume
    does that first), so a checkpoint holds only what trains: the adapters, plus the optimiser state.
    """
    for name in frozen_names(owner.policy, f"{prefix}policy."):
        state_dict.pop(name, None)


def allow_missing_frozen(owner: nn.Module, incompatible_keys: Any) -> None:
    """Load-state-dict post hook matching :func:`drop_frozen_weights`: missing frozen weights are expected."""
    frozen = frozen_names(owner.policy, "policy.")
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing if k not in frozen and not any(k.endswith(f".{f}") for f in frozen)]


# ---- export: merged weights ----------------------------------------------------------------------------
def merged_model(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """A plain ``transformers`` model holding ``state_dict``'s adapters merged into its base weights.

    Built fresh on the CPU (no copy of the training model, which may be sharded or on an accelerator): a
    model of the base's class and config, wrapped with the same adapter configs, loads ``state_dict`` (the
    PEFT model's full state dict, e.g. gathered from FSDP2 shards) and ``merge_and_unload`` folds the
    adapters in. No collective: rank 0 alone may call it.

    Args:
        model: the trained ``PeftModel`` (only its classes and configs are read).
        state_dict: its full state dict (every key of ``model.state_dict()``), on any device.
    """
    peft = require_peft()
    from transformers.initialization import no_init_weights

    base = model.get_base_model()
    config = copy.deepcopy(base.config)
    dtype = next((v.dtype for v in state_dict.values() if torch.is_floating_point(v)), torch.float32)
    with no_init_weights():  # every weight comes from state_dict
        fresh = type(base)(config).to(dtype)
    fresh.tie_weights()  # skipped under no_init_weights; otherwise the merge would untie the embeddings
    configs = copy.deepcopy(dict(model.peft_config))
    names = list(configs)
    wrapped = peft.get_peft_model(fresh, configs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        wrapped.add_adapter(name, configs[name])
    cpu = {k: v.detach().to("cpu") for k, v in state_dict.items()}
    missing, unexpected = wrapped.load_state_dict(cpu, strict=False)
    tied = set(getattr(type(base), "_tied_weights_keys", None) or [])
    missing = [k for k in missing if not any(k.endswith(t) for t in tied)]
    if missing or unexpected:
        raise ValueError(f"merging the adapters: state dict does not match the model (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    active = list(getattr(model, "active_adapters", None) or names[:1])
    return wrapped.merge_and_unload(adapter_names=active)


def base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's own weights under their original names (adapters left out) of a ``PeftModel``.

    What the model was before ``get_peft_model``: tuner layers' ``base_layer`` weights renamed back, and the
    originals of ``modules_to_save`` copies. Used to start PPO's critic from a PEFT policy's backbone.
    """
    base = model.get_base_model()
    out = {}
    for key, value in base.state_dict().items():
        if ".base_layer." in key:
            out[key.replace(".base_layer.", ".")] = value
        elif ".original_module." in key:
            out[key.replace(".original_module.", ".")] = value
        elif not _adapter_key(key, set(model.peft_config)):
            out[key] = value
    return out


def _adapter_key(key: str, adapters: set[str]) -> bool:
    """Whether ``key`` belongs to one of the ``adapters`` (``...lora_A.default.weight``,
    ``...modules_to_save.default.weight``): PEFT names each adapter's modules after it."""
    return any(part in adapters for part in key.split(".")[:-1])
