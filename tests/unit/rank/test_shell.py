"""A rank's small shell (taas.rank.shell), in this process: what a taas cell's IPython syntax does
in a rank, without IPython.  The cells are translated as the notebook face translates them."""

from __future__ import annotations

import builtins
import os
import sys

import pytest

from taas.job import syntax
from taas.notebook import translate
from taas.rank import shell

SCRIPT = """\
import sys
seen_argv = list(sys.argv)
seen_name = __name__
seen_path = sys.path[0]
seen_file = __file__
class Config:
    pass
config = Config()
steps = int(sys.argv[1].split("=")[1])
if __name__ == "__main__":
    main_ran = True
"""


@pytest.fixture
def cell(tmp_path, monkeypatch):
    """Run a cell body here as a rank does: translated, the shell installed, exec'd."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # %run puts a script's folder there
    namespace = {"__name__": "__main__", "__builtins__": builtins}

    def run(body: str, **names):
        namespace.update(names)
        shell.install(namespace)
        exec(compile(translate(body), "<cell>", "exec"), namespace)
        return namespace
    return run


def test_run_is_python_script_args(cell, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    argv, path = list(sys.argv), list(sys.path)
    ns = cell("%run train.py --steps={n} extra", n=3)
    assert ns["seen_argv"] == ["train.py", "--steps=3", "extra"] and ns["seen_name"] == "__main__"
    assert ns["seen_path"] == str(tmp_path) and ns["main_ran"] and ns["steps"] == 3
    assert ns["seen_file"] == str(tmp_path / "train.py")
    assert type(ns["config"]).__module__ == "__main__"  # pickled by value, as a script's class
    assert sys.argv == argv and "__file__" not in ns and "__spec__" not in ns  # the script's own
    assert sys.path == [str(tmp_path), *path]  # as in `python train.py`: for the process's life


def test_run_without_py_with_n_and_i(cell, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    ns = cell("%run -n train --steps=2")
    assert ns["seen_name"] == "train" and "main_ran" not in ns and ns["steps"] == 2
    (tmp_path / "reads.py").write_text("doubled = 2 * from_cell\n")
    with pytest.raises(NameError):  # a namespace of its own: the cell's names are not there
        cell("%run reads.py", from_cell=4)
    assert cell("%run -i reads.py")["doubled"] == 8  # -i: in the cell's namespace


def test_run_sys_exit_zero_ends_the_script_not_the_cell(cell, tmp_path):
    (tmp_path / "done.py").write_text("import sys\nbefore = 1\nsys.exit(0)\nafter = 1\n")
    (tmp_path / "fail.py").write_text("import sys\nsys.exit(3)\n")
    ns = cell("%run done.py\nnext_line = True")
    assert ns["before"] == 1 and "after" not in ns and ns["next_line"]
    with pytest.raises(SystemExit):
        cell("%run fail.py")
    cell("%run -e fail.py")


def test_run_a_missing_script_says_where_it_looked(cell, tmp_path):
    with pytest.raises(shell.UsageError, match=f"file 'nope.py' not found in {tmp_path}"):
        cell("%run nope.py")


def test_bang_runs_in_the_ranks_shell_and_captures_lines(cell, tmp_path, capfd):
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("")
    ns = cell("!echo out $n; echo err >&2\nfiles = !ls *.txt\n!!echo captured\nraw = %sx echo {n * 2}\n!exit 3", n=21)
    captured = capfd.readouterr()
    assert "out 21" in captured.out and "err" in captured.err
    assert ns["files"] == ["a.txt", "b.txt"] and isinstance(ns["files"], syntax.SList)
    assert ns["raw"] == ["42"] and ns["_exit_code"] == 3


def test_expansion_reads_a_functions_locals(cell, capfd):
    ns = cell("def f(word):\n    out = !echo {word}\n    return out\nsaid = f('hi')")
    assert ns["said"] == ["hi"]


def test_time_and_timeit(cell, capsys):
    ns = cell("%time y = sum(range(n))\nz = %time sum(range(n))\nt = %timeit -o -q -n 5 -r 2 sum(range(n))", n=10)
    assert ns["y"] == 45 and ns["z"] == 45
    out = capsys.readouterr().out
    assert out.count("CPU times: user ") == 2 and out.count("Wall time: ") == 2
    assert isinstance(ns["t"], syntax.TimeitResult) and ns["t"].loops == 5 and len(ns["t"].all_runs) == 2
    cell("%timeit -n 1 -r 1 pass")
    assert "per loop (mean \u00b1 std. dev. of 1 run, 1 loop each)" in capsys.readouterr().out


def test_env_cd_pwd(cell, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TAAS_TEST_ENV", "before")
    monkeypatch.setenv("TAAS_TEST_TOKEN", "s3cret")
    (tmp_path / "sub").mkdir()
    ns = cell("%env TAAS_TEST_ENV=after\nvalue = %env TAAS_TEST_ENV\nevery = %env\n"
              "%set_env TAAS_TEST_OTHER one two\n%cd sub\nthere = %pwd\n%cd -q -\nback = %pwd")
    assert ns["value"] == "after" and ns["every"]["TAAS_TEST_ENV"] == "after"
    assert ns["every"]["TAAS_TEST_TOKEN"] == "<hidden>"  # as IPython hides likely secrets
    assert os.environ["TAAS_TEST_OTHER"] == "one two"
    monkeypatch.delenv("TAAS_TEST_OTHER")
    assert ns["there"] == str(tmp_path / "sub") and ns["back"] == str(tmp_path)
    assert capsys.readouterr().out.splitlines() == ["env: TAAS_TEST_ENV=after", "env: TAAS_TEST_OTHER=one two",
                                                    str(tmp_path / "sub")]


def test_a_computed_magic_a_rank_has_not_fails_in_the_rank(cell):
    with pytest.raises(shell.UsageError, match="%matplotlib has no meaning in a taas rank"):
        cell("name = 'matplotlib'\nget_ipython().run_line_magic(name, 'inline')")
