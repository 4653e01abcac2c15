"""taas.job.metrics as data: the value rule, notes once per name, the kernel's history per job
and rank, and the notebook's own rows."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from taas.job import metrics


class Scalar:
    """A numpy-like scalar: item() and size."""

    size = 1

    def __init__(self, value):
        self.value = value

    def item(self):
        return self.value


class Vector:
    shape = (3,)
    size = 3

    def item(self):
        raise ValueError("only one element tensors can be converted")


@pytest.mark.parametrize("value, number", [
    (1.5, 1.5), (3, 3.0), (True, 1.0), (Scalar(2.5), 2.5), (Scalar(7), 7.0), (Fraction(1, 4), 0.25),
])
def test_numbers_are_recorded(value, number):
    assert metrics.scalar(value) == (number, "")


@pytest.mark.parametrize("value, why", [
    (math.nan, "is nan, not a finite number"),
    (math.inf, "is inf, not a finite number"),
    (Scalar(math.nan), "is nan, not a finite number"),
    ([1, 2], "is a list of 2, not a number"),
    ({"a": 1}, "is a dict of 1, not a number"),
    ("0.5", "is a str, not a number"),
    (None, "is None, not a number"),
    (Vector(), "is a Vector of shape (3,), not a number"),
    (object(), "is a object, not a number"),
])
def test_anything_else_is_left_out_with_a_reason(value, why):
    assert metrics.scalar(value) == (None, why)


def test_check_notes_each_bad_name_once_and_keeps_the_good_values():
    said = []
    notes = metrics.Notes(said.append)
    assert metrics.check(4, {"loss": 0.5, "bad": [1], "nan": math.nan}, -1, notes) == (4, {"loss": 0.5})
    assert metrics.check(None, {"loss": 0.4, "bad": [2, 3]}, 4, notes) == (5, {"loss": 0.4})
    assert metrics.check(None, {"bad": [1]}, 5, notes) is None  # nothing left: no row
    assert metrics.check(2.0, {"x": 1}, 5, notes) == (2, {"x": 1.0})
    assert metrics.check(2.5, {"x": 1}, 5, notes) is None
    assert said == [
        "taas: taas.log: 'bad' is a list of 1, not a number: not recorded (the job goes on)",
        "taas: taas.log: 'nan' is nan, not a finite number: not recorded (the job goes on)",
        "taas: taas.log: 'step' is 2.5, not a whole number: not recorded (the job goes on)",
    ]


def test_a_table_keeps_rows_column_by_column():
    table = metrics.Table()
    table.add(0, {"loss": 1.0})
    table.add(1, {"loss": 0.5, "acc": 0.1})
    table.add(2, {"acc": 0.2})
    assert list(table.rows()) == [(0, {"loss": 1.0}), (1, {"loss": 0.5, "acc": 0.1}), (2, {"acc": 0.2})]
    steps, values = table.series("loss")
    assert list(steps) == [0, 1, 2] and values[:2].tolist() == [1.0, 0.5] and math.isnan(values[2])


def test_history_per_job_and_rank():
    history = metrics.History()
    history.add("a", 1, [(0, {"loss": 2.0}), (1, {"loss": 1.5})])
    history.add("a", 0, [(0, {"loss": 1.0}), (1, {"loss": 0.5})])
    history.add("a", None, [(0, {"x": 1.0})])  # not a rank: ignored
    history.add("b", 0, [(0, {"acc": 0.9})])
    history.jobs["c"] = {}  # a job that logged nothing is not "last"
    assert history.rows() == [{"step": 0, "rank": 0, "acc": 0.9}]
    assert history.rows("a") == [
        {"step": 0, "rank": 0, "loss": 1.0}, {"step": 0, "rank": 1, "loss": 2.0},
        {"step": 1, "rank": 0, "loss": 0.5}, {"step": 1, "rank": 1, "loss": 1.5},
    ]
    assert set(history.series("a")) == {"loss"} and list(history.series("a", rank=1)["loss"][1]) == [2.0, 1.5]
    assert history.series("zzz") == {}
    history.notebook.log(3, {"score": 1})
    every = history.rows("all")
    assert every[0] == {"job": None, "step": 3, "rank": None, "score": 1.0}
    assert [row["job"] for row in every[1:]] == ["a"] * 4 + ["b"]
    with pytest.raises(ValueError, match="no job 'zzz'"):
        history.rows("zzz")


def test_notebook_rows_are_last_while_no_job_logged(capsys):
    history = metrics.History()
    history.notebook.log(None, {"a": 1.0})
    history.notebook.log(None, {"a": [1]})
    history.notebook.log(None, {"a": 2.0})
    assert history.rows() == [{"step": 0, "rank": None, "a": 1.0}, {"step": 1, "rank": None, "a": 2.0}]
    assert history.rows("notebook") == history.rows()
    assert capsys.readouterr().err.count("'a' is a list of 1") == 1


def test_log_goes_to_the_installed_recorder_else_the_notebook():
    got = []
    before = len(metrics.HISTORY.notebook)
    metrics.set_recorder(lambda step, scalars: got.append((step, scalars)))
    try:
        metrics.log(step=3, loss=0.5)
    finally:
        metrics.set_recorder(None)
    assert got == [(3, {"loss": 0.5})] and len(metrics.HISTORY.notebook) == before
    metrics.log(loss=0.25)
    assert len(metrics.HISTORY.notebook) == before + 1


def test_frame_is_a_list_without_pandas_else_a_dataframe():
    rows = [{"step": 0, "rank": 0, "loss": 1.0}]
    out = metrics.frame(rows)
    try:
        import pandas  # noqa: F401
    except ImportError:
        assert out == rows
    else:
        assert out.to_dict("records") == rows
