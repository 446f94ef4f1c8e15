"""Tests for lightning_rl.episodes.tools: schemas from signatures and docstrings, loading tools by import
path, the
plain and Hermes call formats, execution with a timeout, and the built-in calculator."""

from __future__ import annotations

import glob
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal, Optional

import pytest

from lightning_rl.episodes.environments import Episode
from lightning_rl.episodes.runner import EpisodeRunner
from lightning_rl.episodes.tool_formats import HermesFormat, PlainFormat, detect_format, tool_format
from lightning_rl.episodes.tool_schemas import tool_schema
from lightning_rl.episodes.tools import (
    MAX_RESULT_CHARS,
    Tool,
    ToolCall,
    ToolResult,
    calculator,
    execute,
    execute_all,
    load_tools,
)
from lightning_rl.models.builtin import build_char_tokenizer
from lightning_rl.step.worker_pool import WORKERS
from lightning_rl.text.prompts import render_prompts

# A Qwen-like template for the char tokenizer (EOS `<eos>`): assistant turns end with `<eos>\n`, tool
# messages are `<tool_response>` blocks inside one user turn, tools are listed in a system turn.
QWENLIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool.function.name + ': ' + tool.function.description + '\\n' }}"
    "{%- endfor %}"
    "{{- '<eos>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<eos>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<eos>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwenlike_tokenizer(template: str = QWENLIKE):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


# ---------------------------------------------------------------------------------- tools for tests
def search(query: str, limit: int = 5, tags: list[str] | None = None, exact: bool = False) -> list:
    """Search the notes.

    Longer text after the first paragraph is not in the description.

    Args:
        query: What to look for,
            over several lines.
        limit (int): How many results.
        tags (list[str], optional): Only notes with these tags.

    Returns:
        The matching notes.
    """
    return [query] * limit


def scale(x: float, unit: Literal["m", "km"], factor, table: dict, note: Optional[str]) -> dict:  # noqa: UP045
    """Scale a length."""
    return {"x": x, "unit": unit, "factor": factor, "note": note}


def sleepy(seconds: float) -> str:
    time.sleep(seconds)
    return "awake"


def boom() -> str:
    raise RuntimeError("no luck")


def backtrack(text: str) -> bool:
    """Catastrophic backtracking: minutes of C code holding the GIL on `a` * 64 + `b`."""
    return re.search("(a+)+$", text) is not None


def leave() -> str:
    os._exit(3)


def flood() -> str:
    return "x" * (MAX_RESULT_CHARS + 10)


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def unprintable() -> Unprintable:
    return Unprintable()


TOOLS = {t.name: t for t in map(Tool.from_function, [calculator, search, scale, sleepy, boom, math.sqrt,
                                                      backtrack, leave, flood, unprintable])}


# ------------------------------------------------------------------------------------------ schemas
def test_schema_from_signature_and_google_docstring():
    assert tool_schema(search) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for, over several lines."},
                    "limit": {"type": "integer", "description": "How many results."},
                    "tags": {"type": "array", "items": {"type": "string"},
                             "description": "Only notes with these tags."},
                    "exact": {"type": "boolean"},
                },
                "required": ["query"],
            },
        },
    }


def test_schema_types_optional_and_unhinted_parameters():
    params = tool_schema(scale)["function"]["parameters"]
    assert params == {
        "type": "object",
        "properties": {
            "x": {"type": "number"},
            "unit": {"type": "string", "enum": ["m", "km"]},
            "factor": {"type": "string"},  # no hint: a string
            "table": {"type": "object"},
            "note": {"type": "string"},
        },
        "required": ["x", "unit", "factor", "table"],  # Optional without a default: not required
    }


def test_calculator_schema():
    assert tool_schema(calculator)["function"] == {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {
                "type": "string",
                "description": "Numbers combined with + - * / // % ** and parentheses, for example "
                               "`37*482` or `(2 + 3) / 4`."}},
            "required": ["expression"],
        },
    }


def test_schema_refuses_star_args_and_untyped_unions():
    def many(*values: int) -> int:
        return sum(values)

    def options(**kw: str) -> str:
        return ""

    def either(x: int | str) -> str:
        return ""

    with pytest.raises(ValueError, match=r"tool `many` takes `\*values`: a tool's parameters must all be"):
        tool_schema(many)
    with pytest.raises(ValueError, match=r"tool `options` takes `\*\*kw`"):
        tool_schema(options)
    with pytest.raises(ValueError, match=r"tool `either` parameter `x`: the union"):
        tool_schema(either)
    with pytest.raises(ValueError, match="needs a function name"):
        tool_schema(lambda x: x)


# -------------------------------------------------------------------------------------- load_tools
def test_load_tools_by_colon_or_dot_path():
    tools = load_tools(["lightning_rl.episodes.tools:calculator", "math.sqrt"])
    assert [t.name for t in tools] == ["calculator", "sqrt"]
    assert tools[0].fn is calculator and tools[0].schema == tool_schema(calculator)


@pytest.mark.parametrize("entry, message", [
    ("calculator", "must look like `package.module:function`"),
    ("lightning_rl.episodes.tools:", "must look like `package.module:function`"),
    ("no_such_module_xyz:f", "cannot import module `no_such_module_xyz`"),
    ("lightning_rl.calculator:calculator", r"\(it moved to `lightning_rl.episodes.calculator`\)"),
    ("lightning_rl.episodes.tools:nope", "module `lightning_rl.episodes.tools` has no attribute `nope`"),
    ("lightning_rl.text.keys:VAL_WEIGHT_KEY", "is not callable"),
    ("os.path:join", r"tool `join` takes `\*"),
])
def test_load_tools_errors_name_the_key_and_entry(entry, message):
    with pytest.raises(ValueError, match=rf"`model.episodes.tools` entry `{entry}`.*{message}"):
        load_tools([entry])


def test_load_tools_refuses_duplicate_names():
    with pytest.raises(ValueError, match=r"`model.episodes.tools` entry "
                                         r"`lightning_rl.episodes.tools.calculator`: "
                                         r"a tool named `calculator` is already listed"):
        load_tools(["lightning_rl.episodes.tools:calculator", "lightning_rl.episodes.tools.calculator"])


@pytest.mark.parametrize("entry, name, does", [
    ("os:system", "os.system", "runs commands"), ("posix:system", "os.system", "runs commands"),
    ("os.popen", "os.popen", "runs commands"), ("os:execv", "os.execv", "runs commands"),
    ("subprocess:run", "subprocess.run", "runs commands"),
    ("subprocess:check_output", "subprocess.check_output", "runs commands"),
    ("builtins:eval", "builtins.eval", "evaluates code"),
    ("builtins:exec", "builtins.exec", "evaluates code"),
    ("io:open", "builtins.open", "writes files"), ("shutil:rmtree", "shutil.rmtree", "deletes files"),
    ("os:remove", "os.remove", "deletes files"), ("pty:spawn", "pty.spawn", "runs commands"),
])
def test_unsafe_tools_are_refused_unless_allowed(entry, name, does):
    with pytest.raises(ValueError, match=rf"`model.episodes.tools` entry `{entry}` is `{name}`, which "
                                         rf"{does}.*`lightning_rl.sandbox:python`.*"
                                         r"`model.episodes.allow_unsafe_tools"):
        load_tools([entry])


def test_unsafe_tools_load_when_allowed_and_lookalikes_are_not_refused():
    (system,) = load_tools(["os:system"], allow_unsafe=True)
    assert system.fn is os.system and system.isolated
    assert [t.name for t in load_tools(["shutil:which", "os.path:basename"])] == ["which", "basename"]


# ------------------------------------------------------------------------------------- plain format
def test_plain_parse_calls_in_order_positional_and_keyword():
    text = ('I will compute. <tool>calculator("37*482")</tool> and <tool> search("x", 2, exact=True) </tool>'
            "<tool>search(query='y', tags=['a', 'b'])</tool><tool>boom()</tool>")
    fmt = PlainFormat()
    assert fmt.has_call(text)
    assert fmt.parse(text, TOOLS) == [
        ToolCall("calculator", {"expression": "37*482"}),
        ToolCall("search", {"query": "x", "limit": 2, "exact": True}),
        ToolCall("search", {"query": "y", "tags": ["a", "b"]}),
        ToolCall("boom", {}),
    ]


@pytest.mark.parametrize("block, name, why", [
    ("calculator(", "", r"not a Python call \(SyntaxError\)"),
    ("calculator", "", r"expected NAME\(ARGS\)"),
    ("os.system('ls')", "", r"expected NAME\(ARGS\)"),
    ("calculator(__import__('os'))", "calculator", "arguments must be Python literals"),
    ("calculator(*xs)", "calculator", r"`\*` and `\*\*` arguments are not allowed"),
    ('calculator("1", "2")', "calculator", r"calculator takes 1 positional argument\(s\), got 2"),
    ('calculator("1", expression="2")', "calculator", "`expression` given both by position and by keyword"),
])
def test_plain_parse_malformed_calls_become_error_results(block, name, why):
    (result,) = PlainFormat().parse(f"<tool>{block}</tool>", TOOLS)
    assert isinstance(result, ToolResult) and result.error and result.name == name
    assert result.content.startswith(f"could not parse tool call `{block}`: ")
    assert re.search(why, result.content)


def test_plain_unknown_tool_and_no_call():
    fmt = PlainFormat()
    (unknown,) = fmt.parse("<tool>nope(1)</tool>", TOOLS)  # positional arguments: the tool must be known
    assert unknown.error and unknown.content.startswith("unknown tool `nope` (tools: calculator, search")
    assert fmt.parse("<tool>nope(x=1)</tool>", TOOLS) == [ToolCall("nope", {"x": 1})]  # execute reports it
    for text in ("17834", "<tool>calculator('1')", "<result>1</result>"):
        assert not fmt.has_call(text) and fmt.parse(text, TOOLS) == []


def test_plain_render_results_concatenated_without_newlines():
    results = [ToolResult("calculator", "17834"), ToolResult("calculator", "calculator raised X", error=True)]
    assert PlainFormat().render_results(results, None) == (
        "<result>17834</result><result>error: calculator raised X</result>")


# ------------------------------------------------------------------------------------ hermes format
def test_hermes_parse_json_calls():
    text = ('<think>ok</think>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n'
            '</tool_call>\n<tool_call>{"name": "search", '
            '"arguments": "{\\"query\\": \\"q\\", \\"limit\\": 1}"}</tool_call>'
            '<tool_call>{"name": "boom"}</tool_call>')
    fmt = HermesFormat()
    assert fmt.has_call(text)
    assert fmt.parse(text, TOOLS) == [
        ToolCall("calculator", {"expression": "2+2"}),
        ToolCall("search", {"query": "q", "limit": 1}),
        ToolCall("boom", {}),
    ]


@pytest.mark.parametrize("body, name, why", [
    ('{"name": "calculator", "arguments": {"expression": "1"}', "", "invalid JSON"),
    ("calculator(1)", "", "invalid JSON"),
    ('["calculator"]', "", 'expected {"name": ..., "arguments": {...}}'),
    ('{"arguments": {}}', "", 'expected {"name": ..., "arguments": {...}}'),
    ('{"name": "calculator", "arguments": [1]}', "calculator", "`arguments` must be a JSON object"),
    ('{"name": "calculator", "arguments": "1+1"}', "calculator", "`arguments` is a string that holds"),
])
def test_hermes_parse_malformed_json(body, name, why):
    (result,) = HermesFormat().parse(f"<tool_call>{body}</tool_call>", TOOLS)
    assert isinstance(result, ToolResult) and result.error and result.name == name
    assert result.content.startswith("could not parse tool call `") and why in result.content


def test_hermes_render_results_is_the_template_delta_after_eos():
    tok = qwenlike_tokenizer()
    results = [
        ToolResult("calculator", "17834"),
        ToolResult("boom", "boom raised RuntimeError: no luck", True),
    ]
    assert HermesFormat().render_results(results, tok) == (
        "\n<|im_start|>user\n<tool_response>\n17834\n</tool_response>"
        "\n<tool_response>\nerror: boom raised RuntimeError: no luck\n</tool_response><eos>\n"
        "<|im_start|>assistant\n"
    )
    # each call renders with the tokenizer it is given (nothing cached across tokenizers)
    other = qwenlike_tokenizer(QWENLIKE.replace("tool_response>", "obs>"))
    assert HermesFormat().render_results(results[:1], other) == (
        "\n<|im_start|>user\n<obs>\n17834\n</obs><eos>\n<|im_start|>assistant\n")


def test_hermes_render_refuses_a_template_whose_turns_do_not_end_with_eos():
    tok = qwenlike_tokenizer(QWENLIKE.replace("<eos>", "<|im_end|>"))
    with pytest.raises(ValueError, match="does not end assistant turns with the EOS token `<eos>`"):
        HermesFormat().render_results([ToolResult("calculator", "1")], tok)


def test_detect_and_name_the_format():
    plain_tok, chat_tok = build_char_tokenizer(), qwenlike_tokenizer()
    assert isinstance(detect_format(plain_tok, chat_template=False), PlainFormat)
    assert isinstance(detect_format(chat_tok, chat_template=True), HermesFormat)
    assert isinstance(detect_format(chat_tok, chat_template=False), PlainFormat)
    no_tools = qwenlike_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert isinstance(detect_format(no_tools, chat_template=True), PlainFormat)
    assert isinstance(tool_format("auto", chat_tok, True), HermesFormat)
    assert isinstance(tool_format("plain", chat_tok, True), PlainFormat)
    assert isinstance(tool_format("hermes", chat_tok, False), HermesFormat)
    with pytest.raises(ValueError,
                       match="`model.episodes.tool_format: hermes` needs a tokenizer with a chat"):
        tool_format("hermes", plain_tok, False)
    with pytest.raises(ValueError,
                       match="`model.episodes.tool_format` must be `auto`, `hermes` or `plain`, got"):
        tool_format("json", chat_tok, True)


def test_render_prompts_passes_tool_schemas_to_the_template():
    tok = qwenlike_tokenizer()
    schemas = [TOOLS["calculator"].schema, TOOLS["search"].schema]
    assert render_prompts(tok, ["37*482="], chat_template=True, tools=schemas) == [
        "<|im_start|>system\n# Tools\ncalculator: Evaluate an arithmetic expression.\n"
        "search: Search the notes.\n<eos>\n<|im_start|>user\n37*482=<eos>\n<|im_start|>assistant\n"]
    assert render_prompts(tok, ["37*482="], chat_template=True) == ["<|im_start|>user\n37*482=<eos>\n"
                                                                    "<|im_start|>assistant\n"]
    assert render_prompts(tok, ["37*482="], chat_template=False, tools=schemas) == ["37*482="]

    class Recorder:
        chat_template = "t"

        def apply_chat_template(self, messages, **kwargs):
            self.kwargs = kwargs
            return ""

    rec = Recorder()
    render_prompts(rec, ["q"], chat_template=True)
    assert rec.kwargs == {"tokenize": False, "add_generation_prompt": True}  # no `tools` key without tools


# ---------------------------------------------------------------------------------------- execution
def test_execute_success_and_return_values_as_text():
    ok = execute(TOOLS, ToolCall("calculator", {"expression": "37*482"}), 2.0)
    assert ok == ToolResult("calculator", "17834", error=False)
    assert execute(TOOLS, ToolCall("search", {"query": "a", "limit": 2}), 2.0).content == '["a", "a"]'
    out = execute(TOOLS, ToolCall("scale", {"x": 2.5, "unit": "m", "factor": "3", "table": {}}), 2.0)
    # `note` is Optional without a default: the schema leaves it optional, so it is passed as None
    assert out == ToolResult("scale", '{"x": 2.5, "unit": "m", "factor": "3", "note": null}')
    assert execute(TOOLS, ToolCall("sqrt", {"x": 16}), 2.0).content == "4.0"  # positional-only `sqrt(x, /)`


def test_execute_errors_never_raise():
    assert execute(TOOLS, ToolCall("calculator", {"expression": "1/0"}), 2.0) == ToolResult(
        "calculator", "calculator raised ZeroDivisionError: division by zero", error=True)
    boom_result = ToolResult("boom", "boom raised RuntimeError: no luck", error=True)
    assert execute(TOOLS, ToolCall("boom", {}), 2.0) == boom_result
    bad = execute(TOOLS, ToolCall("calculator", {"expr": "1"}), 2.0)
    assert bad == ToolResult(
        "calculator", "bad arguments for calculator: missing a required argument: 'expression'", error=True)
    unknown = execute(TOOLS, ToolCall("nope", {}), 2.0)
    assert unknown.error and unknown.name == "nope"
    assert unknown.content.startswith("unknown tool `nope` (tools: calculator, ")
    unparsed = ToolResult("", "could not parse tool call `x`: expected NAME(ARGS)", True)
    assert execute(TOOLS, unparsed, 2.0) is unparsed


def children() -> set[int]:
    """This process's child processes (Linux), zombies included."""
    return {int(pid) for path in glob.glob(f"/proc/{os.getpid()}/task/*/children")
            for pid in open(path).read().split()}


@pytest.mark.slow
def test_execute_times_out_kills_the_worker_and_leaves_no_thread_or_process():
    """20 calls that never come back: each answers a timeout error, its worker is killed and reaped; the
    thread count and the child processes are as before (a thread per call would have left 20 threads)."""
    execute(TOOLS, ToolCall("sqrt", {"x": 1}), 2.0)  # an idle worker exists before and after
    threads, before, timeouts = threading.active_count(), children(), WORKERS.timeouts
    for _ in range(20):
        out = execute(TOOLS, ToolCall("sleepy", {"seconds": 60}), 0.01)
        assert out == ToolResult("sleepy", "sleepy timed out after 0.01 s", error=True, timed_out=True)
    assert WORKERS.timeouts - timeouts == 20
    assert threading.active_count() <= threads  # a killed worker's keeper thread (step/forking.py) ends too
    assert children() <= before


def test_a_catastrophic_regex_holding_the_gil_is_stopped_in_time():
    """The worker stuck in C code is killed at the timeout; no thread or process is left (a thread would
    hold the GIL for minutes, and the call would not even return)."""
    execute(TOOLS, ToolCall("sqrt", {"x": 1}), 2.0)  # an idle worker exists before and after
    threads, before, timeouts = threading.active_count(), children(), WORKERS.timeouts
    start = time.perf_counter()
    out = execute(TOOLS, ToolCall("backtrack", {"text": "a" * 64 + "b"}), 0.3)
    assert out == ToolResult("backtrack", "backtrack timed out after 0.3 s", error=True, timed_out=True)
    assert time.perf_counter() - start < 1.3 and WORKERS.timeouts == timeouts + 1
    assert threading.active_count() <= threads and children() < before
    assert execute(TOOLS, ToolCall("sqrt", {"x": 9}), 2.0).content == "3.0"  # a new worker answers next


def test_a_tool_that_ends_its_worker_or_floods_is_an_error_or_cut():
    out = execute(TOOLS, ToolCall("leave", {}), 2.0)
    assert out == ToolResult("leave", "leave ended the worker process (exit code 3)", error=True)
    flood = execute(TOOLS, ToolCall("flood", {}), 2.0)
    assert not flood.error and len(flood.content) == MAX_RESULT_CHARS + len("... [10 more characters cut]")
    assert flood.content.endswith("x... [10 more characters cut]")
    assert execute(TOOLS, ToolCall("unprintable", {}), 2.0) == ToolResult(
        "unprintable", "unprintable returned an unprintable value (RuntimeError)", error=True)


def test_the_calculator_runs_in_process_without_a_worker():
    started = WORKERS.started
    assert not TOOLS["calculator"].isolated and TOOLS["sqrt"].isolated
    assert execute(TOOLS, ToolCall("calculator", {"expression": "6*7"}), 1.0).content == "42"
    assert WORKERS.started == started


def test_a_turns_calls_run_at_once_under_one_deadline():
    """A turn with three calls that each sleep past `tool_timeout` (1 s) costs about one timeout, not three:
    the calls are all sent to workers before any is waited for, under one deadline. Each late call answers
    its own timeout error with its worker killed; the quick calls between them answer; results stay in call
    order. (One after another, the turn took 3 s.)"""
    tools, tokenizer = list(TOOLS.values()), build_char_tokenizer()
    runner = EpisodeRunner(None, tools, PlainFormat(), tokenizer, tool_timeout=1.0)
    execute(TOOLS, ToolCall("sqrt", {"x": 1}), 2.0)  # an idle worker exists, as mid-run
    episode, timeouts = Episode({"prompt": "p"}, None, 0), WORKERS.timeouts
    text = ("<tool>sleepy(60)</tool><tool>sqrt(16)</tool><tool>sleepy(60)</tool>"
            "<tool>calculator('6*7')</tool><tool>sleepy(60)</tool>")
    start = time.perf_counter()
    role, observation = runner.answer(episode, text)
    elapsed = time.perf_counter() - start
    late = "<result>error: sleepy timed out after 1.0 s</result>"
    assert (role, observation) == ("tool", f"{late}<result>4.0</result>{late}<result>42</result>{late}")
    assert (episode.tool_calls, episode.tool_errors, episode.tool_timeouts) == (5, 3, 3)
    assert WORKERS.timeouts - timeouts == 3
    assert elapsed < 2 * runner.tool_timeout, elapsed  # one deadline (+ forks and kills), not 3 x 1 s


def test_execute_all_passes_unparsed_calls_and_bad_arguments_through_in_order():
    unparsed = ToolResult("", "could not parse tool call `x`: expected NAME(ARGS)", True)
    calls = [ToolCall("boom", {}), unparsed, ToolCall("nope", {}), ToolCall("sqrt", {"y": 1}),
             ToolCall("search", {"query": "q", "limit": 1})]
    out = execute_all(TOOLS, calls, 2.0)
    assert out[0] == ToolResult("boom", "boom raised RuntimeError: no luck", error=True)
    assert out[1] is unparsed
    assert out[2].error and out[2].content.startswith("unknown tool `nope`")
    assert out[3].error and out[3].content.startswith("bad arguments for sqrt: ")
    assert out[4] == ToolResult("search", '["q"]')
    assert execute_all(TOOLS, [], 2.0) == []


STUCK_SCRIPT = """
import os, re, signal, sys
from lightning_rl.episodes.tools import Tool, ToolCall, execute
def backtrack(text: str) -> bool:
    print(os.getpid(), flush=True)
    return re.search("(a+)+$", text) is not None
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a Python handler, as Lightning installs
execute({"backtrack": Tool.from_function(backtrack)}, ToolCall("backtrack", {"text": "a" * 64 + "b"}), 600)
"""


def gone(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_a_stuck_tool_call_neither_blocks_a_signal_nor_outlives_its_process(sig, code):
    """A learner waiting on a tool stuck in a regex (timeout 600 s) still runs its SIGTERM handler at once
    (a thread would hold the GIL); the worker dies with it, even when the learner is SIGKILLed."""
    proc = subprocess.Popen([sys.executable, "-c", STUCK_SCRIPT], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        worker = int(proc.stdout.readline())
        time.sleep(0.2)
        proc.send_signal(sig)
        assert proc.wait(timeout=5) == code
        deadline = time.monotonic() + 5
        while not gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(worker)
    finally:
        proc.kill()


# --------------------------------------------------------------------------------------- calculator
@pytest.mark.parametrize("expression, value", [
    ("37*482", "17834"), ("6/3", "2"), ("7/2", "3.5"), ("-7//2", "-4"), ("7 % 3", "1"), ("2**10", "1024"),
    ("2**-2", "0.25"), ("(2 + 3) * -4", "-20"), ("+1.5*2", "3"), ("10**100", str(10**100)),
])
def test_calculator_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, message", [
    ("__import__('os')", "is not allowed"), ("x + 1", "`x` is not allowed"), ("True + 1", "`True` is not"),
    ("'a' * 3", "is not allowed"), ("[1][0]", "is not allowed"), ("9**9**9", "exponent 387420489 is larger"),
    ("10**100 * 10", "result too large"), ("(10**100)**100", "result too large"), ("1e308 * 10", "too large"),
    ("(-8) ** 0.5", "not a real number"), ("1 +", "not an arithmetic"), ("1" * 2000, "longer than"),
])
def test_calculator_refusals(expression, message):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        calculator(expression)
    assert time.perf_counter() - start < 0.5
