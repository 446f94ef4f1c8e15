"""Tool schemas: the OpenAI/HF function form that chat templates render, built from a Python function's
signature and Google docstring (:func:`tool_schema`). Used by :mod:`lightning_rl.episodes.tools`.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
              tuple: "array", dict: "object"}
ARG_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")  # `name: text` or `name (type): text`


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI/HF function schema of ``fn``, from its signature and Google docstring.

    Type hints map str/int/float/bool/list/dict to string/integer/number/boolean/array/object
    (``list[X]`` adds ``items``, ``Literal[...]`` an ``enum``, ``Any`` no type); a parameter without a
    hint is a string. A parameter with a default or an ``Optional`` hint is not required. The description
    is the docstring's first paragraph; parameter descriptions come from its ``Args:`` section.

    Raises:
        ValueError: ``fn`` has no identifier name, takes ``*args``/``**kwargs``, or has a hint with no
            JSON type (a union other than ``Optional``, a class).
    """
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"tool {fn!r} needs a function name that is a Python identifier")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as err:  # an unresolvable forward reference, ...
        raise ValueError(f"tool `{name}`: cannot resolve its type hints: {err}") from err
    description, docs = parse_docstring(inspect.getdoc(fn) or "")
    properties: dict[str, Any] = {}
    required = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            star = "*" if p.kind is p.VAR_POSITIONAL else "**"
            raise ValueError(f"tool `{name}` takes `{star}{p.name}`: a tool's parameters must all be named")
        prop, optional = json_type(hints.get(p.name, str), f"tool `{name}` parameter `{p.name}`")
        if p.name in docs:
            prop["description"] = docs[p.name]
        properties[p.name] = prop
        if p.default is p.empty and not optional:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


def json_type(hint: Any, where: str) -> tuple[dict[str, Any], bool]:
    """The JSON schema of one type hint, and whether the hint is ``Optional``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(rest) < len(args):
            return json_type(rest[0], where)[0], True
        raise ValueError(f"{where}: the union `{hint}` has no single JSON type; use one type or Optional[X]")
    if hint is Any:
        return {}, False
    if origin is typing.Literal:
        return {"type": JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}, False
    if origin is list and args:
        return {"type": "array", "items": json_type(args[0], where)[0]}, False
    if (origin or hint) in JSON_TYPES:
        return {"type": JSON_TYPES[origin or hint]}, False
    raise ValueError(f"{where}: the type hint `{hint}` maps to no JSON type (str int float bool list dict)")


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """A Google docstring's first paragraph (joined into one line) and its ``Args:`` descriptions."""
    lines = doc.splitlines()
    summary = []
    for line in lines:
        if not line.strip() or line.strip() in ("Args:", "Arguments:"):
            break
        summary.append(line.strip())
    params: dict[str, str] = {}
    start = next((i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:")), None)
    if start is None:
        return " ".join(summary), params
    indent = lambda line: len(line) - len(line.lstrip())  # noqa: E731
    entry_indent, current = None, None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        if indent(line) <= indent(lines[start]):  # the next section (`Returns:`, ...)
            break
        entry_indent = indent(line) if entry_indent is None else entry_indent
        match = ARG_ENTRY.match(line.strip())
        if match and indent(line) <= entry_indent:
            current = match.group(1)
            params[current] = match.group(2).strip()
        elif current is not None:  # a continuation line
            params[current] = f"{params[current]} {line.strip()}".strip()
    return " ".join(summary), params
