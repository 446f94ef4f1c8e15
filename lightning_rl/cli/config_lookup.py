"""Lookups behind the one-line config errors of :mod:`lightning_rl.cli.config_errors`: which ``--config`` file
(and line) or command-line flag set a key, which file does not parse, and the valid keys and classes closest
to a misspelt one."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Iterable, Sequence
from typing import Any

import yaml

# where class_path suggestions come from, under their public (re-exported) paths
CLASS_MODULES = (
    "lightning_rl.algorithms", "lightning_rl.data", "lightning_rl.callbacks",
    "lightning_rl.episodes.environments",
    "lightning_rl.step.engine", "torch.optim", "torch.optim.lr_scheduler", "lightning.pytorch.callbacks",
    "lightning.pytorch.loggers",
)


def _norm(key: str) -> str:
    return ".".join(p for p in key.strip("-").rstrip("+").split(".") if p != "init_args")


def sources(args: Sequence[str]) -> list[tuple[str, str, str | None]]:
    """``(kind, name, value)`` for each ``--config`` file (kind ``file``) and flag (``flag``), in order."""
    out: list[tuple[str, str, str | None]] = []
    for i, arg in enumerate(args):
        if not arg.startswith("-") or arg.startswith("---") or re.match(r"-\d", arg):
            continue
        name, eq, value = arg.partition("=")
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            value = nxt if nxt is not None and not nxt.startswith("--") else None
        if name in ("--config", "-c"):
            if value:
                out.append(("file", value, None))
        elif name.startswith("--"):
            out.append(("flag", name, value))
    return out


def yaml_line(path: str, key: str, value: str | None = None) -> int | None:
    """The 1-based line of ``key`` in the YAML file ``path`` (``init_args`` levels may be left out in the
    file; list items are searched), or None where the file does not set it (to ``value``, when given)."""
    try:
        with open(path) as f:
            node = yaml.compose(f)
    except (OSError, yaml.YAMLError):
        return None
    return _find(node, key.split("."), value)


def _find(node: Any, parts: list[str], value: str | None) -> int | None:
    if not parts:
        if value is None or not isinstance(node, yaml.ScalarNode) or node.value == str(value):
            return node.start_mark.line + 1
        return None
    if isinstance(node, yaml.SequenceNode):
        return next((line for item in node.value if (line := _find(item, parts, value))), None)
    if not isinstance(node, yaml.MappingNode):
        return None
    for k, v in node.value:
        if k.value == parts[0]:
            if len(parts) == 1 and (value is None or _find(v, [], value)):
                return k.start_mark.line + 1
            if line := _find(v, parts[1:], value):
                return line
    return _find(node, parts[1:], value) if parts[0] == "init_args" else None


def locate(key: str, args: Sequence[str], value: str | None = None) -> str:
    """Where ``key`` was set: ``in FILE, line N`` or ``on the command line: --flag``; the last source wins,
    and one that gives ``value`` is preferred. Empty when no file or flag sets it (a default)."""
    if not key:
        return ""
    for wanted in ([value, None] if value is not None else [None]):
        for prefix in (False, True):  # a flag for the key itself first, then one for a group (`--model X`)
            for kind, name, given in reversed(sources(args)):
                if kind == "file" and not prefix:
                    line = yaml_line(name, key, wanted)
                    if line:
                        return f"in {name}, line {line}"
                elif kind == "flag" and (wanted is None or given == str(wanted)):
                    if _norm(name) == _norm(key) if not prefix else _norm(key).startswith(_norm(name) + "."):
                        return f"on the command line: {name}"
    return ""


def close(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``word`` (difflib), if any is close."""
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def import_path(path: str | None) -> Any:
    """The object at a dotted (or ``module:name``) path, or None."""
    if not path:
        return None
    module, _, name = path.replace(":", ".").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except Exception:  # noqa: BLE001 - any import failure means "no such object"
        return None


def class_arguments(cls_path: str | None) -> list[str]:
    """The init arguments jsonargparse accepts for a class (its signature, ``**kwargs`` followed)."""
    cls = import_path(cls_path)
    if not inspect.isclass(cls):
        return []
    try:
        from jsonargparse import ArgumentParser

        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False)
        names = {a.dest.split(".")[0] for a in parser._actions if a.dest not in ("help", "config")}
        return sorted(n for n in names if n and not n.startswith("_"))
    except Exception:  # noqa: BLE001 - fall back on the signature
        params = inspect.signature(cls.__init__).parameters.values()
        skip = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        return [p.name for p in params if p.name != "self" and p.kind not in skip]


def suggest_key(key: str, known: Sequence[str]) -> str | None:
    """The closest of the parser's ``known`` keys to ``key``; for a misspelt group (``modle.class_path``)
    the closest group with the rest of the key."""
    if hint := close(key, known):
        return hint
    head, _, rest = key.partition(".")
    group = close(head, {k.split(".")[0] for k in known})
    return f"{group}.{rest}" if group and rest else group


def candidate_classes(base: str | None) -> list[str]:
    """Public paths (``lightning_rl.algorithms.GRPO``) of classes under :data:`CLASS_MODULES` that subclass
    ``base`` (a dotted path or a class name), ``base`` itself left out."""
    base_cls = import_path(base) if base and "." in base else None
    out: list[str] = []
    for module_name in CLASS_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # noqa: BLE001 - an optional module that fails to import has no candidates
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not inspect.isclass(obj):
                continue
            if base_cls is not None and (not issubclass(obj, base_cls) or obj is base_cls):
                continue
            ancestors = {c.__name__ for c in obj.__mro__[1:]}
            if base and base_cls is None and base.rsplit(".", 1)[-1] not in ancestors:
                continue
            out.append(f"{module_name}.{name}")
    if not out and inspect.isclass(base_cls) and not inspect.isabstract(base_cls):
        out.append(base)
    return list(dict.fromkeys(out))


def suggest_class(value: str | None, base: str | None) -> tuple[str | None, list[str]]:
    """The closest class to ``value`` among :func:`candidate_classes` (by name), and the candidates."""
    candidates = candidate_classes(base)
    if not value:
        return None, candidates
    by_name = {c.rsplit(".", 1)[-1]: c for c in reversed(candidates)}
    name = close(value.replace(":", ".").rsplit(".", 1)[-1], by_name)
    return (by_name[name] if name else close(value, candidates)), candidates


def yaml_summary(detail: str, args: Sequence[str]) -> str:
    """A YAML syntax error, naming the ``--config`` file that does not parse and its line."""
    for kind, name, _ in sources(args):
        if kind != "file":
            continue
        try:
            with open(name) as f:
                yaml.safe_load(f)
        except OSError:
            continue
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
            context = (f" ({err.context} at line {err.context_mark.line + 1})"
                       if err.context and err.context_mark else "")
            return f"{name}, {where}: invalid YAML: {err.problem}{context}"
        except yaml.YAMLError as err:
            return f"{name}: invalid YAML: {err}"
    text = " ".join(detail.replace('"<unicode string>"', "the value given").split())
    return f"invalid YAML in a value on the command line: {text}"


def not_mapping_summary(detail: str, args: Sequence[str]) -> str:
    """A ``--config`` file whose top level is not a mapping of keys."""
    for kind, name, _ in sources(args):
        try:
            with open(name) as f:
                data = yaml.safe_load(f) if kind == "file" else {}
        except (OSError, yaml.YAMLError):
            continue
        if not isinstance(data, dict):
            return (f"{name}: a config file is a mapping of keys (trainer:, model:, data:...), "
                    f"this one is a {type(data).__name__}")
    return detail.splitlines()[0]
