"""How presets and the flat keys of old map onto the option groups (``lightning_rl.algorithms.options``).

:func:`preset_defaults` reads a preset's default groups from its signature (what LightningCLI shows);
:func:`with_changes` merges mappings over them (``OnlineRL.configured``, as a YAML does). The ``*_MOVED_KEYS``
tables are each algorithm family's flat keys from before the groups and their new paths: a YAML that still
uses one stops with a line naming the new key (``lightning_rl.cli.config_errors``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from lightning_rl.algorithms.learner_options import ObjectiveOptions
from lightning_rl.algorithms.options import PolicyOptions


def preset_defaults(cls: type) -> dict[str, Any]:
    """Each constructor key of ``cls`` and its default, the nearest class in the MRO deciding, following
    ``**kwargs`` up to the first ``__init__`` without them (what LightningCLI shows for a preset that
    re-declares only the groups it changes)."""
    defaults: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        for param in params:
            if param.default is not inspect.Parameter.empty and param.name not in defaults:
                defaults[param.name] = param.default
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return defaults


def with_changes(cls: type, changes: dict[str, Any]) -> dict[str, Any]:
    """Constructor arguments for ``cls``: a mapping given for a group changes those fields of the preset's
    default group (as a YAML does); anything else is passed as is."""
    defaults = preset_defaults(cls)
    out = {}
    for name, value in changes.items():
        default = defaults.get(name)
        if isinstance(value, dict) and dataclasses.is_dataclass(default):
            value = dataclasses.replace(default, **value)
        out[name] = value
    return out


POLICY_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PolicyOptions))
# The FSDP2 options when they were flat keys of `policy` (or of the module), and where they are now
FSDP_MOVED_KEYS: dict[str, str] = {
    **{f"fsdp_{k}": f"policy.fsdp.{k}" for k in ("cpu_offload", "param_dtype", "reduce_dtype")},
    **{f"policy.fsdp_{k}": f"policy.fsdp.{k}" for k in ("cpu_offload", "param_dtype", "reduce_dtype")}}
# The trust regions when they were names, and the class each is now
MOVED_TRUST_REGIONS: dict[str, str] = {
    **{name: f"lightning_rl.maths.trust_regions.{cls}" for name, cls in
       (("clip", "Clip"), ("soft_gate", "SoftGate"), ("cispo", "CISPO"), ("dppo", "DPPO"))},
    "clip_cov": "lightning_rl.maths.covariance_regions.ClipCov",
    "kl_cov": "lightning_rl.maths.covariance_regions.KLCov"}
# Values of before for options that are typed choices now: the last part of the key, the old value, the answer
MOVED_VALUES: dict[str, dict[str, str]] = {
    "trust_region": {old: f"a trust region is a class holding its own options now: `class_path: {path}` (its "
                          "options under `init_args`)" for old, path in MOVED_TRUST_REGIONS.items()},
    "kl_in_reward": {
        "true": "the KL in the reward names its coefficient's controller now: `kl_in_reward: FixedKL` (or "
                "`AdaptiveKL` with `init_args.target`; lightning_rl.maths.penalties)",
        "false": "the KL in the loss is `kl_in_reward: null` now"},
}
_REGION = "objective.trust_region.init_args"
# Each option of the flat `objective` group that a typed choice holds now (the trust region, the KL's
# controller in the reward), and its field in the classes that take it
OBJECTIVE_MOVED_KEYS: dict[str, str] = {
    "kl_target": "objective.kl_in_reward.init_args.target of AdaptiveKL",
    "kl_horizon": "objective.kl_in_reward.init_args.horizon of AdaptiveKL",
    "clip_low": f"{_REGION}.low of Clip or ClipCov", "clip_high": f"{_REGION}.high of Clip, CISPO or ClipCov",
    "clip_ratio_c": f"{_REGION}.dual_clip of Clip", "tau_pos": f"{_REGION}.tau_pos of SoftGate",
    "tau_neg": f"{_REGION}.tau_neg of SoftGate", "dppo_divergence": f"{_REGION}.divergence of DPPO",
    "dppo_low": f"{_REGION}.low of DPPO", "dppo_high": f"{_REGION}.high of DPPO",
    "dppo_ratio_cap": f"{_REGION}.ratio_cap of DPPO", "clip_cov_ratio": f"{_REGION}.ratio of ClipCov",
    "clip_cov_lb": f"{_REGION}.lb of ClipCov", "clip_cov_ub": f"{_REGION}.ub of ClipCov",
    "kl_cov_ratio": f"{_REGION}.ratio of KLCov", "kl_cov_coef": f"{_REGION}.coef of KLCov",
}
# SFT / DPO (PolicyModule): each flat key before the option groups, and where it is now
BASE_MOVED_KEYS: dict[str, str] = {
    **{key: f"policy.{key}" for key in POLICY_KEYS}, **FSDP_MOVED_KEYS,
    **{key: f"validation.{key}" for key in ("max_new_tokens", "accuracy_fn")},
}
# Each flat key of the online family before the option groups, and where it is now (under model.init_args)
ONLINE_MOVED_KEYS: dict[str, str] = {
    **{key: f"policy.{key}" for key in POLICY_KEYS}, **FSDP_MOVED_KEYS,
    **{key: f"sampling.{key}" for key in ("num_generations", "max_new_tokens", "temperature", "top_p",
                                           "top_k", "share_prompt_prefix")},
    "rollout_seed": "sampling.seed",
    "reward_fns": "rewards.functions", "reward_weights": "rewards.weights", "reward_model": "rewards.model",
    "reward_model_weight": "rewards.model_weight", "correctness_fn": "rewards.correctness_fn",
    "accuracy_fn": "rewards.accuracy_fn", "on_reward_error": "rewards.on_error",
    "max_reward_error_frac": "rewards.max_error_frac", "overlong_buffer": "rewards.overlong_buffer",
    "overlong_penalty_factor": "rewards.overlong_penalty_factor",
    **{key: f"episodes.{key}" for key in ("environment", "tools", "max_turns", "max_episode_tokens",
                                           "tool_format", "tool_timeout")},
    "on_env_error": "episodes.on_error",
    **{f.name: f"objective.{f.name}" for f in dataclasses.fields(ObjectiveOptions)},
    **OBJECTIVE_MOVED_KEYS, **{f"objective.{k}": v for k, v in OBJECTIVE_MOVED_KEYS.items()},
    "dynamic_sampling": "filters.dynamic_sampling", "max_gen_batches": "filters.max_gen_batches",
    "mask_truncated": "filters.mask_truncated",
    "behaviour_logp": "logprobs.behaviour", "rollout_correction": "logprobs.correction",
    "ppo_epochs": "update.epochs", "num_minibatches": "update.num_minibatches",
    "micro_batch_size": "update.micro_batch_size", "max_grad_norm": "update.max_grad_norm",
}
PPO_MOVED_KEYS: dict[str, str] = {
    **ONLINE_MOVED_KEYS, "critic_model": "critic.model", "critic_optimizer": "critic.optimizer",
    "critic_lr_scheduler": "critic.lr_scheduler", "vf_coef": "critic.vf_coef",
    "value_clip": "critic.value_clip", "critic_warmup": "critic.warmup",
    "gamma": "advantage.init_args.gamma", "lam": "advantage.init_args.lam",
    "whiten_advantages": "advantage.init_args.whiten"}
