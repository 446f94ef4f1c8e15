"""How the reward ``code_tests`` splits a row's tests between the completion's process, a separate run and
the trainer (:mod:`lightning_rl.code_judge` runs the plan).

Each test statement is one counted test, made of units (usually one; a test string may hold several
statements, and :mod:`lightning_rl.code_judge_rewrite` turns ``check(f)`` of a test-defined function of
asserts into those asserts, and ``all(...)`` over a literal into its items). Names fall in three
kinds: the completion's (free names of the tests that are neither builtins nor bound by a test statement,
and, to a fixed point, names bound by statements that use them or that are handed to them), neutral
(builtins a test does not rebind, names imported by a test) and apart (the rest: bound by self-contained
statements, like ``expected = [1, 2]``).

- A statement that is not an assert runs in the completion's process when it touches the completion's
  names, else in the separate run (so ``expected = ...`` never enters the completion's process); imports
  run in both. It passes when it raised nothing.
- An assert's expression is split: every maximal subexpression free of the completion's names is apart
  (a literal, ``ast.literal_eval``-ed here; else evaluated in the separate run); comparisons, ``and`` /
  ``or`` / ``not``, arithmetic, displays and the builtins of ``SAFE_CALLS`` (and ``math.isclose``) around
  the completion's parts stay in the verdict tree the trainer evaluates; what is left, the completion's
  parts (``f(x)``, ``obj.method(3)``, a comprehension over a non-literal), are holes its process evaluates.
  So in ``assert abs(f(x) - 2.5) < 1e-6`` the process sees ``f(x)`` only. ``a is b`` with both sides the
  completion's, and ``isinstance`` of one of its classes, are holes whole (identity exists only there).
"""

from __future__ import annotations

import ast
import builtins
import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_rl.code_judge_rewrite import inline_checks, unroll
from lightning_rl.code_judge_values import ARITHMETIC, SAFE_CALLS, SAFE_KEYWORDS, TYPES

SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.comprehension)


@dataclass
class Unit:
    """One judged piece of a test: ``check`` is the verdict tree of an assert (``Name`` placeholders
    ``h:k`` for the k-th value of the ``inside`` step, ``a:k`` of the ``apart`` step, ``l:k`` in
    ``literals``), or None for a statement that must run without error where its steps send it."""

    test: int
    inside: dict | None = None
    apart: dict | None = None
    check: ast.expr | None = None
    literals: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    """A row's tests: ``count`` counted tests, their ``units``, the ``invalid`` ones (not Python: they fail)
    and the builtin names the tests use (originals in the completion's process)."""

    count: int
    units: list[Unit]
    invalid: frozenset[int]
    builtins: list[str]

    def steps(self, side: str) -> list[dict]:
        """The steps for the completion's process (``inside``) or the separate run (``apart``)."""
        return [s for s in (getattr(u, side) for u in self.units) if s is not None]


def split_tests(tests: str | Sequence[str]) -> list[str]:
    """A row's test cases: a list of statements, or one string whose top-level statements are each one."""
    if not isinstance(tests, str):
        return [str(t) for t in tests]
    try:
        return [ast.get_source_segment(tests, node) or "" for node in ast.parse(tests).body]
    except SyntaxError as err:
        raise ValueError(f"code_tests: the `tests` column holds invalid Python: {err}") from err


def make_plan(statements: Sequence[str]) -> Plan:
    """The plan for one row's test statements."""
    parsed: list[list[ast.stmt] | None] = []
    for source in statements:
        try:
            parsed.append(ast.parse(source).body)
        except SyntaxError:
            parsed.append(None)
    flat = [(t, s) for t, body in enumerate(inline_checks(parsed, binds)) for s in body or ()]
    kinds = Kinds.of([s for _, s in flat])
    units = [make_unit(u, t, s, kinds) for u, (t, s) in enumerate(flat)]
    invalid = frozenset(t for t, body in enumerate(parsed) if body is None)
    return Plan(len(statements), units, invalid, sorted(kinds.builtins))


# ------------------------------------------------------------------------------------------------ names
def loads(node: ast.AST) -> set[str]:
    """The names ``node`` reads from its scope (not those bound by a function, lambda or comprehension in
    it); an augmented assignment's target counts as read."""
    read, local = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            read.add(n.id)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            read.add(n.target.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            local |= {a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)}
            body = n.body if isinstance(n.body, list) else [n.body]  # a lambda's is one expression
            local |= {m.id for b in body for m in ast.walk(b) if isinstance(m, ast.Name)
                      and not isinstance(m.ctx, ast.Load)}
        elif isinstance(n, ast.comprehension):
            local |= {m.id for m in ast.walk(n.target) if isinstance(m, ast.Name)}
    return read - local


def binds(stmt: ast.stmt) -> set[str]:
    """The names a statement binds (or deletes) in its own scope."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names if a.name != "*"}
    found, todo = set(), list(ast.iter_child_nodes(stmt))
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            found.add(n.id)
        elif not isinstance(n, SCOPES) and not isinstance(n, (ast.GeneratorExp, ast.ListComp, ast.SetComp,
                                                               ast.DictComp)):
            todo.extend(ast.iter_child_nodes(n))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(n.name)
    return found


@dataclass
class Kinds:
    """The kinds of the names in a row's tests (see the module's docstring)."""

    completion: set[str]
    builtins: set[str]
    imports: dict[str, str]  # name -> what it imports: "math" for `import math`, "math.isclose"

    @classmethod
    def of(cls, stmts: list[ast.stmt]) -> Kinds:
        """Classify, to a fixed point: a setup statement touching the completion's names makes what it
        binds the completion's, and a name the completion's process reads is the completion's."""
        setup = [s for s in stmts if not isinstance(s, ast.Assert)]
        imported = [s for s in setup if isinstance(s, (ast.Import, ast.ImportFrom))]
        bound = set().union(*(binds(s) for s in setup))
        imports = {(a.asname or a.name).split(".")[0]: module_of(s, a) for s in imported for a in s.names}
        used = set().union(*(loads(s) for s in stmts))
        kinds = cls(used - set(dir(builtins)) - bound, (used & set(dir(builtins))) - bound, imports)
        handed = bound - imports.keys()  # test-bound names that become the completion's when it reads them
        while True:
            before = len(kinds.completion)
            for s in setup:
                if s not in imported and (loads(s) | binds(s)) & kinds.completion:
                    kinds.completion |= binds(s) | (loads(s) & handed)
            for s in stmts:
                if isinstance(s, ast.Assert):
                    split(s.test, kinds, Unit(-1), [], [], lambda hole: kinds.completion.update(
                        loads(hole) & handed))
            if len(kinds.completion) == before:
                return kinds

    def uses(self, node: ast.AST) -> bool:
        """Whether ``node`` reads one of the completion's names."""
        return bool(loads(node) & self.completion)


def module_of(stmt: ast.Import | ast.ImportFrom, alias: ast.alias) -> str:
    """What an imported name refers to: the module (``import a.b`` -> ``a``, ``import a.b as c`` -> ``a.b``)
    or ``module.name`` (``from math import isclose``)."""
    if isinstance(stmt, ast.ImportFrom):
        return f"{stmt.module}.{alias.name}"
    return alias.name if alias.asname else alias.name.split(".")[0]


# ------------------------------------------------------------------------------------------------ units
def make_unit(u: int, test: int, stmt: ast.stmt, kinds: Kinds) -> Unit:
    """One unit: an assert split into holes, apart parts and literals; any other statement as a step."""
    unit = Unit(test)
    if isinstance(stmt, ast.Assert):
        holes: list[str] = []
        aparts: list[str] = []
        unit.check = split(stmt.test, kinds, unit, holes, aparts, lambda _: None)
        unit.inside = {"u": u, "eval": holes} if holes else None
        unit.apart = {"u": u, "eval": aparts} if aparts else None
        return unit
    step = {"u": u, "exec": ast.unparse(stmt)}
    both = isinstance(stmt, (ast.Import, ast.ImportFrom))
    inside = both or bool((loads(stmt) | binds(stmt)) & kinds.completion)
    unit.inside, unit.apart = (step if inside else None), (step if both or not inside else None)
    return unit


def split(node: ast.expr, kinds: Kinds, unit: Unit, holes: list[str], aparts: list[str],
          on_hole: Any) -> ast.expr:
    """The verdict tree of ``node``: apart parts and holes replaced by placeholders (see ``Unit``)."""
    if not kinds.uses(node):
        if isinstance(node, ast.Name) and node.id in TYPES and node.id in kinds.builtins:
            return placeholder(f"l:{len(unit.literals)}", unit.literals, TYPES[node.id])
        try:
            return placeholder(f"l:{len(unit.literals)}", unit.literals, ast.literal_eval(node))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            aparts.append(ast.unparse(node))
            return ast.Name(f"a:{len(aparts) - 1}", ast.Load())
    expanded = unroll(node, kinds.builtins.__contains__)
    if expanded is not None:  # all(f(x) == y for x, y in [...]): each item on its own
        inner = split(expanded, kinds, unit, holes, aparts, on_hole)
        return ast.Call(ast.Name("bool", ast.Load()), [inner], [])
    call = safe_call(node, kinds)
    if call is None and not splittable(node, kinds):
        on_hole(node)
        holes.append(ast.unparse(node))
        return ast.Name(f"h:{len(holes) - 1}", ast.Load())

    def part(child: ast.expr) -> ast.expr:
        return split(child, kinds, unit, holes, aparts, on_hole)

    if call is not None:
        assert isinstance(node, ast.Call)
        return ast.Call(ast.Name(call, ast.Load()), [part(a) for a in node.args],
                        [ast.keyword(k.arg, part(k.value)) for k in node.keywords])
    new = copy.copy(node)
    for name, value in ast.iter_fields(node):
        if isinstance(value, ast.expr):
            setattr(new, name, part(value))
        elif isinstance(value, list) and value and isinstance(value[0], ast.expr):
            setattr(new, name, [part(v) for v in value])
    return new


def placeholder(name: str, literals: dict[str, Any], value: Any) -> ast.Name:
    """Record a value known here under ``name``; the placeholder node."""
    literals[name] = value
    return ast.Name(name, ast.Load())


def splittable(node: ast.expr, kinds: Kinds) -> bool:
    """Whether the trainer applies ``node``'s own operation to its parts (else it is a hole)."""
    if isinstance(node, ast.Compare):
        identity = any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops)
        return not identity or sum(kinds.uses(x) for x in (node.left, *node.comparators)) < 2
    if isinstance(node, ast.BinOp):
        return type(node.op) in ARITHMETIC
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return not any(isinstance(e, ast.Starred) for e in node.elts)
    return isinstance(node, (ast.BoolOp, ast.UnaryOp))


def safe_call(node: ast.expr, kinds: Kinds) -> str | None:
    """The name in ``SAFE_CALLS`` of a call the trainer may apply to plain values, else None: an original
    builtin or ``math.isclose``, positional arguments, keywords of ``SAFE_KEYWORDS`` only."""
    if not isinstance(node, ast.Call) or any(isinstance(a, ast.Starred) for a in node.args):
        return None
    func, name = node.func, None
    if isinstance(func, ast.Name) and func.id in kinds.builtins and func.id in SAFE_CALLS:
        name = func.id
    elif isinstance(func, ast.Name) and kinds.imports.get(func.id) == "math.isclose":
        name = "isclose"
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.attr == "isclose" \
            and kinds.imports.get(func.value.id) == "math":
        name = "isclose"
    if name is None or any(k.arg not in SAFE_KEYWORDS.get(name, ()) for k in node.keywords):
        return None
    if name == "isinstance" and (len(node.args) != 2 or kinds.uses(node.args[1])):
        return None  # the completion's own class: only its process knows it
    return name
