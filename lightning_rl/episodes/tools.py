"""Tools for multi-turn episodes: plain Python functions the model calls in its turns.

A tool is named in YAML by import path (``model.episodes.tools: [package.module:function]``); its schema (the
OpenAI/HF function form that chat templates render) is built from its signature and Google docstring
(:mod:`lightning_rl.episodes.tool_schemas`).
A tool format finds the calls in a model turn (``parse``) and renders their results as the text the
model continues from (``render_results``): ``PlainFormat`` for models without a chat template
(``<tool>NAME(ARGS)</tool>`` then ``<result>CONTENT</result>``), ``HermesFormat`` for Qwen/Hermes chat
templates (``<tool_call>{json}</tool_call>``, results as ``tool`` messages). ``execute`` runs one call
with a timeout and never raises: every failure becomes a ``ToolResult`` with ``error=True``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_rl import moved_hint
from lightning_rl.episodes.tool_schemas import tool_schema

SENTINEL = "LRL_TOOL_SENTINEL_7f3a"  # stands for the model's turn when rendering results through a template


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


# ------------------------------------------------------------------------------------------ formats
class ToolFormat:
    """How tool calls appear in a model turn and how their results are shown to the model."""

    name = "base"

    def parse(self, text: str, tools: Mapping[str, Tool]) -> list[ToolCall | ToolResult]:
        """The calls in ``text``, in order; a call that cannot be parsed is a ``ToolResult`` error."""
        raise NotImplementedError

    def has_call(self, text: str) -> bool:
        """Whether ``text`` holds a (complete) tool call block; ``parse`` returns calls exactly then."""
        raise NotImplementedError

    def render_results(self, results: list[ToolResult], tokenizer: Any) -> str:
        """The text appended after the model's turn (which ended with its EOS token)."""
        raise NotImplementedError


def unparsable(source: str, why: str, name: str = "") -> ToolResult:
    """The error result of a call block that could not be parsed."""
    shown = source if len(source) <= 200 else source[:200] + "..."
    return ToolResult(name=name, content=f"could not parse tool call `{shown}`: {why}", error=True)


def unknown_tool(name: str, tools: Mapping[str, Tool]) -> ToolResult:
    """The error result of a call to a tool that is not configured."""
    return ToolResult(name, f"unknown tool `{name}` (tools: {', '.join(tools) or 'none'})", error=True)


class PlainFormat(ToolFormat):
    """``<tool>NAME(ARGS)</tool>``, ARGS Python literals (positional or keyword); ``<result>...</result>``.

    ARGS are parsed with ``ast`` (never evaluated); positional arguments are mapped to the tool's
    parameters in signature order, so ``parse`` needs the tools.
    """

    name = "plain"
    BLOCK = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)

    def parse(self, text: str, tools: Mapping[str, Tool]) -> list[ToolCall | ToolResult]:
        return [self.parse_one(m.group(1), tools) for m in self.BLOCK.finditer(text)]

    def parse_one(self, source: str, tools: Mapping[str, Tool]) -> ToolCall | ToolResult:
        """One ``NAME(ARGS)`` block."""
        try:
            node = ast.parse(source.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
            return unparsable(source, f"not a Python call ({type(err).__name__})")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            return unparsable(source, "expected NAME(ARGS)")
        name = node.func.id
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return unparsable(source, "`*` and `**` arguments are not allowed", name)
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return unparsable(source, "arguments must be Python literals", name)
        if not args:
            return ToolCall(name, kwargs)
        if name not in tools:
            return unknown_tool(name, tools)
        params = inspect.signature(tools[name].fn).parameters.values()
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(args) > len(names):
            why = f"{name} takes {len(names)} positional argument(s), got {len(args)}"
            return unparsable(source, why, name)
        twice = [n for n in names[:len(args)] if n in kwargs]
        if twice:
            return unparsable(source, f"`{twice[0]}` given both by position and by keyword", name)
        return ToolCall(name, {**dict(zip(names, args, strict=False)), **kwargs})

    def has_call(self, text: str) -> bool:
        return self.BLOCK.search(text) is not None

    def render_results(self, results: list[ToolResult], tokenizer: Any = None) -> str:
        return "".join(f"<result>{'error: ' if r.error else ''}{r.content}</result>" for r in results)


class HermesFormat(ToolFormat):
    """Qwen2.5/Qwen3/Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; results as
    ``tool`` messages rendered by the tokenizer's chat template."""

    name = "hermes"
    BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: Mapping[str, Tool]) -> list[ToolCall | ToolResult]:
        return [self.parse_one(m.group(1)) for m in self.BLOCK.finditer(text)]

    def parse_one(self, source: str) -> ToolCall | ToolResult:
        """One JSON block; ``arguments`` may be an object or a JSON string holding one."""
        try:
            obj = json.loads(source.strip())
        except json.JSONDecodeError as err:
            return unparsable(source, f"invalid JSON ({err.msg} at position {err.pos})")
        except (ValueError, RecursionError) as err:
            return unparsable(source, f"invalid JSON ({type(err).__name__})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return unparsable(source, 'expected {"name": ..., "arguments": {...}}')
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                return unparsable(source, "`arguments` is a string that holds no JSON object", obj["name"])
        if not isinstance(arguments, dict):
            return unparsable(source, "`arguments` must be a JSON object", obj["name"])
        return ToolCall(obj["name"], arguments)

    def has_call(self, text: str) -> bool:
        return self.BLOCK.search(text) is not None

    def render_results(self, results: list[ToolResult], tokenizer: Any) -> str:
        """The results as ``tool`` messages, rendered by the chat template once (:func:`chat_suffix`)."""
        return chat_suffix(tokenizer, [
            {"role": "tool", "name": r.name, "content": f"{'error: ' if r.error else ''}{r.content}"}
            for r in results])


def chat_suffix(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The chat template's text between an assistant turn's EOS and the next generation prompt's end, for
    ``messages`` appended after that turn (tool results, an environment's user turn).

    Renders ``[user, assistant SENTINEL, *messages]`` with the generation prompt and keeps what follows
    ``SENTINEL + eos_token`` (for Qwen: the newline after ``<|im_end|>``, the new turns, and
    ``<|im_start|>assistant\n``). Nothing is cached: each call renders with the tokenizer it is given.

    Raises:
        ValueError: the chat template does not end assistant turns with the EOS token.
    """
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": SENTINEL}]
    full = tokenizer.apply_chat_template(base + list(messages), tokenize=False, add_generation_prompt=True)
    end = f"{SENTINEL}{tokenizer.eos_token}"
    at = full.find(end) if tokenizer.eos_token else -1
    if at < 0:
        raise ValueError(
            f"the chat template does not end assistant turns with the EOS token `{tokenizer.eos_token}`, "
            "so tool results and observations cannot be appended after the model's turn "
            "(`model.episodes.tool_format`)"
        )
    return full[at + len(end):]


def detect_format(tokenizer: Any, chat_template: bool) -> ToolFormat:
    """``HermesFormat`` when ``chat_template`` is on and the template mentions ``tool_call`` or ``tools``."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (`default`, `tool_use`)
        template = "\n".join(str(t) for t in template.values())
    if chat_template and ("tool_call" in template or "tools" in template):
        return HermesFormat()
    return PlainFormat()


def tool_format(name: str, tokenizer: Any, chat_template: bool) -> ToolFormat:
    """The format named by ``model.episodes.tool_format``: ``auto`` (``detect_format``), ``hermes`` or
    ``plain``."""
    if name == "auto":
        return detect_format(tokenizer, chat_template)
    if name == "plain":
        return PlainFormat()
    if name == "hermes":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("`model.episodes.tool_format: hermes` needs a tokenizer with a chat template")
        return HermesFormat()
    raise ValueError(f"`model.episodes.tool_format` must be `auto`, `hermes` or `plain`, got `{name}`")


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
