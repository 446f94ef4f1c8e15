"""The ``lightning-rl`` command's checks around parsing; a run that cannot start raises
:class:`lightning_rl.errors.ConfigError` (one line). Before parsing, a command-line ``null`` for a group's
field is rewritten so that jsonargparse takes it (:func:`group_nulls`) and a config that sets
``model.policy.peft`` without peft installed is refused; after it, the ``--ckpt_path`` file and a DeepSpeed
strategy's package are checked: one line each instead of the longer message jsonargparse or Lightning would
give."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from typing import Any

import yaml

from lightning_rl.cli.resume import checkpoint_file_problem
from lightning_rl.errors import ConfigError

# values of `--ckpt_path` that Lightning resolves itself, not paths
CKPT_KEYWORDS = ("last", "best", "hpc")


GROUP_FIELD = re.compile(r"^--model\.(?:init_args\.)?([a-z_]+)\.([a-z_]+)$")
NULLS = ("null", "none", "~")


def group_nulls(args: Any) -> Any:
    """``--model.init_args.<group>.<field> null`` as ``--model.init_args.<group> '{"<field>": null}'``.

    jsonargparse (4.53) turns a command-line ``null`` for a field of a dataclass group into the string
    ``"None"`` or a type error; the same null given as a mapping is merged into the group like a YAML
    value. Other arguments pass unchanged (``args`` that are not a list, too)."""
    if not isinstance(args, (list, tuple)):
        return args
    out, items, i = [], [str(a) for a in args], 0
    while i < len(items):
        key, eq, value = items[i].partition("=")
        match = GROUP_FIELD.match(key)
        if not eq and i + 1 < len(items):
            value = items[i + 1]
        if match and match.group(2) not in ("class_path", "init_args") and value.strip().lower() in NULLS:
            out += [f"--model.init_args.{match.group(1)}", json.dumps({match.group(2): None})]
            i += 1 if eq else 2
            continue
        out.append(items[i])
        i += 1
    return out


def check_strategy_installed(config: Any) -> None:
    """Name the extra to install when ``trainer.strategy`` is DeepSpeed and the package is absent (Lightning's
    own error comes wrapped in jsonargparse's dump of the whole config)."""
    strategy = config.get("trainer", {}).get("strategy") if hasattr(config, "get") else None
    name = strategy if isinstance(strategy, str) else str(getattr(strategy, "class_path", strategy) or "")
    if "deepspeed" in name.lower() and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("`trainer.strategy` needs DeepSpeed installed: "
                          "pip install 'lightning-rl[deepspeed]' "
                          "(Lightning's DeepSpeed strategy runs on CUDA devices)")


def requested_peft(args: Any) -> bool:
    """Whether the command line (its ``--config`` files read in order, then inline overrides) sets
    ``model.policy.peft``; the last setting wins. Files that cannot be read are left to the parser."""
    if not isinstance(args, (list, tuple)):
        return False
    wanted = False
    args = [str(a) for a in args]
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if not value and i + 1 < len(args):
            value = args[i + 1]
        if key in ("--config", "-c"):
            try:
                with open(value) as f:
                    model = (yaml.safe_load(f) or {}).get("model")
            except (OSError, yaml.YAMLError, AttributeError):
                continue
            if isinstance(model, dict):
                init_args = model.get("init_args") if isinstance(model.get("init_args"), dict) else model
                policy = init_args.get("policy")
                if isinstance(policy, dict) and "peft" in policy:
                    wanted = policy["peft"] is not None
        elif key in ("--model.init_args.policy.peft", "--model.policy.peft"):
            wanted = value.strip().lower() not in ("null", "none", "")
        elif key.startswith(("--model.init_args.policy.peft.", "--model.policy.peft.")):
            wanted = True
    return wanted


def check_peft_installed(args: Any) -> None:
    """Name the extra to install when the config sets ``model.policy.peft`` and peft is absent (jsonargparse
    fails while parsing, on importing the config's ``class_path``, with a message that does not say so)."""
    if importlib.util.find_spec("peft") is None and requested_peft(args):
        from lightning_rl.models.adapters import PEFT_EXTRA

        raise ConfigError(f"ImportError: `model.policy.peft` needs the optional `peft` package: {PEFT_EXTRA}")


def check_checkpoint_file(path: str | None) -> None:
    """Fail with one line naming ``path`` and what it holds unless it can be a Lightning checkpoint: an
    empty file, one that is not a zip, a zip not written by torch, a plain state dict, a pickle refused by
    ``weights_only`` (:func:`lightning_rl.cli.resume.checkpoint_file_problem`, which only peeks).

    Keywords (``last``...), URLs and folders (sharded checkpoints) are left to Lightning.
    """
    if path is None or path in CKPT_KEYWORDS or "://" in str(path) or os.path.isdir(path):
        return
    if not os.path.exists(path):
        raise ConfigError(f"checkpoint {path} not found")
    problem = checkpoint_file_problem(path)
    if problem is not None:
        raise ConfigError(f"`--ckpt_path` {path} is not a valid checkpoint: {problem}")
