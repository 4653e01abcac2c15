"""What every job of a cell starts from (taas.cellrun.read_cell): a cell run again is not
compiled or analysed again, and a syntax error still names the cell of each run."""

from __future__ import annotations

import pytest

from taas import cellrun
from taas.errors import CellSyntaxError
from taas.job import analysis


def test_a_syntax_error_names_the_cell_of_each_run_however_often_it_runs():
    source = "x = 1\ny = (\n"
    for number in (7, 8):  # the same text, run again: IPython gives it a new file name each time
        with pytest.raises(CellSyntaxError) as info:
            cellrun.read_cell(source, {}, f"<cell {number}>", 2, name_for=lambda name: f"Cell In[{name[6]}]")
        assert f"Cell In[{number}], line 3" in "\n".join(info.value.rendered)


def test_a_cell_run_again_reads_the_notebook_values_of_each_run():
    source = "y = x + 1\n"
    cell, values = cellrun.read_cell(source, {"x": 1, "z": 2}, "<cell 1>", 2)
    again, values_again = cellrun.read_cell(source, {"x": 5}, "<cell 2>", 2)
    assert again is cell  # the analysis, remembered: the same frozen value
    assert values == {"x": 1} and values_again == {"x": 5}
    assert cell.free >= {"x"} and cell.bound == ("y",)


def test_the_analysis_of_a_source_is_remembered_and_a_syntax_error_is_not():
    assert analysis.analyse("a = b\n") is analysis.analyse("a = b\n")
    for _ in range(2):
        with pytest.raises(SyntaxError):
            analysis.analyse("a = (\n")
