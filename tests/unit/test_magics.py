"""The IPython adapter with a real (terminal-less) InteractiveShell and a stand-in session: what
the magic hands the session, without starting a job."""

from __future__ import annotations

import re

import pytest

from taas.job.results import CellResult
from taas.magics import TaasMagics
from taas.notebook import cell_number


class _Recorder:
    """Stands in for taas.session.Session: remembers how the cell was handed over."""

    def __init__(self):
        self.calls = []

    def run_cell(self, source, namespace, options, **kwargs):
        self.calls.append(kwargs)
        return CellResult()


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        yield shell
    finally:
        InteractiveShell.clear_instance()


def test_a_cells_traceback_name_is_its_own_prompt_number(shell):
    # IPython 9 counts a cell before running it: the shell's execution_count during the cell is
    # already the next one, and tracebacks said "Cell In[4]" under the prompt [3].
    recorder = _Recorder()
    shell.register_magics(TaasMagics(shell, recorder))
    shell.run_cell("x = 1", store_history=True)
    result = shell.run_cell("%%taas --gpus 2\ny = 2", store_history=True)
    assert result.error_in_exec is None and result.error_before_exec is None, result
    call = recorder.calls[-1]
    assert call["name_for"](call["filename"]) == f"Cell In[{result.execution_count}]"
    # The cell's source is where tracebacks read it from: under that same name.
    assert shell.compile.format_code_name(call["filename"]) == ("Cell", f"In[{result.execution_count}]")


def test_cell_number_is_the_running_cells_prompt(shell):
    shell.run_cell("from taas.notebook import cell_number", store_history=True)
    result = shell.run_cell("seen = cell_number(get_ipython())", store_history=True)
    assert shell.user_ns["seen"] == result.execution_count
    # Outside any cell, the shell's own count.
    assert cell_number(shell) == shell.execution_count


def test_ipython_syntax_in_the_body_reaches_the_session_translated_with_the_cell_as_typed(shell):
    recorder = _Recorder()
    recorder.run_cell = lambda source, namespace, options, **kwargs: (
        recorder.calls.append(dict(kwargs, source=source)) or CellResult())
    shell.register_magics(TaasMagics(shell, recorder))
    body = "x = 1\n%run train.py --steps=3\nfiles = !ls\n!echo a \\\n  b\nlast = 2"
    result = shell.run_cell(f"%%taas --gpus 2\n{body}", store_history=True)
    assert result.error_in_exec is None, result
    call = recorder.calls[-1]
    assert call["text"].rstrip("\n") == body
    lines = call["source"].splitlines()
    # line for line: the continued `!echo` leaves a blank line, so `last` keeps its number
    assert len(lines) == 6 and lines[5] == "last = 2" and lines[4] == ""
    assert lines[1] == "__taas_shell__.run_line_magic('run', 'train.py --steps=3')"


def test_a_pragma_cells_body_is_translated_too(shell):
    from taas.notebook import pragma_transformer

    recorder = _Recorder()
    recorder.run_cell = lambda source, namespace, options, **kwargs: (
        recorder.calls.append(dict(kwargs, source=source)) or CellResult())
    shell.register_magics(TaasMagics(shell, recorder))
    shell.input_transformers_cleanup.insert(0, pragma_transformer)
    try:
        result = shell.run_cell("#pragma taas --gpus 2\nhere = !pwd", store_history=True)
    finally:
        shell.input_transformers_cleanup.remove(pragma_transformer)
    assert result.error_in_exec is None and result.error_before_exec is None, result
    assert recorder.calls[-1]["source"].splitlines() == ["here = __taas_shell__.getoutput('pwd')"]


@pytest.mark.parametrize("body, leading", [("x = 1\n%matplotlib inline", "%matplotlib (line 3)"),
                                           ("%%bash\nls", "%%bash (line 2)")])
def test_a_magic_with_no_meaning_in_a_rank_is_a_usage_error_before_anything_starts(shell, body, leading):
    from IPython.core.error import UsageError

    recorder = _Recorder()
    shell.register_magics(TaasMagics(shell, recorder))
    with pytest.raises(UsageError, match="^" + re.escape(leading)):
        shell.run_cell_magic("taas", "--gpus 2", body)
    assert recorder.calls == []


def test_a_body_without_ipython_syntax_is_handed_over_as_typed():
    from taas.notebook import translate

    body = "\n\nimport torch\nprint(get_ipython())\n"  # leading blank lines keep the numbering
    assert translate(body) == body
