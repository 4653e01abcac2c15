"""IPython syntax in a taas cell, as data (taas.job.syntax): the calls IPython's transformers
make go to the rank's shell, a magic a rank cannot run is refused naming it, and the analysis
sees what a magic's line reads and binds."""

from __future__ import annotations

import ast
import pickle

import pytest

from taas.errors import DirectiveError
from taas.job import analysis, syntax

S = syntax.SHELL


@pytest.mark.parametrize("source, routed", [
    ("get_ipython().run_line_magic('run', 'train.py --steps=3')\n",
     f"{S}.run_line_magic('run', 'train.py --steps=3')\n"),
    ("files = get_ipython().getoutput('ls data')\n", f"files = {S}.getoutput('ls data')\n"),
    ("def f():\n    get_ipython().system('ls')\n", f"def f():\n    {S}.system('ls')\n"),
    # get_ipython() alone stays None in a rank (libraries ask it whether they run in a notebook)
    ("shell = get_ipython()\nprint(get_ipython() is None)\n", None),
    ("print('get_ipython().system(1)')\n", None),  # in a string: not a call
    ("x = (\n", None),  # not Python: compiling it says so
])
def test_route_sends_the_transformers_calls_to_the_ranks_shell(source, routed):
    assert syntax.route(source) == (source if routed is None else routed)


@pytest.mark.parametrize("call, named", [
    ("run_line_magic('matplotlib', 'inline')", "%matplotlib (line 4)"),
    ("run_line_magic('load_ext', 'autoreload')", "%load_ext (line 4)"),
    ("run_line_magic('debug', '')", "%debug (line 4)"),
    ("run_line_magic('pdb', 'on')", "%pdb (line 4)"),
    ("run_line_magic('who', '')", "%who (line 4)"),
    ("run_line_magic('pinfo', 'x')", "%pinfo (line 4)"),
    ("run_line_magic('%time', '')", "%%time (line 4)"),  # a cell magic's line further down
    ("run_cell_magic('bash', '', 'ls\\n')", "%%bash (line 4)"),
    ("run_line_magic('run', '-d train.py')", "%run (line 4): -d is not supported"),
    ("run_line_magic('run', '')", "%run (line 4): a script to run is missing"),
])
def test_a_magic_a_rank_cannot_run_is_one_line_naming_it(call, named):
    with pytest.raises(DirectiveError) as raised:
        syntax.route(f"x = 1\n\nget_ipython().{call}\n", first_line=2)
    assert str(raised.value).startswith(named) and "\n" not in str(raised.value)


@pytest.mark.parametrize("magic", syntax.LINE_MAGICS)
def test_every_magic_a_rank_has_passes(magic):
    line = "train.py" if magic == "run" else "x"
    assert S in syntax.route(f"get_ipython().run_line_magic({magic!r}, {line!r})\n")


@pytest.mark.parametrize("cell, free, bound", [
    (f"{S}.run_line_magic('run', 'train.py --lr={{lr}} --out=$out')\n", {"lr", "out"}, ()),
    (f"files = {S}.getoutput('ls {{folder}}')\n", {"folder"}, ("files",)),
    (f"{S}.system('echo $$HOME $n.real')\n", {"n"}, ()),  # $$: a literal $
    (f"{S}.system(\"echo '$quoted'\")\n", set(), ()),  # in single quotes: not expanded
    (f"{S}.run_line_magic('time', 'model = build(cfg)')\nmodel.eval()\n", {"build", "cfg"}, ("model",)),
    (f"t = {S}.run_line_magic('timeit', '-n 3 -r 2 step(x)')\n", {"step", "x"}, ("t",)),
    (f"y = {S}.run_line_magic('time', 'f(x)')\n", {"f", "x"}, ("y",)),
    (f"{S}.run_line_magic('timeit', 'z = f(x)')\n", {"f", "x", "z"}, ()),  # timeit binds nothing here
])
def test_the_analysis_sees_what_a_magics_line_reads_and_binds(cell, free, bound):
    found = analysis.analyse(cell)
    assert found.free - {S} == free and found.bound == bound


@pytest.mark.parametrize("text, expanded", [
    ("echo {n + 1} $name", "echo 3 ada"),
    ("echo $$name", "echo $name"),
    ("echo '$name'", "echo '$name'"),
    ("echo $HOME", "echo $HOME"),  # no Python HOME: the text as it is, for the shell
    ("echo {unbalanced", "echo {unbalanced"),
    ("plain text", "plain text"),
])
def test_expansion_is_ipythons(text, expanded):
    scope = {"n": 2, "name": "ada"}
    assert syntax.expand(text, lambda expr: eval(expr, scope)) == expanded


@pytest.mark.parametrize("line, args", [
    ("train.py --steps=3 a b", syntax.RunArgs("train.py", ("--steps=3", "a", "b"))),
    ("-i -n t.py", syntax.RunArgs("t.py", (), interactive=True, not_main=True)),
    ("-e -G t.py '*.txt'", syntax.RunArgs("t.py", ("*.txt",), exit_ignore=True, no_glob=True)),
    ("-m pkg.mod --x 1", syntax.RunArgs("pkg.mod", ("--x", "1"), module=True)),
])
def test_run_lines(line, args):
    assert syntax.parse_run(line) == args


@pytest.mark.parametrize("line, why", [("", "missing"), ("-p t.py", "-p is not supported"),
                                       ("-m", "-m takes"), ("'open", "cannot split")])
def test_bad_run_lines(line, why):
    with pytest.raises(ValueError, match=why):
        syntax.parse_run(line)


def test_timeit_options_and_code():
    assert syntax.split_timeit("-n 10 -r2 -q -o f(x) - 1") == ({"n": "10", "r": "2", "q": "", "o": ""}, "f(x) - 1")
    assert syntax.split_timeit("f(-x)") == ({}, "f(-x)")


def test_slist_is_a_list_with_ipythons_views_and_travels():
    lines = syntax.SList(["a.py", "b.txt", "c.py"])
    assert lines == ["a.py", "b.txt", "c.py"] and isinstance(lines, list)
    assert lines.s == "a.py b.txt c.py" and lines.n == "a.py\nb.txt\nc.py" and type(lines.l) is list
    assert lines.grep(r"\.py$") == ["a.py", "c.py"] and lines.grep("py", prune=True) == ["b.txt"]
    back = pickle.loads(pickle.dumps(lines))
    assert type(back) is syntax.SList and back == lines


@pytest.mark.parametrize("seconds, shown", [(1.5, "1.5 s"), (0.00123, "1.23 ms"), (2e-6, "2 \u00b5s"),
                                            (0.0, "0 ns"), (125.0, "2min 5s")])
def test_times_read_as_ipythons(seconds, shown):
    assert syntax.format_time(seconds) == shown


def test_timeit_result_says_mean_and_spread():
    result = syntax.TimeitResult(loops=1000, repeat=2, all_runs=(1e-6, 3e-6))
    assert result.average == pytest.approx(2e-6) and result.best == 1e-6 and result.worst == 3e-6
    assert str(result) == "2 \u00b5s \u00b1 1 \u00b5s per loop (mean \u00b1 std. dev. of 2 runs, 1,000 loops each)"


def test_unfold_keeps_the_statements_line():
    tree = syntax.unfold(ast.parse(f"x = 1\n{S}.run_line_magic('time', 'y = x + 1')\n"))
    assert [type(s).__name__ for s in tree.body] == ["Assign", "Assign"] and tree.body[1].lineno == 2
