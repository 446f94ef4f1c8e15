"""The judge's side inside the sandbox: this file is the program ``run_python`` runs (as ``main.py``) for the
reward ``code_tests`` (:mod:`lightning_rl.code_judge`); the standard library only, nothing of ours.

Its input, the rest of standard input as JSON: ``code`` (the completion's; ``""`` for the run that evaluates
the tests' self-contained parts), ``steps`` (``{"u": unit, "exec": statement}`` or ``{"u": unit, "eval":
[expression, ...]}``) and ``builtins`` (the builtin names the tests use). It moves the code's standard output
to a file, runs the code, then each step in order, and reports on the original standard output:
``@lrl-judge begin`` once the code ran, one ``@lrl-judge <unit> <json>`` per step, ``@lrl-judge end``.

Test statements see the builtins as they were before the code ran (``builtins.sorted = ...`` or a global
``len`` of the code's does not reach them); names the statements bind are copied back into the code's
globals, as if both shared one namespace. Values leave as plain data only (``encode``).

Nothing here is secret and nothing here decides a verdict: the code can read and rewrite all of it (its
input holds no expected value) and at most claim values for its own expressions; the trainer checks the
channel and judges (:mod:`lightning_rl.code_judge`).
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import types
from typing import Any

PREFIX = "@lrl-judge"
BUDGET = 200_000  # elements plus characters of one value; more -> {"o": "too large"}
DEPTH = 48  # nesting; deeper (or a cycle) -> too large
PLAIN = {list: "l", tuple: "t", set: "s", frozenset: "f"}
SCALARS = (type(None), bool, int, float, complex, str, bytes, dict, range)
NAMED_TYPES = {t.__name__: t for t in (*PLAIN, *SCALARS)}
# class attributes a subclass of a plain type may define and still count as its plain value (namedtuple's);
# any other dunder (__eq__, __hash__, __len__, __iter__, ...) makes it opaque
HARMLESS = frozenset({"__module__", "__qualname__", "__doc__", "__slots__", "__dict__", "__weakref__",
                      "__repr__", "__str__", "__format__", "__init__", "__new__", "__getnewargs__",
                      "__getnewargs_ex__", "__reduce__", "__reduce_ex__", "__match_args__", "__annotations__",
                      "__orig_bases__", "__parameters__", "__firstlineno__", "__static_attributes__",
                      "__init_subclass__", "__class_getitem__", "__copy__", "__deepcopy__", "__getstate__",
                      "__setstate__", "__sizeof__", "__dir__"})
ITERATORS = frozenset(type(x) for x in (
    iter([]), iter(()), iter(""), iter(b""), iter(range(0)), iter(set()), iter({}), iter({}.values()),
    iter({}.items()), map(abs, ()), filter(None, ()), zip(), enumerate(()), reversed([]), (x for x in ())))
VIEWS = {type({}.keys()): "dk", type({}.values()): "dv", type({}.items()): "di"}
# objects whose truth nothing can change (always true): functions, methods, modules, plain classes
ALWAYS_TRUE = frozenset({types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
                         type})


class TooLarge(Exception):
    """A value over ``BUDGET`` or ``DEPTH``."""


def encode(value: Any) -> Any:
    """``value`` as JSON-ready plain data: exact plain types (and subclasses that add no behaviour) as
    themselves or tagged (``{"l": [...]}`` a list, ``"t"`` tuple, ``"s"`` set, ``"f"`` frozenset, ``"d"``
    dict as pairs, ``"b"`` bytes, ``"c"`` complex, ``"i"`` a big int in hex, ``"r"`` range, ``"it"`` an
    iterator's items, ``"dk"``/``"dv"``/``"di"`` dict views, ``"T"`` a builtin type, ``"q"`` Fraction, ``"D"``
    Decimal); anything else ``{"o": type name}`` (opaque: it never compares equal to anything, and has no
    truth), or ``{"ot": type name}`` for the ``ALWAYS_TRUE`` kinds (opaque, but true)."""
    try:
        return encode_in(value, [BUDGET], 0)
    except (TooLarge, RecursionError):
        return {"o": "too large"}


def encode_in(value: Any, left: list[int], depth: int) -> Any:
    """``encode`` below the top: ``left`` is the budget still unspent."""
    kind = type(value)
    left[0] -= 1
    if left[0] < 0 or depth > DEPTH:
        raise TooLarge
    if kind not in PLAIN and kind not in SCALARS:
        base = plain_base(kind)
        if base is None:
            return encode_other(value, kind, left, depth)
        value, kind = as_base(value, base), base
    if value is None or kind in (bool, float) or (kind is int and value.bit_length() < 4000):
        return value
    left[0] -= len(value) if kind is str or kind is bytes else value.bit_length() // 4 if kind is int else 0
    if left[0] < 0:
        raise TooLarge
    if kind is str or kind is bytes:
        return value if kind is str else {"b": value.hex()}
    if kind is int:
        return {"i": format(value, "x")}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    if kind is range:
        return {"r": [value.start, value.stop, value.step]}
    if kind is dict:
        return {"d": [[encode_in(k, left, depth + 1), encode_in(v, left, depth + 1)]
                      for k, v in value.items()]}
    return {PLAIN[kind]: [encode_in(x, left, depth + 1) for x in value]}


def encode_other(value: Any, kind: type, left: list[int], depth: int) -> Any:
    """Iterators (consumed), dict views, builtin types, fractions and decimals; else opaque."""
    if kind in ITERATORS or kind in VIEWS:
        items = []
        for x in value:  # a generator runs the code here: what it raises is the test's error
            items.append(encode_in(x, left, depth + 1))
        return {VIEWS.get(kind, "it"): items}
    if kind is type and value in NAMED_TYPES.values():
        return {"T": value.__name__}
    fractions, decimal = sys.modules.get("fractions"), sys.modules.get("decimal")  # if the code used them
    if fractions is not None and kind is getattr(fractions, "Fraction", None):
        return {"q": [encode_in(value.numerator, left, depth), encode_in(value.denominator, left, depth)]}
    if decimal is not None and kind is getattr(decimal, "Decimal", None):
        return {"D": str(value)}
    name = str(type.__dict__["__name__"].__get__(kind))[:80]
    return {"ot" if kind in ALWAYS_TRUE else "o": name}


def plain_base(kind: type) -> type | None:
    """The plain type ``kind`` subclasses when its own classes define only ``HARMLESS`` dunders (namedtuple),
    or is ``collections``' Counter / OrderedDict / defaultdict (their dict content); else None."""
    mro = type.__dict__["__mro__"].__get__(kind)
    collections = sys.modules.get("collections")
    if collections is not None and kind in (collections.Counter, collections.OrderedDict,
                                            collections.defaultdict):
        return dict
    for i, cls in enumerate(mro):
        if cls in PLAIN or cls in SCALARS:
            own = (k for c in mro[:i] for k in type.__dict__["__dict__"].__get__(c))
            return None if any(k.startswith("__") and k.endswith("__") and k not in HARMLESS for k in own) \
                else cls
    return None


def as_base(value: Any, base: type) -> Any:
    """A subclass instance's plain value, read with the base type's own methods (none of the subclass's)."""
    if base is dict:
        return dict(dict.items(value))
    if base in (list, tuple, str, bytes):
        return base.__getitem__(value, slice(None))
    if base in (set, frozenset):
        return base(base.__iter__(value))
    return {int: int.__int__, float: float.__float__, complex: complex.__complex__}[base](value)


# --------------------------------------------------------------------------------------------- the run
def run_step(step: dict, g: dict, originals: dict, names: list[str]) -> dict:
    """One step in a namespace of the code's globals with the original builtins ``names``: ``{"ok": 1}``
    or ``{"e": error}`` for a statement; ``{"v": [value or {"x": error}, ...]}`` for expressions."""
    env = dict(g)
    env.update({n: originals[n] for n in names if n in originals})
    env["__builtins__"] = originals
    if "exec" in step:
        before = dict(env)
        try:
            originals["exec"](originals["compile"](step["exec"], "<test>", "exec"), env)
        except BaseException as err:  # SystemExit too: a test that exits fails, the rest go on
            return {"e": error_name(err)}
        for k, v in env.items():  # what the statement bound, as if it ran in the code's namespace
            if k != "__builtins__" and (k not in before or before[k] is not v):
                g[k] = v
        for k in before.keys() - env.keys():
            g.pop(k, None)
        return {"ok": 1}
    values = []
    for source in step["eval"]:
        try:
            values.append(encode(originals["eval"](originals["compile"](source, "<test>", "eval"), env)))
        except BaseException as err:
            values.append({"x": error_name(err)})
    return {"v": values}


def error_name(err: BaseException) -> str:
    """The exception's class name, as plain text."""
    return str(type.__dict__["__name__"].__get__(type(err)))[:80]


def hide_output() -> None:
    """Point standard output (descriptor 1) at a file of the run's folder, so that what the code prints
    never reaches the channel; where the folder refuses, the output stays (the trainer skips what is not a
    message, and a printed marker only fails the code's own tests)."""
    sys.stdout.flush()
    try:
        hidden = os.open("stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return
    os.dup2(hidden, 1)
    os.close(hidden)


def main() -> None:
    """Read the plan, hide the code's output, run the code, then every step; report each on the channel."""
    plan = json.loads(sys.stdin.read())
    originals, write, dumps, exit_now = dict(vars(builtins)), os.write, json.dumps, os._exit
    channel = os.dup(1)
    hide_output()
    g = {"__name__": "__main__"}
    try:
        originals["exec"](originals["compile"](plan["code"], "<completion>", "exec"), g)
    except BaseException:  # the code did not run to its end (an error, an exit): no test passes
        exit_now(1)
    write(channel, f"\n{PREFIX} begin\n".encode())
    for step in plan["steps"]:
        try:
            result = dumps(run_step(step, g, originals, plan["builtins"]))
        except BaseException as err:
            result = dumps({"e": f"judge: {error_name(err)}"})
        write(channel, f"\n{PREFIX} {int(step['u'])} {result}\n".encode())
    write(channel, f"\n{PREFIX} end\n".encode())
    exit_now(0)  # not the code's atexit handlers or threads


if __name__ == "__main__":
    main()
