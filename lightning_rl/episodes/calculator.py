"""``calculator``: a built-in tool, safe arithmetic on an expression
(``lightning_rl.episodes.tools:calculator``).

The expression is parsed with ``ast`` and walked (numbers, ``+ - * / // % **``, unary signs, parentheses);
nothing is evaluated as Python, and exponents and magnitudes are bounded so no call can hang the run.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from typing import Any

MAX_EXPONENT = 100
MAX_MAGNITUDE = 10**100
MAX_EXPRESSION = 1000
BINARY_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers combined with + - * / // % ** and parentheses,
            for example `37*482` or `(2 + 3) / 4`.
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from err
    value = arithmetic(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


def arithmetic(node: ast.AST) -> int | float:
    """The value of an arithmetic ``ast`` node; bounded so that no expression can hang."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = arithmetic(node.operand)
        value = -value if isinstance(node.op, ast.USub) else +value
    elif isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPS:
        left, right = arithmetic(node.left), arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            value = BINARY_OPS[type(node.op)](left, right)
        except OverflowError as err:
            raise ValueError("result too large") from err
    else:
        raise ValueError(f"`{ast.unparse(node)}` is not allowed: only numbers and + - * / // % ** ( )")
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if abs(value) > MAX_MAGNITUDE or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError("result too large")
    return value
