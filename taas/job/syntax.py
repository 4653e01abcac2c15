"""IPython syntax in a taas cell: which magics mean something in a rank, and the calls the ranks make.

The notebook face (:mod:`taas.magics`) turns a cell body's IPython syntax into calls with
IPython's own transformers, line for line (``%run train.py`` becomes
``get_ipython().run_line_magic('run', 'train.py')``, ``!ls`` ``get_ipython().system('ls')``,
``x = !ls`` ``x = get_ipython().getoutput('ls')``).  In a rank ``get_ipython()`` stays ``None``,
as in a plain script (libraries ask it whether they run in a notebook), so :func:`route` sends
those calls to the rank's own small shell instead (:data:`SHELL`, :mod:`taas.rank.shell`) and
refuses, before anything starts, a magic that has no meaning in a rank.  :func:`unfold` shows
the analysis (:mod:`taas.job.analysis`) what such a call reads and binds: the code of ``%time``
and ``%timeit``, the ``{expr}`` and ``$name`` expansions of the others.

Pure: no IPython, no processes.  :class:`SList` and :class:`TimeitResult` are values a rank
makes and the notebook gets back, so they live here, where both ends can import them.
"""

from __future__ import annotations

import ast
import io
import math
import re
import shlex
import string
import tokenize
from dataclasses import dataclass

from taas.errors import DirectiveError

__all__ = ["LINE_MAGICS", "SHELL", "RunArgs", "SList", "TimeitResult", "expansions", "format_time",
           "parse_run", "route", "split_timeit", "unfold"]

SHELL = "__taas_shell__"  # the rank's shell, in the cell's namespace (a dunder: never sent back)
# What a rank's shell does (taas.rank.shell); every other magic is refused before launch.
LINE_MAGICS = ("run", "time", "timeit", "env", "set_env", "cd", "pwd", "sx", "system")
_CALLS = ("run_line_magic", "run_cell_magic", "system", "getoutput")  # the transformers' calls
_NO_EXPAND = ("time", "timeit")  # as in IPython: their argument is code, not expanded
_RUN_FLAGS = {"-i": "interactive", "-n": "not_main", "-e": "exit_ignore", "-G": "no_glob"}


def route(source: str, first_line: int = 1) -> str:
    """``source`` (IPython's transformation of a cell) with every ``get_ipython().<call>``
    going to :data:`SHELL`; a :class:`DirectiveError` of one line names a magic that has no
    meaning in a rank (with the cell's line, ``first_line`` being the source's first).  Source
    that is not Python is returned as it is: compiling it reports the error as Python does."""
    if "get_ipython" not in source:
        return source
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return source
    lines = source.splitlines(keepends=True)
    spans = []
    for i in range(len(tokens) - 4):
        a, b, c, d, e = tokens[i:i + 5]
        if (a.type == tokenize.NAME and a.string == "get_ipython" and b.string == "(" and c.string == ")"
                and d.string == "." and e.type == tokenize.NAME and e.string in _CALLS
                and a.start[0] == c.end[0]):
            spans.append((a.start, c.end))
    for (row, start), (_, end) in reversed(spans):
        line = lines[row - 1]
        lines[row - 1] = line[:start] + SHELL + line[end:]
    routed = "".join(lines)
    if spans:
        _check(routed, first_line)
    return routed


def _check(source: str, first_line: int) -> None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return  # compiling the cell says so
    for node in ast.walk(tree):
        call = _shell_call(node)
        if call is None:
            continue
        method, args = call
        line = node.lineno + first_line - 1
        if method == "run_cell_magic" and args:
            raise DirectiveError(f"%%{args[0]} (line {line}) is a cell magic, which cannot run inside a taas "
                                 "cell: run it in a cell of its own, or use the line magics a rank has "
                                 f"({_supported()})")
        if method != "run_line_magic" or not args:
            continue
        name = args[0].lstrip("%")
        if args[0] not in LINE_MAGICS:
            raise DirectiveError(f"%{args[0]} (line {line}) has no meaning in a taas rank: run it in a cell of "
                                 f"its own, outside %%taas; a rank knows {_supported()}")
        if name == "run" and len(args) > 1:
            try:
                parse_run(args[1])
            except ValueError as exc:
                raise DirectiveError(f"%run (line {line}): {exc}") from None


def _supported() -> str:
    return ", ".join(f"%{name}" for name in LINE_MAGICS) + ", !cmd and x = !cmd"


def _shell_call(node: ast.AST) -> tuple[str, list[str]] | None:
    """(method, its leading string arguments) when ``node`` is a call of the rank's shell."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == SHELL
            and node.func.attr in _CALLS):
        return None
    args = []
    for arg in node.args:
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            break
        args.append(arg.value)
    return node.func.attr, args


# -- what the analysis sees ----------------------------------------------------------------------
def unfold(tree: ast.Module) -> ast.Module:
    """``tree`` with each call of the rank's shell replaced by what it reads and binds, for
    :mod:`taas.job.analysis`: a ``%time``/``%timeit`` statement by its code's statements (so
    ``%time model = build(cfg)`` reads ``build`` and ``cfg`` and binds ``model``), any other call
    by a tuple of its expansions (``!ls {folder}`` reads ``folder``) or of the names its code
    uses (``%timeit``'s code runs in a function of its own, so it binds nothing)."""
    return _Unfold().visit(tree)


class _Unfold(ast.NodeTransformer):
    def visit_Expr(self, node: ast.Expr):
        call = _shell_call(node.value)
        if call is not None and call[0] == "run_line_magic" and len(call[1]) == 2 and call[1][0] == "time":
            body = _code_of(*call[1])
            if body is not None and body.body:
                for stmt in body.body:
                    ast.copy_location(stmt, node)
                    for child in ast.walk(stmt):
                        ast.copy_location(child, node)
                return body.body
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        call = _shell_call(node)
        if call is None:
            return self.generic_visit(node)
        method, args = call
        reads: list[ast.expr] = []
        if method == "run_line_magic" and len(args) == 2 and args[0] in _NO_EXPAND:
            code = _code_of(*args)
            if code is not None and args[0] == "time" and len(code.body) == 1 and isinstance(code.body[0], ast.Expr):
                reads.append(code.body[0].value)
            elif code is not None:  # %timeit's code runs in a function of its own: it binds nothing here
                reads.extend(ast.Name(n.id, ast.Load()) for n in ast.walk(code) if isinstance(n, ast.Name))
        else:
            text = args[1] if method.startswith("run_") and len(args) > 1 else (args[0] if args else "")
            for expr in expansions(text):
                try:
                    reads.append(ast.parse(expr, mode="eval").body)
                except SyntaxError:
                    continue
        out = ast.Tuple(elts=reads, ctx=ast.Load())
        for child in ast.walk(out):
            ast.copy_location(child, node)
        return out


def _code_of(magic: str, line: str) -> ast.Module | None:
    code = split_timeit(line)[1] if magic == "timeit" else line
    try:
        return ast.parse(code)
    except SyntaxError:
        return None


# -- expansions: IPython's var_expand ------------------------------------------------------------
# `$name` (and `$name.attr`) outside single quotes, as IPython's DollarFormatter finds them.
_DOLLAR = re.compile(r"(.*?)\$(\$?[\w\.]+)(?=([^']*'[^']*')*[^']*$)", re.S)


def _fields(text: str):
    """(literal, expression or None) pieces of ``text``, as IPython's DollarFormatter parses
    it: ``{expr}`` fields, ``$name`` fields, ``$$name`` a literal ``$name``.  Raises
    ValueError for unbalanced braces (IPython then leaves the text as it is)."""
    for literal, field_name, _spec, _conversion in string.Formatter().parse(text):
        done, pending = 0, ""
        for match in _DOLLAR.finditer(literal):
            before, name = match.group(1, 2)
            if name.startswith("$"):
                pending += before + name
            else:
                yield pending + before, name
                pending = ""
            done = match.end()
        yield pending + literal[done:], field_name


def expansions(text: str) -> list[str]:
    """The expressions IPython would evaluate to expand ``text`` (``{x + 1}``, ``$name``)."""
    try:
        return [name for _, name in _fields(text) if name]
    except ValueError:
        return []


def expand(text: str, evaluate) -> str:
    """``text`` with its expansions replaced by ``str(evaluate(expr))``; as IPython does, the
    text unchanged when any of them fails (``!echo $HOME`` with no Python ``HOME``: the shell's)."""
    if "$" not in text and "{" not in text:
        return text
    try:
        return "".join(literal + ("" if name is None else str(evaluate(name))) for literal, name in _fields(text))
    except Exception:
        return text


# -- %run's and %timeit's arguments --------------------------------------------------------------
@dataclass(frozen=True)
class RunArgs:
    """``%run [-i] [-n] [-e] [-G] (SCRIPT | -m MODULE) [ARGS...]``."""

    target: str  # the script's path, or the module's name with -m
    argv: tuple[str, ...] = ()  # what follows it: sys.argv[1:]
    module: bool = False
    interactive: bool = False  # -i: in the rank's namespace, which the script can read
    not_main: bool = False  # -n: __name__ is not "__main__"
    exit_ignore: bool = False  # -e: sys.exit of any code ends the script, not the rank
    no_glob: bool = False  # -G: no glob expansion of ARGS


def parse_run(line: str) -> RunArgs:
    """``%run``'s line (already expanded); ValueError says what is wrong with it."""
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise ValueError(f"cannot split {line!r}: {exc}") from None
    flags: dict[str, bool] = {}
    while words and words[0].startswith("-"):
        word = words.pop(0)
        if word == "-m":
            if not words:
                raise ValueError("-m takes a module name")
            return RunArgs(words[0], tuple(words[1:]), module=True, **flags)
        if word not in _RUN_FLAGS:
            raise ValueError(f"{word} is not supported in a taas rank (it supports -i, -n, -e, -G and -m)")
        flags[_RUN_FLAGS[word]] = True
    if not words:
        raise ValueError("a script to run is missing")
    return RunArgs(words[0], tuple(words[1:]), **flags)


def split_timeit(line: str) -> tuple[dict[str, str], str]:
    """``%timeit [-n N] [-r R] [-q] [-o] [-p P] CODE``: (options, CODE)."""
    options: dict[str, str] = {}
    rest = line.strip()
    while rest.startswith("-"):
        match = re.match(r"-([nrp])\s*(\d+)\s*|-([qoct])\s*", rest)
        if match is None:
            break
        if match.group(1):
            options[match.group(1)] = match.group(2)
        else:
            options[match.group(3)] = ""
        rest = rest[match.end():]
    return options, rest


# -- values a rank's shell makes ----------------------------------------------------------------
class SList(list):
    """What ``x = !cmd`` gives: the command's output lines, a list as IPython's SList is, with
    ``.s`` (joined by spaces), ``.n`` (by newlines), ``.l`` (the list) and ``.grep(pattern)``."""

    @property
    def s(self) -> str:
        return " ".join(self)

    @property
    def n(self) -> str:
        return "\n".join(self)

    @property
    def l(self) -> list:  # noqa: E743 - IPython's name
        return list(self)

    def grep(self, pattern: str, prune: bool = False) -> SList:
        """The lines matching the regular expression ``pattern`` (``prune``: those that do not)."""
        found = re.compile(pattern)
        return SList(line for line in self if bool(found.search(line)) != prune)


def format_time(seconds: float, precision: int = 3) -> str:
    """A duration as IPython's %time and %timeit print it (``1.23 ms``, ``4min 2s``)."""
    if seconds >= 60.0:
        parts = []
        for suffix, length in (("h", 3600), ("min", 60), ("s", 1)):
            value = int(seconds // length)
            if value > 0:
                seconds -= value * length
                parts.append(f"{value}{suffix}")
        return " ".join(parts)
    units, scaling = ["s", "ms", "\u00b5s", "ns"], [1, 1e3, 1e6, 1e9]
    order = min(-int(math.floor(math.log10(seconds)) // 3), 3) if seconds > 0.0 else 3
    return f"{seconds * scaling[order]:.{precision}g} {units[order]}"


@dataclass(frozen=True)
class TimeitResult:
    """What ``%timeit -o`` returns: every run's time per loop, in seconds."""

    loops: int
    repeat: int
    all_runs: tuple[float, ...]  # per loop, one per run
    precision: int = 3

    @property
    def average(self) -> float:
        return math.fsum(self.all_runs) / len(self.all_runs)

    @property
    def stdev(self) -> float:
        mean = self.average
        return math.sqrt(math.fsum((x - mean) ** 2 for x in self.all_runs) / len(self.all_runs))

    @property
    def best(self) -> float:
        return min(self.all_runs)

    @property
    def worst(self) -> float:
        return max(self.all_runs)

    def __str__(self) -> str:
        runs = "run" if self.repeat == 1 else "runs"
        loops = "loop" if self.loops == 1 else "loops"
        return (f"{format_time(self.average, self.precision)} \u00b1 {format_time(self.stdev, self.precision)} "
                f"per loop (mean \u00b1 std. dev. of {self.repeat} {runs}, {self.loops:,} {loops} each)")

    def __repr__(self) -> str:
        return f"<TimeitResult : {self}>"
