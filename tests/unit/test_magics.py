"""The IPython adapter with a real (terminal-less) InteractiveShell and a stand-in session: what
the magic hands the session, without starting a job."""

from __future__ import annotations

import pytest

from taas.job.results import CellResult
from taas.magics import TaasMagics, cell_number


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
    shell.run_cell("from taas.magics import cell_number", store_history=True)
    result = shell.run_cell("seen = cell_number(get_ipython())", store_history=True)
    assert shell.user_ns["seen"] == result.execution_count
    # Outside any cell, the shell's own count.
    assert cell_number(shell) == shell.execution_count
