"""Tools for multi-turn episodes: plain Python functions the model calls in its turns.

A tool is named in YAML by import path (``model.episodes.tools: [package.module:function]``); its schema (the
OpenAI/HF function form that chat templates render) is built from its signature and Google docstring
(:mod:`lightning_rl.episodes.tool_schemas`).
The formats that find the calls in a model turn and render their results are in
:mod:`lightning_rl.episodes.tool_formats`. ``execute_all`` runs a turn's calls at once under one deadline
and never raises: every failure becomes a ``ToolResult`` with ``error=True``.

User tools run in forked worker processes (:mod:`lightning_rl.step.workers`), killed on timeout, so a tool
stuck in C code holding the GIL is stopped and no thread outlives its call; built-in tools that are bounded by
construction (``calculator``) run in-process. Tools that run commands, evaluate code or delete files
(``os:system``, ``subprocess:run``, ``builtins:eval``, ``shutil:rmtree``...: the rule of
:mod:`lightning_rl.step.unsafe`) are refused unless ``model.episodes.allow_unsafe_tools: true``: model-written
code belongs in the sandbox tool ``lightning_rl.sandbox:python``.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_rl import moved_hint, split_import_path
from lightning_rl.episodes.calculator import calculator
from lightning_rl.episodes.tool_schemas import tool_schema
from lightning_rl.sandbox import python as sandbox_python
from lightning_rl.step.rewards import Job, Outcome, run_all
from lightning_rl.step.unsafe import refuse_unsafe
from lightning_rl.step.workers import CallRaised, WorkerDied, describe

MAX_RESULT_CHARS = 1_000_000  # a result is cut to this many characters in the worker, before it is sent
# bounded by construction, no worker hop: the calculator; the sandbox tool (its own child process, limits
# and timeout; a worker killed on `tool_timeout` would leave that child behind)
IN_PROCESS: frozenset[Callable[..., Any]] = frozenset({calculator, sandbox_python})
# what the refusal of an unsafe tool says after naming it (lightning_rl.step.unsafe)
UNSAFE_TOOL = ("a model that calls it does so on the training machine, with the run's permissions. Run "
               "model-written code in the sandbox tool `lightning_rl.sandbox:python`, or set "
               "`model.episodes.allow_unsafe_tools: true` if you mean it")


# ------------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class Tool:
    """A callable the model may call: its name, the function, and the schema chat templates render."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    isolated: bool = True  # run in a worker process (False: in-process, for tools that cannot hang)

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        """The tool for ``fn``, named by ``fn.__name__``, schema by ``tool_schema(fn)``; isolated unless it
        is a built-in bounded tool (``IN_PROCESS``)."""
        schema = tool_schema(fn)
        return cls(name=schema["function"]["name"], fn=fn, schema=schema, isolated=fn not in IN_PROCESS)


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
    timed_out: bool = False  # the call did not come back within the timeout (its worker was killed)


def load_tools(paths: Sequence[str], allow_unsafe: bool = False) -> list[Tool]:
    """Import the tools named ``package.module:function`` (``package.module.function`` also accepted).

    An attribute that already is a ``Tool`` is used as is.

    Raises:
        ValueError: naming ``model.episodes.tools`` and the entry: bad format, module or attribute not found,
            not callable, no schema can be built, two tools with the same name, or a tool that runs commands,
            evaluates code or deletes files (unless ``allow_unsafe``).
    """
    tools: dict[str, Tool] = {}
    for path in paths:
        where = f"`model.episodes.tools` entry `{path}`"
        obj = import_tool(str(path), where)
        if not allow_unsafe:
            refuse_unsafe(obj.fn if isinstance(obj, Tool) else obj, where, UNSAFE_TOOL)
        try:
            tool = obj if isinstance(obj, Tool) else Tool.from_function(obj)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        if tool.name in tools:
            raise ValueError(f"{where}: a tool named `{tool.name}` is already listed")
        tools[tool.name] = tool
    return list(tools.values())


def import_tool(path: str, where: str) -> Any:
    """The callable (or ``Tool``) that ``path`` names; ``ValueError`` naming ``where`` otherwise."""
    module_name, attr = split_import_path(path)
    if not module_name or not attr:
        raise ValueError(f"{where} must look like `package.module:function`")
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
    return obj


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
    """Run one call, waiting at most ``timeout`` seconds; never raises: :func:`execute_all` of one call."""
    return execute_all(tools, [call], timeout)[0]


def execute_all(tools: Mapping[str, Tool], calls: Sequence[ToolCall | ToolResult],
                timeout: float) -> list[ToolResult]:
    """Run a turn's calls at once, all within one deadline ``timeout`` seconds away; results in call order;
    never raises.

    Isolated tools each run in a worker process (``lightning_rl.step.worker_pool.WORKERS``), all sent before
    any is waited for (:func:`lightning_rl.step.rewards.run_all`), so a turn whose calls all hang costs one
    ``timeout``, not one per call; a call not back by the deadline has its worker killed (the next call gets
    a new one) and answers ``timed_out=True``. Tools that are not isolated (``calculator``, the sandbox tool:
    bounded by their own limits) run in this thread, in order, while the workers run. An unknown tool,
    arguments that do not bind to the signature, an exception in the tool, a tool that ends its worker, or a
    timeout give ``ToolResult(error=True)`` with a short message naming the tool. A ``ToolResult`` (a call
    that could not be parsed) is returned as is. Results longer than ``MAX_RESULT_CHARS`` are cut.
    """
    prepared = [prepare(tools, call) for call in calls]
    jobs = [p for p in prepared if isinstance(p, Job)]
    outcomes = iter(run_all(jobs, timeout))
    return [p if isinstance(p, ToolResult) else outcome_result(call.name, p, next(outcomes), timeout)
            for call, p in zip(calls, prepared, strict=True)]


def prepare(tools: Mapping[str, Tool], call: ToolCall | ToolResult) -> ToolResult | Job:
    """The job that runs ``call`` (in a worker when its tool is isolated, else in this thread), or the
    error result of a call that cannot run (unparsed, unknown tool, arguments that do not bind)."""
    if isinstance(call, ToolResult):
        return call
    tool = tools.get(call.name)
    if tool is None:
        return unknown_tool(call.name, tools)
    try:
        bound = bind(tool, call.arguments)
    except TypeError as err:
        return ToolResult(call.name, f"bad arguments for {call.name}: {err}", error=True)
    return Job(tool.fn, bound.kwargs, "process" if tool.isolated else "inline", result_text, bound.args)


def outcome_result(name: str, job: Job, outcome: Outcome, timeout: float) -> ToolResult:
    """The result the model reads for one call's outcome."""
    if outcome.timed_out:
        return ToolResult(name, f"{name} timed out after {float(timeout)} s", error=True, timed_out=True)
    err = outcome.error
    if err is None:
        return as_result(name, outcome.value)
    if isinstance(err, WorkerDied):  # e.g. the tool called os._exit, or was killed by the OOM killer
        return ToolResult(name, f"{name} {err}", error=True)
    if isinstance(err, CallRaised) or job.where == "inline":
        return ToolResult(name, f"{name} raised {describe(err)}", error=True)
    return ToolResult(name, f"{name} could not be called: {describe(err)}", error=True)  # unpicklable args


def result_text(value: Any) -> tuple[bool, str]:
    """``(True, text)``: the value as text (``as_text``), cut to ``MAX_RESULT_CHARS``; ``(False, type name)``
    when it cannot be printed. Runs where the tool ran, so only the text is sent back."""
    try:
        text = as_text(value)
    except Exception as err:  # noqa: BLE001 - a __str__ that raises
        return False, type(err).__name__
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"... [{len(text) - MAX_RESULT_CHARS} more characters cut]"
    return True, text


def as_result(name: str, text: tuple[bool, str]) -> ToolResult:
    ok, content = text
    if ok:
        return ToolResult(name, content, error=False)
    return ToolResult(name, f"{name} returned an unprintable value ({content})", error=True)


