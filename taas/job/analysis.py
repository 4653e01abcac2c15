"""Which notebook names a cell reads, which it binds, and how to compile it for the ranks.

A taas cell runs in fresh worker processes, so every notebook value it needs must be pickled
and shipped. Shipping the whole namespace is slow and fails on the first unpicklable object
(an open file, a CUDA tensor, a lock), so we ship only what the cell *reads*. A name the cell
binds before it reads it (``data = load(); fit(data)``) comes from the cell itself and needs no
shipping; a name bound only conditionally (inside ``if``/``for``/``while``/``try``/``match``)
might not be, so a later read still counts as free. Reads inside function, lambda and
comprehension bodies are resolved with :mod:`symtable`: whatever such a scope does not bind
itself (or take from an enclosing function) is a module-level read, counted at the point of
definition, since we cannot know when the body will run. ``free`` is deliberately
over-inclusive (builtins such as ``print`` appear): the caller intersects it with the notebook
namespace. ``bound`` lists every module-level name the cell may bind, for the results back
(rank 0 adds the names it finds bound at run time: ``exec``, ``%run``, ``globals()[...]``,
:class:`taas.job.results.Before`).  IPython syntax routed to the rank's shell counts as what it
reads and binds (:func:`taas.job.syntax.unfold`).
"""

from __future__ import annotations

import ast
import functools
import symtable
import types
import typing
from dataclasses import dataclass

from taas.job import syntax

__all__ = ["CellAnalysis", "analyse", "compile_cell"]

_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_SCOPES = (ast.Lambda, *_COMPREHENSIONS)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class CellAnalysis:
    free: frozenset[str]  # names the cell may read from the notebook namespace
    bound: tuple[str, ...]  # names bound at module level, in first-binding order
    has_last_expr: bool  # the last top-level statement is an expression (becomes Out[])


@functools.lru_cache(maxsize=64)
def analyse(source: str) -> CellAnalysis:
    """Analyse a cell's source. A SyntaxError propagates unchanged.  Remembered per source (a
    function of it alone, and CellAnalysis is frozen): a notebook runs the same cells again,
    kept cells most of all, and the walk took a few tenths of a millisecond of each."""
    tree = ast.parse(source)
    if syntax.SHELL in source:  # IPython syntax, routed to the rank's shell: what it reads and binds
        tree = syntax.unfold(tree)
    walker = _Walker()
    walker.block(tree.body, set(), top=True)
    order = sorted(walker.first, key=walker.first.__getitem__)
    has_last = bool(tree.body) and isinstance(tree.body[-1], ast.Expr)
    return CellAnalysis(frozenset(walker.free), tuple(order), has_last)


@functools.lru_cache(maxsize=64)
def compile_cell(
    source: str, filename: str, first_line: int = 1
) -> tuple[types.CodeType, types.CodeType | None]:
    """Compile a cell so tracebacks show ``filename`` at the notebook's line numbers.

    Returns (body code for ``exec``, last expression code for ``eval`` or None): as in IPython,
    the value of a trailing expression statement is the cell's result.  Remembered per cell (code
    objects are immutable): kept ranks run a notebook's cells again and again, and compiling
    cost each of them a few tenths of a millisecond of every cell.
    """
    # Padding (rather than ast.increment_lineno) puts SyntaxErrors at the right line too.
    tree = ast.parse("\n" * (first_line - 1) + source, filename)
    last = None
    tail = tree.body[-1] if tree.body else None
    if isinstance(tail, ast.Expr):
        tree.body.pop()
        last = compile(ast.Expression(tail.value), filename, "eval", dont_inherit=True)
    return compile(tree, filename, "exec", dont_inherit=True), last


def _pos(node: ast.AST | types.SimpleNamespace) -> tuple[int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


def _nested_globals(node: ast.AST) -> tuple[set[str], set[str]]:
    """(global names read, global-declared names assigned) by the nested scopes within node."""
    table = symtable.symtable(ast.unparse(node), "<cell>", "exec")
    reads: set[str] = set()
    assigned: set[str] = set()
    todo = list(table.get_children())
    while todo:
        child = todo.pop()
        todo.extend(child.get_children())
        for sym in child.get_symbols():
            if sym.is_global() and sym.is_referenced():
                reads.add(sym.get_name())
            if sym.is_declared_global() and sym.is_assigned():
                assigned.add(sym.get_name())
    return reads, assigned


class _Walker:
    """Walks module-level code in evaluation order, tracking definitely-bound names.

    ``bound`` is the set of names definitely bound at the current point (conditional bodies get
    a copy); ``top`` says whether bindings land in the module namespace (False in class bodies).
    """

    def __init__(self) -> None:
        self.free: set[str] = set()
        self.first: dict[str, tuple[int, int]] = {}  # module binding -> first source position
        self.module_bound: set[str] = set()  # definite module names, seen from a class body

    def read(self, name: str, bound: set[str]) -> None:
        if name not in bound:
            self.free.add(name)

    def bind(self, name: str, node: ast.AST | types.SimpleNamespace, bound: set[str], top: bool,
             definite=True) -> None:
        if definite:
            bound.add(name)
        if top and (name not in self.first or _pos(node) < self.first[name]):
            self.first[name] = _pos(node)

    # statements ---------------------------------------------------------------------------
    def block(self, stmts: list[ast.stmt], bound: set[str], top: bool) -> set[str]:
        for stmt in stmts:
            self.stmt(stmt, bound, top)
        return bound

    def stmt(self, s: ast.stmt, bound: set[str], top: bool) -> None:
        # Long on purpose: one branch per kind of statement, read side by side, is how the
        # binding rules are checked against the language reference.
        ex = lambda node: self.expr(node, bound, top)  # noqa: E731
        if isinstance(s, _FUNCS + (ast.ClassDef,)):
            for node in s.decorator_list:
                ex(node)
            if isinstance(s, ast.ClassDef):
                for node in s.bases + [k.value for k in s.keywords]:
                    ex(node)
                outer, self.module_bound = self.module_bound, bound if top else self.module_bound
                self.block(s.body, set(self.module_bound), top=False)  # class ns, then globals
                self.module_bound = outer
                self.scope(s, bound, top, reads=False)  # only for `global` names it assigns
            else:
                self.arguments(s.args, bound, top, s.returns)
                self.scope(s, bound, top, own_name=s.name)
            self.bind(s.name, s, bound, top)
        elif isinstance(s, ast.Assign):
            ex(s.value)
            for target in s.targets:
                self.target(target, bound, top)
        elif isinstance(s, ast.AugAssign):
            ex(s.value)
            if isinstance(s.target, ast.Name):
                self.read(s.target.id, bound)
            self.target(s.target, bound, top)
        elif isinstance(s, ast.AnnAssign):
            ex(s.annotation)
            if s.value is not None:
                ex(s.value)
                self.target(s.target, bound, top)
            elif not isinstance(s.target, ast.Name):
                ex(s.target)
        elif isinstance(s, ast.Delete):
            for target in s.targets:
                ex(target)
                if isinstance(target, ast.Name):
                    bound.discard(target.id)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            for alias in s.names:
                if alias.name != "*":
                    name = alias.asname or alias.name.split(".")[0]
                    self.bind(name, alias if hasattr(alias, "lineno") else s, bound, top)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                ex(item.context_expr)
                if item.optional_vars is not None:
                    self.target(item.optional_vars, bound, top)
            self.block(s.body, bound, top)  # a with body runs: its bindings are definite
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            ex(s.iter)
            inner = set(bound)
            self.target(s.target, inner, top)
            self.conditional(s.body, inner, top)
            self.conditional(s.orelse, bound, top)
        elif isinstance(s, (ast.If, ast.While)):
            ex(s.test)
            self.conditional(s.body, bound, top)
            self.conditional(s.orelse, bound, top)
        elif isinstance(s, ast.Try) or type(s).__name__ == "TryStar":  # try/except*: 3.11+
            s = typing.cast(ast.Try, s)  # TryStar has Try's fields
            after_body = self.conditional(s.body, bound, top)
            for handler in s.handlers:
                inner = set(bound)
                if handler.type is not None:
                    self.expr(handler.type, inner, top)
                if handler.name:
                    self.bind(handler.name, handler, inner, top)
                self.conditional(handler.body, inner, top)
            self.conditional(s.orelse, after_body, top)
            self.conditional(s.finalbody, bound, top)
        elif isinstance(s, ast.Match):
            ex(s.subject)
            for case in s.cases:
                inner = set(bound)
                self.expr(case.pattern, inner, top)
                if case.guard is not None:
                    self.expr(case.guard, inner, top)
                self.conditional(case.body, inner, top)
        else:  # Expr, Return, Raise, Assert, Pass, Break, Continue, Global, Nonlocal, ...
            for child in ast.iter_child_nodes(s):
                ex(child)

    def conditional(self, stmts: list[ast.stmt], bound: set[str], top: bool) -> set[str]:
        """A body that may not run: its bindings count for ``bound`` but are not definite."""
        return self.block(stmts, set(bound), top)

    def target(self, node: ast.expr, bound: set[str], top: bool) -> None:
        if isinstance(node, ast.Name):
            self.bind(node.id, node, bound, top)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                self.target(elt, bound, top)
        elif isinstance(node, ast.Starred):
            self.target(node.value, bound, top)
        else:  # a.b = ..., a[i] = ...: reads a (and i)
            self.expr(node, bound, top)

    # expressions --------------------------------------------------------------------------
    def expr(self, node: ast.AST, bound: set[str], top: bool) -> None:
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Store):
                self.bind(node.id, node, bound, top)
            else:
                self.read(node.id, bound)
        elif isinstance(node, ast.NamedExpr):
            self.expr(node.value, bound, top)
            self.bind(node.target.id, node.target, bound, top)
        elif isinstance(node, ast.Lambda):
            self.arguments(node.args, bound, top, None)
            self.scope(node, bound, top)
        elif isinstance(node, _COMPREHENSIONS):  # only the first iterable runs here
            self.expr(node.generators[0].iter, bound, top)
            self.scope(node, bound, top)  # a walrus in it binds at module level: not definite
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            if isinstance(node, ast.MatchAs) and node.pattern is not None:
                self.expr(node.pattern, bound, top)
            self.bind(node.name, node, bound, top)
        elif isinstance(node, ast.MatchMapping):
            for sub in node.keys + node.patterns:
                self.expr(sub, bound, top)
            if node.rest:  # **rest has no node of its own: place it at the mapping's end
                end = types.SimpleNamespace(lineno=node.end_lineno, col_offset=node.end_col_offset)
                self.bind(node.rest, end, bound, top)
        else:
            for child in ast.iter_child_nodes(node):
                self.expr(child, bound, top)

    def arguments(self, args: ast.arguments, bound: set[str], top: bool, returns) -> None:
        """Defaults and annotations are evaluated where the function is defined."""
        every = args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]
        notes = [a.annotation for a in every if a is not None and a.annotation is not None]
        for node in args.defaults + [d for d in args.kw_defaults if d] + notes + [returns]:
            if node is not None:
                self.expr(node, bound, top)

    def scope(self, node: ast.AST, bound: set[str], top: bool, own_name="", reads=True) -> None:
        """The module-level reads (and ``global`` bindings) of the scopes nested in node.

        Nested scopes skip class scopes, so inside a class body their reads are checked against
        the module's names. A def's body cannot run before its own name is bound: not a read.
        """
        names, assigned = _nested_globals(node)
        for name in (names - {own_name}) if reads else ():
            self.read(name, bound if top else self.module_bound)
        for name in sorted(assigned):
            first = [n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == name]
            self.bind(name, min(first, key=_pos, default=node), bound, True, definite=False)
