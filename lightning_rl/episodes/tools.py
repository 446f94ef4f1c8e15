"""Tools for multi-turn episodes: plain Python functions the model calls in its turns.

A tool is named in YAML by import path (``model.episodes.tools: [package.module:function]``); its schema (the
OpenAI/HF function form that chat templates render) is built from its signature and Google docstring
(:mod:`lightning_rl.episodes.tool_schemas`).
The formats that find the calls in a model turn and render their results are in
:mod:`lightning_rl.episodes.tool_formats`. ``execute`` runs one call with a timeout and never raises: every
failure becomes a ``ToolResult`` with ``error=True``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_rl import moved_hint
from lightning_rl.episodes.tool_schemas import tool_schema


# ------------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class Tool:
    """A callable the model may call: its name, the function, and the schema chat templates render."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        """The tool for ``fn``, named by ``fn.__name__``, schema by ``tool_schema(fn)``."""
        schema = tool_schema(fn)
        return cls(name=schema["function"]["name"], fn=fn, schema=schema)


@dataclass(frozen=True)
class ToolCall:
    """One call found in a model turn: the tool's name and its arguments by parameter name."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: the text shown to the model, and whether it is an error message.

    An error's ``content`` is the bare message (``calculator timed out after 2.0 s``); the formats show
    it to the model prefixed with ``error: ``.
    """

    name: str
    content: str
    error: bool = False


def load_tools(paths: list[str]) -> list[Tool]:
    """Import the tools named ``package.module:function`` (``package.module.function`` also accepted).

    An attribute that already is a ``Tool`` is used as is.

    Raises:
        ValueError: naming ``model.episodes.tools`` and the entry: bad format, module or attribute not found,
            not callable, no schema can be built, or two tools with the same name.
    """
    tools: dict[str, Tool] = {}
    for path in paths:
        module_name, sep, attr = str(path).partition(":")
        if not sep:
            module_name, _, attr = str(path).rpartition(".")
        if not module_name or not attr:
            raise ValueError(f"`model.episodes.tools` entry `{path}` must look like "
                             "`package.module:function`")
        where = f"`model.episodes.tools` entry `{path}`"
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"{where}: cannot import module `{module_name}`: {err}{moved_hint(module_name)}"
                             ) from err
        if not hasattr(module, attr):
            raise ValueError(f"{where}: module `{module_name}` has no attribute `{attr}`")
        obj = getattr(module, attr)
        if not isinstance(obj, Tool) and not callable(obj):
            raise ValueError(f"{where} is not callable")
        try:
            tool = obj if isinstance(obj, Tool) else Tool.from_function(obj)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        if tool.name in tools:
            raise ValueError(f"{where}: a tool named `{tool.name}` is already listed")
        tools[tool.name] = tool
    return list(tools.values())


def unknown_tool(name: str, tools: Mapping[str, Tool]) -> ToolResult:
    """The error result of a call to a tool that is not configured."""
    return ToolResult(name, f"unknown tool `{name}` (tools: {', '.join(tools) or 'none'})", error=True)


# ---------------------------------------------------------------------------------------- execution
def bind(tool: Tool, arguments: Mapping[str, Any]) -> inspect.BoundArguments:
    """``arguments`` bound to the tool's signature.

    A parameter the schema leaves optional without a default in the function (an ``Optional`` hint)
    gets ``None`` when the call omits it, so the schema tells the model the truth.

    Raises:
        TypeError: the arguments do not fit the signature.
    """
    sig = inspect.signature(tool.fn)
    params = tool.schema["function"]["parameters"]
    optional = set(params["properties"]) - set(params["required"])
    args, kwargs = [], dict(arguments)
    for i, p in enumerate(sig.parameters.values()):
        if p.name not in kwargs and p.default is p.empty and p.name in optional:
            kwargs[p.name] = None
        if p.kind is p.POSITIONAL_ONLY and p.name in kwargs and len(args) == i:  # `fn(x, /)`: by position
            args.append(kwargs.pop(p.name))
    return sig.bind(*args, **kwargs)


def as_text(value: Any) -> str:
    """A tool's return value as the text shown to the model: JSON for dicts and lists, else ``str``."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str)
    return str(value)


def execute(tools: Mapping[str, Tool], call: ToolCall | ToolResult, timeout: float) -> ToolResult:
    """Run one call in a worker thread, waiting at most ``timeout`` seconds; never raises.

    An unknown tool, arguments that do not bind to the signature, an exception in the tool, or a timeout
    give ``ToolResult(error=True)`` with a short message naming the tool. A ``ToolResult`` (a call that
    could not be parsed) is returned as is. A timed-out call cannot be killed: its thread keeps running
    in the background (a daemon thread, so it does not block the interpreter's exit).
    """
    if isinstance(call, ToolResult):
        return call
    tool = tools.get(call.name)
    if tool is None:
        return unknown_tool(call.name, tools)
    try:
        bound = bind(tool, call.arguments)
    except TypeError as err:
        return ToolResult(call.name, f"bad arguments for {call.name}: {err}", error=True)
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = tool.fn(*bound.args, **bound.kwargs)
        except BaseException as err:  # noqa: B036 -- a tool's SystemExit must not pass silently either
            outcome["error"] = err

    thread = threading.Thread(target=work, name=f"tool-{call.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return ToolResult(call.name, f"{call.name} timed out after {float(timeout)} s", error=True)
    if "error" in outcome:
        err = outcome["error"]
        message = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        return ToolResult(call.name, f"{call.name} raised {message}", error=True)
    try:
        return ToolResult(call.name, as_text(outcome.get("value")), error=False)
    except Exception as err:  # a __str__ that raises
        message = f"{call.name} returned an unprintable value ({type(err).__name__})"
        return ToolResult(call.name, message, error=True)


from lightning_rl.episodes.calculator import calculator as calculator  # noqa: E402  (`lightning_rl.episodes.tools:calculator`)
