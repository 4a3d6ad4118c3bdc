"""Plant a bug in a copy of a solution by editing its syntax tree: the tests name the calls, never quote the code.

A planted-bug test that quoted the solution's lines would hand a learner the answer
(``grep`` the tests). These operators describe a bug by what it touches instead:
delete a call, move one before another, give a call other arguments, drop an ``if``
around its body, drop a factor or a term from what an assignment computes, and so on. The edited function is written back with ``ast.unparse`` (its
comments go; the rest of the file keeps its text).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass


@dataclass(frozen=True)
class Delete:
    """Delete the statement holding the ``nth`` call of ``call`` (e.g. "warpgroup.wait_group")."""
    call: str
    nth: int = 0


@dataclass(frozen=True)
class MoveBefore:
    """Move the statement holding the ``nth`` call of ``call`` to just before the ``anchor_nth`` call of ``anchor``."""
    call: str
    anchor: str
    nth: int = 0
    anchor_nth: int = 0


@dataclass(frozen=True)
class SetArgument:
    """Give the ``nth`` call of ``call`` the argument ``value`` (Python source) at position or keyword ``at``."""
    call: str
    at: int | str
    value: str
    nth: int = 0


@dataclass(frozen=True)
class Unwrap:
    """Replace the ``nth`` ``if`` statement by its body: what it guarded runs always."""
    nth: int = 0


@dataclass(frozen=True)
class SetValue:
    """The ``nth`` assignment to ``target`` (as written, e.g. "row_sum[r]") assigns ``value`` instead."""
    target: str
    value: str
    nth: int = 0


@dataclass(frozen=True)
class DropFactor:
    """In what the ``nth`` assignment to ``target`` (or "return") computes, every product with ``factor`` loses it."""
    target: str
    factor: str
    nth: int = 0


@dataclass(frozen=True)
class DropTerm:
    """In what the ``nth`` assignment to ``target`` computes, the first ``+ term`` or ``- term`` goes."""
    target: str
    term: str
    nth: int = 0


@dataclass(frozen=True)
class Square:
    """In what the ``nth`` assignment to ``target`` computes, the first ``name`` becomes ``name * name``."""
    target: str
    name: str
    nth: int = 0


@dataclass(frozen=True)
class KeepArgument:
    """In what the ``nth`` assignment to ``target`` computes, the first call of ``call`` becomes its argument ``keep``."""
    target: str
    call: str
    keep: int
    nth: int = 0


@dataclass(frozen=True)
class SetTest:
    """The ``nth`` ``if`` (or ``while``, with ``loop``) tests ``value`` instead."""
    value: str
    nth: int = 0
    loop: bool = False


@dataclass(frozen=True)
class DropConjunct:
    """The ``nth`` ``while`` loop's condition ``a and b and ...`` loses its operand ``index``."""
    index: int
    nth: int = 0


@dataclass(frozen=True)
class DropIndexTerm:
    """In the ``nth`` assignment to a subscript (``x[i + j + ...] = ...``), the index loses its addend ``term``
    (0 is the leftmost): two elements meet in one slot, or one lands elsewhere."""
    term: int
    nth: int = 0


def _assignment(function: ast.AST, target: str, nth: int) -> ast.stmt:
    found = sorted((n for n in ast.walk(function)
                    if (target == "return" and isinstance(n, ast.Return))
                    or (isinstance(n, ast.Assign) and any(ast.unparse(t) == target for t in n.targets))
                    or (isinstance(n, (ast.AugAssign, ast.AnnAssign)) and ast.unparse(n.target) == target)),
                   key=lambda n: n.lineno)
    if len(found) <= nth:
        raise LookupError(f"{function.name}() assigns {target} {len(found)} time(s); the mutation needs {nth + 1}")
    return found[nth]


class _Rewrite(ast.NodeTransformer):
    """Rewrite the first node (or every node, with ``every``) for which ``change`` returns a replacement."""

    def __init__(self, change, every: bool = False):
        self.change, self.every, self.done = change, every, False

    def visit(self, node):
        if self.done and not self.every:
            return node
        replacement = self.change(node)
        if replacement is not None:
            self.done = True
            return replacement
        return self.generic_visit(node)


def _rewrite_value(stmt: ast.stmt, change, every: bool = False) -> None:
    rewrite = _Rewrite(change, every)
    stmt.value = rewrite.visit(stmt.value)
    if not rewrite.done:
        raise LookupError(f"the mutation found nothing to change in: {ast.unparse(stmt)}")


def _statement_lists(node: ast.AST):
    """Every list of statements in ``node`` (bodies of functions, loops, branches, with blocks)."""
    for child in ast.walk(node):
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(child, name, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                yield stmts


def _calls(node: ast.AST, call: str) -> list[ast.Call]:
    found = [c for c in ast.walk(node) if isinstance(c, ast.Call) and ast.unparse(c.func) == call]
    return sorted(found, key=lambda c: (c.lineno, c.col_offset))


def _holder(function: ast.AST, call: str, nth: int) -> tuple[list, int]:
    """(the statement list, the index) of the innermost statement that holds the ``nth`` call of ``call``."""
    calls = _calls(function, call)
    if len(calls) <= nth:
        raise LookupError(f"{function.name}() makes {len(calls)} call(s) of {call}; the mutation needs call {nth + 1}")
    target = calls[nth]
    best = None
    for stmts in _statement_lists(function):
        for i, stmt in enumerate(stmts):
            if any(c is target for c in ast.walk(stmt)):
                if best is None or (stmt.lineno, -stmt.end_lineno) >= (best[0][best[1]].lineno, -best[0][best[1]].end_lineno):
                    best = (stmts, i)
    return best


def _apply(function: ast.FunctionDef, mutation) -> None:
    if isinstance(mutation, Delete):
        stmts, i = _holder(function, mutation.call, mutation.nth)
        del stmts[i]
        if not stmts:
            stmts.append(ast.Pass())
    elif isinstance(mutation, MoveBefore):
        stmts, i = _holder(function, mutation.call, mutation.nth)
        moved = stmts.pop(i)
        anchor_stmts, j = _holder(function, mutation.anchor, mutation.anchor_nth)
        anchor_stmts.insert(j, moved)
    elif isinstance(mutation, SetArgument):
        call = _calls(function, mutation.call)[mutation.nth]
        value = ast.parse(mutation.value, mode="eval").body
        if isinstance(mutation.at, int):
            call.args[mutation.at] = value
        else:
            keyword = next(k for k in call.keywords if k.arg == mutation.at)
            keyword.value = value
    elif isinstance(mutation, Unwrap):
        ifs = sorted((n for n in ast.walk(function) if isinstance(n, ast.If)), key=lambda n: n.lineno)
        target = ifs[mutation.nth]
        for stmts in _statement_lists(function):
            for i, stmt in enumerate(stmts):
                if stmt is target:
                    stmts[i:i + 1] = target.body
                    return
    elif isinstance(mutation, SetValue):
        _assignment(function, mutation.target, mutation.nth).value = ast.parse(mutation.value, mode="eval").body
    elif isinstance(mutation, DropFactor):
        def drop(node):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                if ast.unparse(node.right) == mutation.factor:
                    return drop(node.left) or node.left
                if ast.unparse(node.left) == mutation.factor:
                    return drop(node.right) or node.right
            return None
        _rewrite_value(_assignment(function, mutation.target, mutation.nth), drop, every=True)
    elif isinstance(mutation, DropTerm):
        _rewrite_value(_assignment(function, mutation.target, mutation.nth),
                       lambda node: node.left if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub))
                       and ast.unparse(node.right) == mutation.term else None)
    elif isinstance(mutation, Square):
        _rewrite_value(_assignment(function, mutation.target, mutation.nth),
                       lambda node: ast.BinOp(ast.Name(mutation.name, ast.Load()), ast.Mult(),
                                              ast.Name(mutation.name, ast.Load()))
                       if isinstance(node, ast.Name) and node.id == mutation.name else None)
    elif isinstance(mutation, KeepArgument):
        _rewrite_value(_assignment(function, mutation.target, mutation.nth),
                       lambda node: node.args[mutation.keep] if isinstance(node, ast.Call)
                       and ast.unparse(node.func) == mutation.call else None)
    elif isinstance(mutation, (SetTest, DropConjunct)):
        kind = ast.While if isinstance(mutation, DropConjunct) or mutation.loop else ast.If
        node = sorted((n for n in ast.walk(function) if isinstance(n, kind)), key=lambda n: n.lineno)[mutation.nth]
        if isinstance(mutation, SetTest):
            node.test = ast.parse(mutation.value, mode="eval").body
        else:
            del node.test.values[mutation.index]
            if len(node.test.values) == 1:
                node.test = node.test.values[0]
    elif isinstance(mutation, DropIndexTerm):
        stores = sorted((n for n in ast.walk(function) if isinstance(n, ast.Assign)
                         and isinstance(n.targets[0], ast.Subscript)), key=lambda n: n.lineno)
        target = stores[mutation.nth].targets[0]
        addends, node = [], target.slice
        while isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            addends.insert(0, node.right)
            node = node.left
        addends.insert(0, node)
        del addends[mutation.term]
        index = addends[0]
        for addend in addends[1:]:
            index = ast.BinOp(index, ast.Add(), addend)
        target.slice = index
    else:
        raise TypeError(f"not a mutation: {mutation!r}")


def mutate(source: str, function: str, *mutations) -> str:
    """``source`` with ``mutations`` applied, in order, to the function (or method) named ``function``."""
    tree = ast.parse(source)
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function]
    if len(found) != 1:
        raise LookupError(f"the source defines {len(found)} functions named {function}; a mutation needs exactly one")
    node = found[0]
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    for mutation in mutations:
        _apply(node, mutation)
    ast.fix_missing_locations(node)
    indent = " " * node.col_offset
    text = "".join(indent + line + "\n" for line in ast.unparse(node).splitlines())
    lines = source.splitlines(keepends=True)
    return "".join(lines[:start - 1]) + text + "".join(lines[node.end_lineno:])
