"""Rewrites of test statements before the reward ``code_tests`` splits them
(:mod:`lightning_rl.code_judge_plan`), so that common shapes are judged as plain asserts rather than as
one claim of the completion's process:

- ``check(args)`` of a test-defined function made only of asserts (HumanEval's ``def check(candidate)``)
  becomes those asserts, its parameters replaced by the arguments;
- ``all(E for x in L)`` / ``any(...)`` (a list comprehension too) over a literal ``L`` or a ``range`` of
  literal ints, one ``for`` and no ``if``, becomes ``E[x=L0] and E[x=L1] ...`` (``or`` for ``any``), so
  that each ``E`` is split on its own (the comparisons stay out of the completion's process).
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable

MAX_UNROLL = 1000  # items of an unrolled all() / any()


def inline_checks(tests: list[list[ast.stmt] | None],
                  binds: Callable[[ast.stmt], set[str]]) -> list[list[ast.stmt] | None]:
    """Replace each call ``check(args)`` of a test-defined function made only of asserts by those asserts,
    its parameters replaced by the arguments (other statements unchanged; ``binds`` names what a statement
    binds, so that a rebound name is no longer the check)."""
    checks: dict[str, tuple[list[str], list[ast.Assert]]] = {}
    out: list[list[ast.stmt] | None] = []
    for body in tests:
        new: list[ast.stmt] = []
        for stmt in body or ():
            for name in binds(stmt):
                checks.pop(name, None)
            asserts = check_body(stmt) if isinstance(stmt, ast.FunctionDef) else None
            if isinstance(stmt, ast.FunctionDef) and asserts is not None:
                checks[stmt.name] = ([a.arg for a in stmt.args.args], asserts)
            call = stmt.value if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) else None
            target = checks.get(call.func.id) if call and isinstance(call.func, ast.Name) else None
            if call and target and not call.keywords and len(call.args) == len(target[0]) and not any(
                    isinstance(a, ast.Starred) for a in call.args):
                bound = dict(zip(target[0], call.args, strict=True))
                new.extend(substitute(a, bound) for a in target[1])
            else:
                new.append(stmt)
        out.append(new if body is not None else None)
    return out


def check_body(fn: ast.FunctionDef) -> list[ast.Assert] | None:
    """The asserts of a function that takes plain positional parameters and only asserts (after an
    optional docstring and ``pass``), else None."""
    a = fn.args
    if fn.decorator_list or a.posonlyargs or a.vararg or a.kwonlyargs or a.kwarg or a.defaults:
        return None
    body = [s for s in fn.body if not isinstance(s, ast.Pass) and not (
        isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))]
    asserts = [s for s in body if isinstance(s, ast.Assert)]
    return asserts if body and len(asserts) == len(body) else None


def substitute(node: ast.AST, values: dict[str, ast.expr]) -> ast.AST:
    """A copy of ``node`` with each read of a name in ``values`` replaced by (a copy of) its expression."""

    class Put(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name) -> ast.expr:
            if name.id in values and isinstance(name.ctx, ast.Load):
                return copy.deepcopy(values[name.id])
            return name

    return ast.fix_missing_locations(Put().visit(copy.deepcopy(node)))


def unroll(node: ast.expr, builtin: Callable[[str], bool]) -> ast.expr | None:
    """``all(E for x in L)`` / ``any(...)`` as a chain of ``and`` / ``or`` over ``L``'s items (see the
    module's docstring), or None where the shape does not fit (``builtin(name)``: the name is the builtin)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("all", "any")
            and builtin(node.func.id) and len(node.args) == 1 and not node.keywords):
        return None
    comp = node.args[0]
    if not isinstance(comp, (ast.GeneratorExp, ast.ListComp)) or len(comp.generators) != 1:
        return None
    loop = comp.generators[0]
    items = literal_items(loop.iter, builtin)
    if loop.ifs or loop.is_async or not items or len(items) > MAX_UNROLL:
        return None
    names = [loop.target] if isinstance(loop.target, ast.Name) else getattr(loop.target, "elts", None)
    if not names or not all(isinstance(n, ast.Name) for n in names):
        return None
    parts = []
    for item in items:
        values = [item] if isinstance(loop.target, ast.Name) else list(item) if isinstance(
            item, (list, tuple)) else []
        if len(values) != len(names):
            return None
        bound = {n.id: ast.parse(repr(v), mode="eval").body for n, v in zip(names, values, strict=True)}
        parts.append(substitute(comp.elt, bound))
    return ast.BoolOp(ast.And() if node.func.id == "all" else ast.Or(), parts) if len(parts) > 1 else parts[0]


def literal_items(node: ast.expr, builtin: Callable[[str], bool]) -> list | None:
    """The items of a literal list / tuple / set, or of ``range(...)`` of literal ints; None otherwise."""
    try:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range" \
                and builtin("range") and not node.keywords:
            args = [ast.literal_eval(a) for a in node.args]
            fits = all(type(a) is int for a in args) and len(range(*args)) <= MAX_UNROLL
            return list(range(*args)) if fits else None
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, OverflowError):
        return None
    if isinstance(value, (list, tuple, set, frozenset)) and all(
            ast.literal_eval(repr(v)) == v for v in value):  # items written back as literals
        return list(value)
    return None
