"""Tool-call formats for multi-turn episodes: how a model turn's tool calls are found (``parse``) and how
their results are rendered as the text the model continues from (``render_results``).

``PlainFormat`` for models without a chat template (``<tool>NAME(ARGS)</tool>`` then
``<result>CONTENT</result>``), ``HermesFormat`` for Qwen/Hermes chat templates
(``<tool_call>{json}</tool_call>``, results as ``tool`` messages); ``tool_format`` picks the one
``model.episodes.tool_format`` names, ``detect_format`` the one a tokenizer's chat template suits. The tools
themselves, their records and their execution are in :mod:`lightning_rl.episodes.tools`.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
from collections.abc import Mapping
from typing import Any

from lightning_rl.episodes.tools import Tool, ToolCall, ToolResult, unknown_tool

SENTINEL = "LRL_TOOL_SENTINEL_7f3a"  # stands for the model's turn when rendering results through a template


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
