"""No message names a YAML key that does not exist: every backticked ``model.*`` / ``data.*`` / ``trainer.*``
key in a string of the library (errors, warnings, docstrings' quoted keys alike) is a key, or a group of
keys, that ``lightning-rl fit --print_config`` shows for one of the shipped configs or overlays."""

from __future__ import annotations

import ast
import re

import pytest
import yaml
from helpers import CONFIGS, ROOT, run_cli

KEY = re.compile(r"`((?:model|data|trainer)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
SOURCES = sorted([*(ROOT / "lightning_rl").rglob("*.py"), *(ROOT / "data").glob("*.py"),
                  *(ROOT / "callbacks").glob("*.py")])
# backticked names that are not keys: Python attributes a docstring names, and the flat keys of before the
# option groups that a message answers with their new place
NOT_KEYS = {"trainer.predict", "trainer.global_step", "trainer.save_checkpoint", "model.config.pad_token_id",
            "model.model.layers", "model.reload_weights", "model.init_args.temperature",
            "model.init_args.num_generations"}


def flatten(tree: object, prefix: str) -> set[str]:
    """Every dotted key of a printed config, ``init_args`` dropped (messages name both spellings)."""
    keys = {prefix} if prefix else set()
    if isinstance(tree, dict):
        for name, value in tree.items():
            inner = prefix if name == "init_args" else f"{prefix}.{name}" if prefix else name
            keys |= flatten(value, inner)
    elif isinstance(tree, list):
        for item in tree:
            keys |= flatten(item, prefix)
    return keys


def data_module_keys() -> set[str]:
    """``data.<argument>`` of every DataModule of the data package (the shipped configs use two of them)."""
    import importlib
    import inspect

    import lightning as L

    modules = {obj for path in (ROOT / "data").glob("[!_]*.py")
               for obj in vars(importlib.import_module(f"lightning_rl.data.{path.stem}")).values()
               if inspect.isclass(obj) and issubclass(obj, L.LightningDataModule)}
    return {f"data.{name}" for cls in modules for name in inspect.signature(cls).parameters} | {
        "data.class_path"}


def printed_keys(capsys) -> set[str]:
    top = [c for c in sorted(CONFIGS.glob("*.yaml")) if c.name != "ppo_rm.yaml"]
    configs = [[c] if "class_path" in (yaml.safe_load(c.read_text()).get("model") or {}) else
               [CONFIGS / "grpo.yaml", c] for c in top]  # an overlay goes over the GRPO config
    overlays = sorted(p for p in CONFIGS.rglob("*.yaml") if p.parent != CONFIGS)
    configs += [[CONFIGS / "grpo.yaml", o] for o in overlays]
    configs += [[CONFIGS / "ppo.yaml", CONFIGS / "reward_model.yaml"]]  # the reward model's keys under PPO
    keys = data_module_keys()
    for files in configs:
        with pytest.raises(SystemExit):
            run_cli("fit", *[a for c in files for a in ("--config", c)], "--print_config")
        out = capsys.readouterr().out  # without the lines a library logs to stdout (DeepSpeed's "[...]")
        keys |= flatten(yaml.safe_load("\n".join(x for x in out.splitlines() if not x.startswith("["))), "")
    return keys


def named_keys() -> list[tuple[str, str]]:
    """``(where, key)`` for each backticked key in a string constant (f-strings' literal parts too)."""
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [(f"{path.relative_to(ROOT)}:{node.lineno}", key) for key in KEY.findall(node.value)]
    return found


def normalised(key: str) -> str:
    return key.replace(".init_args", "")


def test_the_scan_finds_keys_in_f_strings_and_skips_templates():
    tree = ast.parse('f"`model.objective.{key}` and `model.sampling.top_k` and `data.batch_size`"')
    texts = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert [k for t in texts for k in KEY.findall(t)] == ["model.sampling.top_k", "data.batch_size"]
    assert flatten({"model": {"class_path": "x", "init_args": {"sampling": {"top_k": 0}}}}, "") == {
        "model", "model.class_path", "model.sampling", "model.sampling.top_k"}


@pytest.mark.slow
def test_every_key_a_message_names_exists(capsys):
    keys = printed_keys(capsys)
    assert {"model.objective.kl_coef", "data.batch_size", "trainer.max_steps"} <= keys
    named = named_keys()
    assert len(named) > 100  # the scan sees the messages
    missing = sorted({f"{where}: `{key}`" for where, key in named
                      if normalised(key) not in keys and key not in NOT_KEYS})
    assert not missing, "messages name keys that no config has:\n" + "\n".join(missing)
