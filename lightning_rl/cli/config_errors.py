"""Config errors in one line: what is wrong, where (``--config`` file and line, or command-line flag), and
the closest valid key, value or class.

jsonargparse answers a wrong key, type, choice or ``class_path`` with the whole usage and a nested report
whose last lines are ``Given value: ...``; the sentence that matters sits in the middle.
:mod:`lightning_rl.cli.error_report` reads that report (the text jsonargparse puts in
``parser.error(message)``) into a ``Problem``, :mod:`lightning_rl.cli.config_lookup` finds which
``--config`` file (and line) or flag gave the key and what is closest to it, and :func:`summarize` here
writes the line. :class:`SummarizingParser` is
the LightningCLI parser class that prints it as the last line of stderr and exits with status 2
(argparse's convention for usage errors); ``LRL_DEBUG=1`` prints jsonargparse's full report above it.
After parsing, :func:`check_class_paths` refuses a ``class_path`` that names a function (jsonargparse
would call ``os.system`` given as an optimizer).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn

from lightning.pytorch.cli import LightningArgumentParser

from lightning_rl.cli.config_lookup import (
    class_arguments,
    close,
    import_path,
    locate,
    not_mapping_summary,
    suggest_class,
    suggest_key,
    yaml_summary,
)
from lightning_rl.cli.error_report import Problem, parse_message

DEBUG_ENV = "LRL_DEBUG"
PREFIX = "lightning-rl: error: "


# ----- the line


def _quote(value: Any, limit: int = 80) -> str:
    text = str(value)
    return f"'{text[:limit]}...'" if len(text) > limit else f"'{text}'"


def _or(words: Sequence[str]) -> str:
    words = list(dict.fromkeys(words))
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _grouped(paths: Sequence[str]) -> str:
    """``a.b.C``, ``a.b.D`` -> ``a.b.{C, D}``."""
    groups: dict[str, list[str]] = {}
    for path in paths:
        module, _, name = path.rpartition(".")
        groups.setdefault(module, []).append(name)
    return ", ".join(f"{m}.{{{', '.join(n)}}}" if len(n) > 1 else f"{m}.{n[0]}" for m, n in groups.items())


def summarize(message: str, args: Sequence[str], known: Iterable[str] = ()) -> str:
    """One line (``lightning-rl: error: ...``) for a jsonargparse error ``message`` of a command line
    ``args``; ``known`` are the parser's keys and flags, for suggestions."""
    known = list(known)
    p = parse_message(message)
    where = locate(p.key, args, p.value)
    at = f" ({where})" if where else ""
    if answer := moved_value(p.key, p.value):
        return PREFIX + f"`{p.key.removesuffix('.class_path')}` = {_quote(p.value)}{at}: {answer}"
    if p.kind == "unknown_key" and (moved := moved_key(p.key, p.cls)):
        return PREFIX + _moved_key(p, moved, args)
    if p.kind == "unknown_key":
        return PREFIX + _unknown_key(p, at, known)
    if p.kind == "type":
        return PREFIX + _wrong_type(p, at)
    if p.kind == "class_path":
        return PREFIX + _wrong_class(p, at)
    if p.kind == "unrecognized":
        return PREFIX + _unrecognized(p, known)
    if p.kind == "subcommand":
        return PREFIX + _wrong_subcommand(p)
    if p.kind == "yaml":
        return PREFIX + yaml_summary(p.detail, args)
    if p.kind == "required":
        keys = ", ".join(f"`{k}`" for k in p.choices)
        flags = "/".join(f"--{k}" for k in p.choices)
        return PREFIX + f"missing {keys}: set it in a --config file (configs/grpo.yaml...) or with {flags}"
    if p.kind == "not_mapping":
        return PREFIX + not_mapping_summary(p.detail, args)
    if p.key == "config":
        return PREFIX + f"--config: {p.detail}"
    if p.cls and import_path(p.cls) is not None and not inspect.isclass(import_path(p.cls)):
        key = f"{p.key}.class_path"
        where = locate(key, args, p.cls)
        return PREFIX + function_refusal(key, p.cls, where)
    return PREFIX + (f"`{p.key}`{at}: " if p.key else "") + p.detail


def _moved_key(p: Problem, moved: tuple[str, str], args: Sequence[str]) -> str:
    """A flat key from before the option groups (``moved``: its old and new key, the new one perhaps followed
    by the classes that take it), and where it was given."""
    old, (new, _, of) = moved[0], moved[1].partition(" ")
    where = locate(old, args)
    return (f"`{old}`{f' ({where})' if where else ''} is now `{new}`{f' ({of})' if of else ''}: {p.cls} "
            "takes its options in groups (see --print_config)")


def _unrecognized(p: Problem, known: Sequence[str]) -> str:
    """An argument on the command line that no option takes, with the closest flag of ``known``."""
    flags = [a for a in str(p.value).split() if a.startswith("-")]
    if not flags:
        return f"unexpected argument {_quote(p.value)} on the command line"
    hint = close(flags[0].split("=")[0], [k for k in known if k.startswith("--")])
    return (f"unknown option {flags[0]} (on the command line)"
            + (f"; did you mean {hint}?" if hint else "; `--help` lists every option"))


def _wrong_subcommand(p: Problem) -> str:
    """An unknown subcommand (or none), with the closest one and the list of them."""
    hint = close(p.value or "", p.choices)
    given = f"unknown subcommand {_quote(p.value)}" if p.value else "no subcommand given"
    given += f"; did you mean `{hint}`?" if hint else ""
    return given + f" (one of: {', '.join(p.choices)})"


def _unknown_key(p: Problem, at: str, known: Sequence[str]) -> str:
    """An unknown key, with the closest argument of its class (or key of the parser)."""
    name = p.key.rsplit(".", 1)[-1]
    group = p.key.split(".")[-2] if p.key.count(".") >= 2 else ""
    if p.cls and group not in ("init_args", "") and (fields := group_fields(p.cls, group)):
        hint = close(name, fields)
        body = f"unknown key `{p.key}`{at}: the `{group}` group of {p.cls} has no field `{name}`"
    elif p.cls:
        hint = close(name, class_arguments(p.cls))
        body = f"unknown key `{p.key}`{at}: {p.cls} has no argument `{name}`"
    else:
        hint = suggest_key(p.key, [k for k in known if not k.startswith("-")])
        body = f"unknown key `{p.key}`{at}"
    return body + (f"; did you mean `{hint}`?" if hint else "")


def group_fields(cls_path: str, group: str) -> list[str]:
    """The fields of the option group ``group`` of the class at ``cls_path`` (its default dataclass)."""
    from lightning_rl.algorithms.presets import preset_defaults

    cls = import_path(cls_path)
    default = preset_defaults(cls).get(group) if inspect.isclass(cls) else None
    return [f.name for f in dataclasses.fields(default)] if dataclasses.is_dataclass(default) else []


def moved_value(key: str | None, value: object) -> str | None:
    """The answer to a value of before for an option that is a typed choice now (``trust_region: cispo``,
    ``kl_in_reward: true``), or ``None``."""
    from lightning_rl.algorithms.presets import MOVED_VALUES

    name = (key or "").removesuffix(".class_path").rsplit(".", 1)[-1]
    return MOVED_VALUES.get(name, {}).get(str(value).lower()) if value is not None else None


def moved_key(key: str, cls_path: str | None) -> tuple[str, str] | None:
    """``(old key, new key)`` when ``key`` (or the mapping it sits in) is a flat key of ``cls_path`` from
    before the option groups (``model.init_args.temperature`` -> ``model.init_args.sampling.temperature``)."""
    moved = getattr(import_path(cls_path), "moved_keys", None) if cls_path else None
    parts = key.split(".")
    for i in range(1, len(parts)):
        for j in range(len(parts), i, -1):  # the longest old key first (``objective.clip_high``)
            old = ".".join(parts[i:j])
            if moved and old in moved and parts[i - 1] == "init_args":
                head = ".".join(parts[:i])
                return f"{head}.{old}", f"{head}.{moved[old]}"
    return None


def _wrong_type(p: Problem, at: str) -> str:
    """A value of the wrong type, or outside a ``Literal``: what is accepted, and the closest choice."""
    body = f"`{p.key}` = {_quote(p.value)}{at}: expected "
    if not p.choices:
        return body + _or(p.expected)
    choices = list({str(c): c for c in p.choices}.values())
    body += ("one of " if len(choices) > 1 else "") + ", ".join(repr(c) for c in choices)
    body += f" or {_or(p.expected)}" if p.expected else ""
    hint = close(str(p.value), [str(c) for c in choices])
    return body + (f"; did you mean {hint!r}?" if hint else "")


def _wrong_class(p: Problem, at: str) -> str:
    """A ``class_path`` that names no class, or one that is not a subclass of what the key takes: why, and
    the closest class (else the candidates, ours first)."""
    hint, candidates = suggest_class(p.value, p.base)
    base = (p.base or "").rsplit(".", 1)[-1]
    if "subclass" in p.detail or "does not correspond" in p.detail:
        what = f"not a subclass of {base}" if base else p.detail
    elif p.detail.startswith("Expected a dot import path"):
        what = "no such class"
    elif str(p.value).endswith((".yaml", ".yml", ".json")):
        what = f"no such file (nor class: {p.detail})"
    elif import_path(p.value) is None:
        what = f"no such class ({p.detail})"
    else:
        what = p.detail
    body = f"`{p.key}` = {_quote(p.value)}{at}: {what}"
    if hint:
        return body + f"; did you mean `{hint}`?"
    ours = [c for c in candidates if c.startswith("lightning_rl.")] or candidates
    return body + (f"; expected one of {_grouped(ours[:16])}" if ours else "")


def interpolation_summary(err: Exception, args: Sequence[str]) -> str:
    """An omegaconf interpolation error (``${...}`` in a ``--config`` file): its key, file and line."""
    key = str(getattr(err, "full_key", "") or "")
    reason = str(getattr(err, "msg", None) or err).splitlines()[0]
    where = locate(key, [a for a in args])
    return PREFIX + f"`{key}`{f' ({where})' if where else ''}: bad ${{...}} interpolation: {reason}"


def function_refusal(key: str, path: str, where: str) -> str:
    """The line refusing a ``class_path`` that names a function."""
    return (f"`{key}` = '{path}'{f' ({where})' if where else ''}: {path} is a function, not a class; "
            "a class_path names a class (an optimiser such as torch.optim.AdamW, a callback, a DataModule)")


def function_class_paths(config: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(key, path)`` of every ``class_path`` in a parsed config that names something other than a class
    (``os.system``): jsonargparse accepts a function there for callable arguments such as ``optimizer`` and
    calls it with ``init_args`` when the classes are instantiated."""
    if isinstance(config, argparse.Namespace):
        items: Iterable[tuple[Any, Any]] = vars(config).items()
    elif isinstance(config, dict):
        items = config.items()
    elif isinstance(config, list):
        items = enumerate(config)
    else:
        return []
    out: list[tuple[str, str]] = []
    for name, value in items:
        key = f"{prefix}{name}"
        if name == "class_path" and isinstance(value, str):
            obj = import_path(value)
            if obj is not None and not inspect.isclass(obj):
                out.append((key, value))
        else:
            out += function_class_paths(value, f"{key}.")
    return out


# ----- the parser


def _root_args(parser: Any) -> list[str]:
    root = parser
    while getattr(root, "parent_parser", None) is not None:
        root = root.parent_parser
    args = getattr(root, "args", None) or getattr(parser, "args", None)
    return [str(a) for a in (args if args is not None else sys.argv[1:])]


def fail(parser: Any, line: str, message: str | None = None) -> NoReturn:
    """Print ``line`` as the last line of stderr and exit with status 2; with ``LRL_DEBUG=1`` the parser's
    usage and jsonargparse's full ``message`` come first, else a tip on where to find them."""
    prog = str(getattr(parser, "prog", "lightning-rl")).replace(" [options]", "")
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        parser.print_usage(sys.stderr)
        if message:
            sys.stderr.write(f"error: {message}\n")
    else:
        sys.stderr.write(f"tip: `{prog} --help` lists every option; "
                         f"{DEBUG_ENV}=1 prints the parser's full report\n")
    sys.stderr.write(line.replace("\n", " ") + "\n")
    sys.exit(2)


class SummarizingParser(LightningArgumentParser):
    """LightningCLI's parser whose usage errors end in one line saying what is wrong and where (see
    :func:`summarize`). Inner parsers (``exit_on_error=False``) and ``JSONARGPARSE_DEBUG`` raise as before."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        from jsonargparse._common import debug_mode_active

        if not self.exit_on_error or debug_mode_active():
            super().error(message, ex)
        self._logger.error(message)
        parser = getattr(ex, "subcommand_parser", None) or self
        known = [a.dest for a in parser._actions] + list(parser._option_string_actions)
        try:
            line = summarize(message, _root_args(self), known)
        except Exception:  # noqa: BLE001 - never hide the parser's own message behind a bug here
            line = PREFIX + " ".join(message.split())[:500]
        fail(parser, line, message)


@contextlib.contextmanager
def summarized(parser: Any) -> Iterator[None]:
    """Around ``parser.parse_args``: an omegaconf ``${...}`` interpolation error (raised, not reported through
    ``parser.error``) ends in one line too, naming its key and ``--config`` file."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        yield
    except OmegaConfBaseException as err:
        fail(parser, interpolation_summary(err, _root_args(parser)), str(err))


def check_class_paths(parser: Any, config: Any) -> None:
    """Refuse a parsed config whose ``class_path`` names a function (see :func:`function_class_paths`)."""
    for key, path in function_class_paths(config):
        if config.get("subcommand") and key.startswith(f"{config.subcommand}."):
            key = key.split(".", 1)[1]
        fail(parser, PREFIX + function_refusal(key, path, locate(key, _root_args(parser), path)))
