"""The trainer's side of the reward ``code_tests``: plain values decoded from a sandboxed run, and the verdict
on them (:mod:`lightning_rl.code_judge` builds the trees, :mod:`lightning_rl.code_judge_harness` encodes).

``decode`` turns the tagged JSON of ``code_judge_harness.encode`` back into plain Python values, bounded:
ranges of at most a million items, a fresh ``nan`` per NaN (a NaN never equals anything, not even itself
in a list), anything unknown or malformed ``Opaque``. ``Opaque`` stands for an object that did not cross
(a class of the completion, an always-equal object, an int subclass with its own ``__eq__``): comparing it,
its truth, its length, hashing or iterating it raises ``JudgeError`` (the test fails); only ``is`` /
``is not`` against ``None`` / ``True`` / ``False`` answer (it is none of them), and a function, method,
module or class is true (nothing can make it false).

``evaluate`` applies a test's own operations to such values: comparisons (chains included), ``and`` /
``or`` / ``not``, arithmetic on numbers (sizes bounded), concatenation, a few builtins (``SAFE_CALLS``) and
``math.isclose``. Nothing the completion wrote runs here.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any

DEPTH = 64
MAX_RANGE = 1_000_000
MAX_ITEMS = 1_000_000  # a sequence repeated by `*`
MAX_BITS = 100_000  # ints in arithmetic
NUMBERS = (bool, int, float, complex, Fraction, Decimal)
TYPES = {t.__name__: t for t in (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set,
                                 frozenset, range)}
COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
SAFE_CALLS: dict[str, Callable[..., Any]] = {f.__name__: f for f in (
    abs, all, any, bool, float, frozenset, int, isinstance, len, list, max, min, round, set, sorted, str, sum,
    tuple, type)} | {"isclose": math.isclose}
SAFE_KEYWORDS = {"sorted": {"reverse"}, "isclose": {"rel_tol", "abs_tol"}, "round": {"ndigits"},
                 "sum": {"start"}, "max": {"default"}, "min": {"default"}}


class JudgeError(Exception):
    """The test fails: an opaque value was compared, an error was reported, a size bound was passed."""


class Opaque:
    """An object that did not cross the process boundary; ``kind`` is its type's name, for messages.
    ``true``: a function, method, module or class, whose truth nothing can change (``assert f`` passes)."""

    __slots__ = ("kind", "true")

    def __init__(self, kind: str, true: bool = False) -> None:
        self.kind, self.true = kind, true

    def __bool__(self) -> bool:
        return self.true or self.refuse()

    def __repr__(self) -> str:
        return f"<opaque {self.kind}>"

    def refuse(self, *_: Any) -> Any:
        raise JudgeError(f"an opaque {self.kind} value has no comparison, truth, length or items")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = __len__ = __iter__ = refuse
    __contains__ = __str__ = __format__ = refuse


class Raised:
    """An expression that raised in its run (its exception's name); using it fails the test."""

    def __init__(self, name: str) -> None:
        self.name = name


def decode(data: Any) -> Any:
    """A value from ``code_judge_harness.encode``'s tagged JSON; malformed or unhashable -> ``Opaque``."""
    try:
        return decode_in(data, 0)
    except (JudgeError, TypeError, ValueError, KeyError, IndexError, RecursionError, ArithmeticError) as err:
        return Opaque(f"undecodable ({type(err).__name__})")


def decode_in(data: Any, depth: int) -> Any:
    """``decode`` below the top."""
    if depth > DEPTH:
        raise JudgeError("nested too deep")
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not dict or len(data) != 1:
        raise JudgeError("not a tagged value")
    ((tag, body),) = data.items()
    items = (lambda: [decode_in(x, depth + 1) for x in body]) if type(body) is list else None
    plain = {"l": list, "t": tuple, "s": set, "f": frozenset, "it": iter}
    if tag in plain and items:
        return plain[tag](items())
    if tag in ("d", "di") and items:
        pairs = dict(tuple(p) for p in items()) if tag == "di" else dict(
            (decode_in(k, depth + 1), decode_in(v, depth + 1)) for k, v in body)
        return pairs.items() if tag == "di" else pairs
    if tag == "dk" and items:
        return dict.fromkeys(items()).keys()
    if tag == "dv" and items:
        return dict(enumerate(items())).values()
    return decode_scalar(tag, body)


def decode_scalar(tag: str, body: Any) -> Any:
    """The tags that hold no nested values."""
    if tag == "r" and len(body) == 3 and all(type(x) is int for x in body):
        value = range(*body)
        if len(value) > MAX_RANGE:
            raise JudgeError("range too long")
        return value
    simple: dict[str, Callable[[Any], Any]] = {
        "b": bytes.fromhex, "i": lambda h: int(h, 16), "T": TYPES.__getitem__, "D": Decimal,
        "c": lambda p: complex(*(float(x) for x in p)),
        "q": lambda p: Fraction(*(decode_in(x, 1) for x in p)),
        "o": lambda name: Opaque(str(name)[:80]), "ot": lambda name: Opaque(str(name)[:80], true=True),
        "x": lambda name: Raised(str(name)[:80])}
    if tag not in simple or (tag in "bi" and type(body) is not str) or (tag in "cq" and len(body) != 2):
        raise JudgeError(f"unknown tag {tag!r}")
    return simple[tag](body)


def loads(text: str) -> Any:
    """JSON with a fresh float per NaN / infinity token (so no two NaNs are the same object)."""
    return json.loads(text, parse_constant=float)


# ------------------------------------------------------------------------------------------ the verdict
def evaluate(node: ast.expr, values: dict[str, Any]) -> Any:
    """The value of a verdict tree: ``Name`` nodes are placeholders looked up in ``values`` (the plan puts
    every constant there too; a ``Constant`` node is its value)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        value = values[node.id]
        if isinstance(value, Raised):
            raise JudgeError(f"the expression raised {value.name}")
        return value
    if isinstance(node, ast.Compare):
        left = evaluate(node.left, values)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = evaluate(right_node, values)
            if not truth(COMPARE[type(op)](left, right)):
                return False
            left = right
        return True
    if isinstance(node, ast.BoolOp):
        result: Any = None
        for part in node.values:  # Python's short circuit: the value that decided
            result = evaluate(part, values)
            if truth(result) == isinstance(node.op, ast.Or):
                return result
        return result
    if isinstance(node, ast.UnaryOp):
        operand = evaluate(node.operand, values)
        if isinstance(node.op, ast.Not):
            return not truth(operand)
        return UNARY[type(node.op)](number(operand))
    if isinstance(node, ast.BinOp):
        return arithmetic(type(node.op), evaluate(node.left, values), evaluate(node.right, values))
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)  # the plan names the function: a key of SAFE_CALLS
        args = [evaluate(a, values) for a in node.args]
        return SAFE_CALLS[node.func.id](*args, **{k.arg: evaluate(k.value, values) for k in node.keywords})
    parts = [evaluate(e, values) for e in node.elts]  # Tuple, List, Set displays
    return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](parts)


def truth(value: Any) -> bool:
    """Python's truth of a plain value (``Opaque`` refuses)."""
    return bool(value)


def number(value: Any) -> Any:
    """``value`` when it is a number with an int part of at most ``MAX_BITS`` bits, else ``JudgeError``."""
    if type(value) not in NUMBERS:
        raise JudgeError(f"arithmetic on a {type(value).__name__}")
    if type(value) is int and value.bit_length() > MAX_BITS:
        raise JudgeError("an int too large for arithmetic")
    return value


def arithmetic(op: type, left: Any, right: Any) -> Any:
    """A test's arithmetic on plain values: numbers (powers bounded), concatenation of like sequences,
    repetition up to ``MAX_ITEMS`` items; anything else fails the test."""
    sequences = (str, bytes, list, tuple)
    if op is ast.Add and type(left) is type(right) and type(left) in sequences:
        return left + right
    if op is ast.Mult and {type(left), type(right)} & set(sequences):
        seq, times = (left, right) if type(left) in sequences else (right, left)
        if type(times) not in (int, bool) or len(seq) * max(times, 0) > MAX_ITEMS:
            raise JudgeError("a repetition too large")
        return seq * times
    left, right = number(left), number(right)
    if op is ast.Pow and type(right) in (int, bool) and bits(left) * abs(right) > MAX_BITS:
        raise JudgeError("a power too large")
    return ARITHMETIC[op](left, right)


def bits(value: Any) -> int:
    """The bits of an exact number's parts (0 for floats, complex and decimals: they overflow or round)."""
    if type(value) is Fraction:
        return max(value.numerator.bit_length(), value.denominator.bit_length())
    return value.bit_length() if type(value) in (int, bool) else 0
