"""lightning-rl: RL post-training for causal language models on PyTorch Lightning."""

import importlib.util

__version__ = "0.1.0"

# the core's layers, lowest first (tests/test_layering.py holds each to importing only those before it)
LAYERS = ("text", "maths", "models", "step", "episodes", "algorithms", "cli")


def moved_hint(module_name: str) -> str:
    """``" (it moved to `lightning_rl.step.rewards`)"`` for a module of the flat layout before the layers
    (``lightning_rl.rewards``), for messages about an import path a user's YAML still names; else ``""``."""
    head, _, rest = module_name.partition(".")
    if head != "lightning_rl" or not rest or "." in rest:
        return ""
    for layer in LAYERS:
        if importlib.util.find_spec(f"lightning_rl.{layer}.{rest}") is not None:
            return f" (it moved to `lightning_rl.{layer}.{rest}`)"
    return ""


def split_import_path(path: str) -> tuple[str, str]:
    """``("package.module", "name")`` of a YAML import path ``package.module:name`` (``package.module.name``
    also accepted); an empty part where the path has none (the caller names what it expected)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    return module_name, attr
