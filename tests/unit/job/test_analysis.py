"""taas.job.analysis: the names a cell reads and binds; compiling it for the ranks."""

from __future__ import annotations

import textwrap
import traceback

import pytest

from taas.job.analysis import CellAnalysis, analyse, compile_cell

# (id, cell source, free names, bound names in first-binding order, has_last_expr)
CASES = [
    ("simple-read", "y + 1", {"y"}, (), True),
    ("builtins-are-not-filtered", "print(len(xs))", {"print", "len", "xs"}, (), True),
    ("read-after-assignment", "x = y + 1\nx * 2", {"y"}, ("x",), True),
    ("read-before-assignment", "z = x\nx = 1", {"x"}, ("z", "x"), False),
    ("self-referencing-assignment", "x = x + 1", {"x"}, ("x",), False),
    ("augmented-assignment-reads", "x += 1", {"x"}, ("x",), False),
    ("augmented-after-assignment", "x = 0\nx += 1", set(), ("x",), False),
    ("attribute-and-subscript-targets", "a.b = 1\nd[k] = v", {"a", "d", "k", "v"}, (), False),
    ("function-body-reads-global", "def f():\n    return g + 1\nf()", {"g"}, ("f",), True),
    ("function-body-after-binding", "g = 1\ndef f():\n    return g", set(), ("g", "f"), False),
    ("function-parameter-shadows",
     "def f(a, *args, b, **kw):\n    c = 1\n    return a, args, b, kw, c",
     set(), ("f",), False),
    ("closure-variable-not-free",
     "def f():\n    x = 1\n    def g():\n        return x + h\n    return g",
     {"h"}, ("f",), False),
    ("decorator-defaults-annotations", "@deco(k)\ndef f(x: T = v, *, y=w) -> R:\n    pass",
     {"deco", "k", "T", "v", "w", "R"}, ("f",), False),
    ("recursive-function", "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)\nfact(5)",
     set(), ("fact",), True),
    ("class-body", "class A(Base, metaclass=M):\n    n = 2\n    m = n * k\n    def meth(self):\n"
     "        return n + self.m\nA()", {"Base", "M", "k", "n"}, ("A",), True),
    ("method-reads-module-name",
     "g = 1\nclass A:\n    g = 2\n    def m(self):\n        return g, h",
     {"h"}, ("g", "A"), False),
    ("class-comprehension-scopes",
     "class A:\n    r = [1]\n    s = [i * r0 for i in r]", {"r0"}, ("A",), False),
    ("nested-class-skips-outer-class",
     "class A:\n    n = 1\n    class B:\n        m = n", {"n"}, ("A",), False),
    ("class-level-global", "class A:\n    global G\n    G = 1", set(), ("A", "G"), False),
    ("class-body-reads-global-first", "class A:\n    x = x", {"x"}, ("A",), False),
    ("class-body-does-not-bind-module", "class A:\n    q = 1\nq", {"q"}, ("A",), True),
    ("lambda", "f = lambda a, b=d: a + b + e", {"d", "e"}, ("f",), False),
    ("comprehension-vars-not-free", "[i * k for i in items if i]", {"k", "items"}, (), True),
    ("nested-comprehension",
     "{(i, j) for i in rows for j in i if j > lim}", {"rows", "lim"}, (), True),
    ("dict-and-generator-comprehension", "d = {k: v for k, v in pairs}\ns = sum(x for x in d)",
     {"pairs", "sum"}, ("d", "s"), False),
    ("comprehension-iterable-bound-first", "items = load()\n[i for i in items]",
     {"load"}, ("items",), True),
    ("conditional-assignment-then-read", "if c:\n    x = 1\nx", {"c", "x"}, ("x",), True),
    ("if-else-still-not-definite",
     "if c:\n    x = 1\nelse:\n    x = 2\nx", {"c", "x"}, ("x",), True),
    ("read-inside-branch-after-binding",
     "if c:\n    x = 1\n    print(x)", {"c", "print"}, ("x",), False),
    ("while-binding",
     "while n:\n    n = step(n)\n    r = n\nr", {"n", "step", "r"}, ("n", "r"), True),
    ("try-except-binding",
     "try:\n    import torch\nexcept ImportError as e:\n    err = e\ntorch, err",
     {"ImportError", "torch", "err"}, ("torch", "e", "err"), True),
    ("import-binds", "import numpy as np\nimport os.path\nfrom a.b import c, d as e\nnp, os, c, e",
     set(), ("np", "os", "c", "e"), True),
    ("star-import-binds-nothing", "from m import *\nx", {"x"}, (), True),
    ("with-binds-definitely", "with open(p) as f:\n    data = f.read()\nprint(data)",
     {"open", "p", "print"}, ("f", "data"), True),
    ("with-tuple-target", "with ctx() as (a, b):\n    pass\na + b", {"ctx"}, ("a", "b"), True),
    ("for-target-not-definite", "for i in range(n):\n    last = i\nprint(i, last)",
     {"range", "n", "print", "i", "last"}, ("i", "last"), True),
    ("for-target-bound-in-body", "for i in r:\n    print(i)", {"r", "print"}, ("i",), False),
    ("walrus", "if (m := match(s)):\n    print(m)\nm", {"match", "s", "print"}, ("m",), True),
    ("walrus-within-statement", "x = (y := f()) + y", {"f"}, ("x", "y"), False),
    ("walrus-in-comprehension", "[last := v for v in r]\nlast", {"r", "last"}, ("last",), True),
    ("walrus-in-lambda-comprehension", "f = lambda: [y := v for v in r]", {"r"}, ("f",), False),
    ("global-in-function", "def setup():\n    global model\n    model = build()\nsetup()\nmodel",
     {"build", "model"}, ("setup", "model"), True),
    ("global-read-in-function", "def f():\n    global G\n    return G", {"G"}, ("f",), False),
    ("tuple-unpacking", "a, (b, *c) = t\n[d, e] = a, b\nprint(a, b, c, d, e)",
     {"t", "print"}, ("a", "b", "c", "d", "e"), True),
    ("chained-assignment", "a = b = f()\na + b", {"f"}, ("a", "b"), True),
    ("del-reads", "del x", {"x"}, (), False),
    ("del-after-binding-then-read", "x = 1\ndel x\nx", {"x"}, ("x",), True),
    ("annotation-without-value", "x: int\nx", {"int", "x"}, (), True),
    ("annotation-with-value", "x: int = 3\nx", {"int"}, ("x",), True),
    ("match", "match p:\n    case Point(x=0, y=yy) if yy > lim:\n        q = yy\n"
     "    case {'k': v, **rest}:\n        pass\n    case [a, *bs]:\n        pass\nq",
     {"p", "Point", "lim", "q"}, ("yy", "q", "v", "rest", "a", "bs"), True),
    ("top-level-await", "async def f():\n    return g\nawait f()", {"g"}, ("f",), True),
    ("empty-cell", "", set(), (), False),
    ("comment-only", "# nothing here\n", set(), (), False),
    ("last-is-assignment", "x = 1", set(), ("x",), False),
    ("datasphere-style", textwrap.dedent("""\
        import torch
        import torch.distributed as dist

        def main():
            dist.init_process_group("nccl")
            model = Net().to(device)
            for epoch in range(epochs):
                train(model, loader, lr=lr)
            return model

        net = main()
        """), {"Net", "device", "range", "epochs", "train", "loader", "lr"},
     ("torch", "dist", "main", "net"), False),
]


@pytest.mark.parametrize(
    ("source", "free", "bound", "has_last_expr"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_analyse(source, free, bound, has_last_expr):
    assert analyse(source) == CellAnalysis(frozenset(free), bound, has_last_expr)


@pytest.mark.parametrize("source", ["x = = 1", "def f(:\n    pass", "for\n"])
def test_syntax_error_propagates(source):
    with pytest.raises(SyntaxError):
        analyse(source)


def test_analysis_is_frozen():
    result = analyse("x = 1")
    with pytest.raises(AttributeError):
        result.free = frozenset()  # type: ignore[misc]


# (id, source, first_line, line of the statement that raises, relative to the source's line 1)
RAISING = [
    ("first-line-1", "x = 1\nraise ValueError(x)", 1, 2),
    ("shifted", "x = 1\n\nraise ValueError(x)", 10, 3),
    ("inside-function", "def f():\n    return 1 / 0\n\nf()", 7, 2),
    ("in-last-expression", "a = 1\n1 / 0", 42, 2),
]


def _run(source: str, filename: str, first_line: int):
    body, last = compile_cell(source, filename, first_line)
    namespace: dict = {}
    exec(body, namespace)
    return None if last is None else eval(last, namespace)


@pytest.mark.parametrize(
    ("source", "first_line", "line"), [pytest.param(*c[1:], id=c[0]) for c in RAISING]
)
def test_compile_cell_traceback_lines(source, first_line, line):
    filename = "<taas cell 3>"
    with pytest.raises((ValueError, ZeroDivisionError)) as info:
        _run(source, filename, first_line)
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno) == (filename, first_line - 1 + line)


# (id, source, value of the cell: the last expression's, or None when there is none)
RESULTS = [
    ("last-expression", "x = 20\nx + 1", 21),
    ("only-expression", "6 * 7", 42),
    ("no-last-expression", "x = 20", None),
    ("expression-then-assignment", "1 + 1\ny = 2", None),
    ("compound-last", "if True:\n    z = 5", None),
    ("empty", "", None),
]


@pytest.mark.parametrize(("source", "value"), [pytest.param(*c[1:], id=c[0]) for c in RESULTS])
def test_compile_cell_last_expression(source, value):
    body, last = compile_cell(source, "<cell>", 1)
    assert (last is None) == (value is None) == (not analyse(source).has_last_expr)
    assert _run(source, "<cell>", 1) == value


def test_compile_cell_body_runs_without_last_expression():
    body, last = compile_cell("calls.append(1)\ncalls.append(2)", "<cell>", 5)
    namespace = {"calls": []}
    exec(body, namespace)
    assert namespace["calls"] == [1]  # the trailing expression is not part of the body
    assert eval(last, namespace) is None and namespace["calls"] == [1, 2]
    assert body.co_filename == last.co_filename == "<cell>"


def test_compile_cell_syntax_error_propagates():
    with pytest.raises(SyntaxError):
        compile_cell("x = = 1", "<cell>", 1)


def test_a_cell_run_again_is_compiled_once_per_place():
    """Kept ranks run a notebook's cells again and again: the same cell at the same place is
    the same code (compiled once); another file name or first line is compiled anew."""
    source = "x = 1\nx + 1\n"
    first = compile_cell(source, "<cell-a>", 3)
    assert compile_cell(source, "<cell-a>", 3) is first
    other_file, other_line = compile_cell(source, "<cell-b>", 3), compile_cell(source, "<cell-a>", 4)
    def top(code):  # the first line the code runs
        return min(line for _, _, line in code.co_lines() if line)

    assert other_file[0].co_filename == "<cell-b>" and top(other_line[0]) == 4
    assert top(first[0]) == 3 and first[0] is not other_line[0]
    with pytest.raises(SyntaxError):  # an error is never remembered as a result
        compile_cell("x = (\n", "<cell-a>", 1)
    with pytest.raises(SyntaxError):
        compile_cell("x = (\n", "<cell-a>", 1)
