"""jsonargparse's error report, read into fields.

jsonargparse answers a wrong key, type, choice or ``class_path`` with a nested report whose last lines are
``Given value: ...``; the sentence that matters sits in the middle. :func:`parse_message` reads that report
(the text jsonargparse puts in ``parser.error(message)``) into a :class:`Problem`, which
:mod:`lightning_rl.cli.config_errors` writes as one line.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
              "NoneType": "null", "dict": "a mapping", "list": "a list"}
NOISE = re.compile(r"(Does not validate against any of the Union subtypes|Subtypes: |Errors:"
                   r"|Given value type: |Expected a <class 'NoneType'>$"
                   r"|Expected a path but .* either not accessible or invalid$"
                   r"|Subclass types expect one of:|a class path \(str\)$|a dict with|a dict without"
                   r"|Not a valid subclass of )")
IMPORT_PROBLEM = re.compile(r"(module '.*' has no attribute|No module named|Import path"
                            r"|does not correspond to a subclass|Expected '.*' to be a"
                            r"|Unexpected import object|Expected a dot import path)")
NAMED_PATH = re.compile(r"(?:Import path (?!does )|Expected a dot import path string: |Expected ')([\w.:]+)")


@dataclass
class Problem:
    """What a jsonargparse error message says, as fields.

    ``kind``: ``unknown_key``, ``type`` (a wrong type, or a value outside a ``Literal``), ``class_path``,
    ``unrecognized``, ``subcommand``, ``required``, ``yaml``, ``not_mapping`` or ``other``. ``key``: the full
    dotted key (``model.init_args.num_generations``); ``value``: the value given; ``cls``: the class whose
    argument ``key`` is; ``base``: the class a ``class_path`` must subclass; ``expected``: the accepted
    types, as words; ``choices``: the values of a ``Literal`` (or the missing keys, or the subcommands).
    """

    kind: str
    key: str = ""
    value: str | None = None
    detail: str = ""
    cls: str | None = None
    base: str | None = None
    expected: list[str] = field(default_factory=list)
    choices: list[Any] = field(default_factory=list)


def _item(line: str) -> str:
    text = line.strip()
    return text[2:].strip() if text.startswith("- ") else text


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" -"))


def _expected(text: str) -> tuple[list[str], list[Any]]:
    """Types (as words) and Literal choices of one ``Expected a ...`` item."""
    literal = re.match(r"typing\.Literal\[(.*)\]$", text)
    if literal:
        try:
            return [], list(ast.literal_eval(f"({literal[1]},)"))
        except (ValueError, SyntaxError):
            return [text], []
    cls = re.match(r"<class '([\w.]+)'>$", text)
    name = cls[1].rsplit(".", 1)[-1] if cls else text
    return [TYPE_WORDS.get(name, name)], []


def _one_line_problem(first: str) -> Problem | None:
    """The problem of a message that says it in its opening line (``first``, the stripped message): an
    unrecognized argument, a wrong subcommand, a YAML or mapping error, a missing key; else ``None``."""
    if m := re.match(r"unrecognized arguments: (.*)", first, re.S):
        return Problem("unrecognized", value=m[1].strip())
    if m := re.match(r"Subcommand '(\w+)' does not accept option '([^']+)'", first):
        return Problem("unknown_key", key=m[2])
    if m := re.match(r"argument subcommand: invalid choice: '([^']*)' \(choose from (.*)\)", first):
        return Problem("subcommand", value=m[1], choices=re.findall(r"'([^']*)'", m[2]))
    if m := re.match(r'expected "subcommand" to be one of \{(.*)\}', first):
        return Problem("subcommand", choices=m[1].split(","))
    if first.startswith("Problems parsing config:") or "<unicode string>" in first:
        return Problem("yaml", detail=first.removeprefix("Problems parsing config:").strip())
    if first.startswith("Unexpected config:"):
        return Problem("not_mapping", detail=first.splitlines()[0])
    if m := re.match(r"the following arguments are required: (.*)", first):
        return Problem("required", choices=[k.strip().split(".", 1)[-1] for k in m[1].split(",")])
    return None


def parse_message(message: str) -> Problem:
    """Read a jsonargparse error message (the text of ``parser.error(message)``) into a :class:`Problem`."""
    first = message.strip()
    if (problem := _one_line_problem(first)) is not None:
        return problem
    lines = message.splitlines()
    path: list[str] = []
    cls = base = None  # the class whose arguments follow; the class a class_path must subclass
    in_class = False
    for i, raw in enumerate(lines):
        text = _item(raw)
        if m := re.match(r"Subtypes: \[[^\]]*?([\w.]+\.[A-Z]\w*)", text):
            base = m[1]
        if not text or NOISE.match(text) or text.startswith("Given value:"):
            continue
        while True:  # the structure a line opens: a key, a class's arguments, a callable class's arguments
            if m := re.match(r'Parser key "([^"]+)":\s*(.*)$', text):
                path += (["init_args"] if in_class else []) + m[1].split(".")
                in_class, text = False, m[2]
            elif m := re.match(r"Problem with given class_path '([^']+)':\s*(.*)$", text):
                cls, in_class, text = m[1], True, m[2]
            elif m := re.match(r"Type (.*) expects a function or a callable class:\s*(.*)$", text):
                got = re.search(r"Got value: Namespace\(class_path='([^']+)'", "\n".join(lines[i:]))
                returns = re.search(r"([\w.]+)\]$", m[1])
                cls, in_class, text = (got[1] if got else None), True, m[2]
                base = returns[1] if returns else base
            else:
                break
        if text and not NOISE.match(text):
            return _leaf(text, lines, i, path, cls if in_class else None, base)
    return Problem("other", key=".".join(path), value=_given_value(lines, 0), detail=first.splitlines()[0])


def _given_value(lines: Sequence[str], start: int) -> str | None:
    for raw in lines[start:]:
        if (text := _item(raw)).startswith("Given value: "):
            return text.removeprefix("Given value: ").split(". Got value: ")[0]
    return None


def _leaf(
    text: str, lines: Sequence[str], i: int, path: list[str], cls: str | None, base: str | None
) -> Problem:
    """The problem named by a message's first non-structural line (``lines[i]``, from ``text``) under the key
    ``path``; ``cls`` is the class whose arguments the line is about (None outside one)."""
    text, _, got = text.partition(". Got value: ")
    text = text.rstrip(".")
    inner = (["init_args"] if cls else [])
    if m := re.match(r"Option '([^']+)' is not accepted", text):
        return Problem("unknown_key", key=".".join(path + inner + [m[1]]), cls=cls)
    if m := re.match(r"Group '([^']+)' does not accept option '([^']+)'", text):  # a key inside a group
        return Problem("unknown_key", key=".".join(path + inner + m[1].split(".") + [m[2]]), cls=cls)
    if cls and (m := re.match(r"unrecognized arguments: --([\w.]+)", text)):  # the same, on the command line
        return Problem("unknown_key", key=".".join(path + inner + m[1].split(".")), cls=cls)
    if text.startswith("Expected a ") and not IMPORT_PROBLEM.match(text):
        items = [text]  # a union's items: every "- Expected a ..." beside the first
        for raw in lines[i + 1:]:
            if _indent(raw) < _indent(lines[i]) or not _item(raw).startswith("Expected a "):
                break
            items.append(_item(raw))
        expected, choices = [], []
        for item in items:
            if not IMPORT_PROBLEM.match(item):
                words, values = _expected(item.removeprefix("Expected a ").split(". Got value: ")[0])
                expected += words
                choices += values
        if [w for w in expected if w != "null"] or choices:
            value = got if got and len(items) == 1 else _given_value(lines, i)
            return Problem("type", key=".".join(path), value=value, expected=expected, choices=choices)
        text = next(item for item in items if IMPORT_PROBLEM.match(item))
    if IMPORT_PROBLEM.match(text):
        value = cls
        named = NAMED_PATH.match(text)
        value = named[1] if named else value
        if subclass := re.search(r"subclass of <?(?:class ')?([\w.]+)", text):
            base = base if base and base.rsplit(".", 1)[-1] == subclass[1] else subclass[1]
        value = value or _given_value(lines, i)
        return Problem("class_path", key=".".join(path + ["class_path"]), value=value, detail=text, base=base)
    return Problem("other", key=".".join(path), detail=text, cls=cls)
