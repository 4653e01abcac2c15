"""Which notebook values travel: selection and shipping, as data."""

import socket

import pytest

from taas.errors import PackagingError
from taas.job import package


@pytest.mark.parametrize("name, travels", [
    ("model", True),
    ("_items", True),       # a user's name that merely starts with _i
    ("_internal", True),
    ("_i", False), ("_ii", False), ("_iii", False), ("_i12", False),  # input history
    ("_7", False), ("_", False), ("__", False),                      # output history
    ("In", False), ("Out", False),
    # IPython's exit/quit/get_ipython are hidden names in a kernel; where one is read it
    # crosses as its plain-Python meaning (taas.job.crossing), so the name itself may travel.
    ("get_ipython", True), ("exit", True),
])
def test_select_skips_only_ipython_names(name, travels):
    assert (name in package.select({name}, {name: 1})) is travels


def test_select_skips_hidden_and_missing_names():
    assert package.select({"a", "b", "c"}, {"a": 1, "b": 2}, hidden={"b"}) == {"a": 1}


def test_ship_names_the_unshippable_value_behind_a_function():
    conn = socket.socket()
    try:
        namespace = {"conn": conn}
        exec("def send():\n    return conn", namespace)
        namespace["send"].__module__ = "__main__"
        with pytest.raises(PackagingError, match=r"`send -> conn` \(socket\.socket\)"):
            package.ship({"send": namespace["send"]})
    finally:
        conn.close()


@pytest.mark.parametrize("chain, advice", [
    (["sock"], "Create it inside the taas cell instead."),
    (["train", "sock"], "`train` reads the notebook global `sock`, which travels with it: create `sock` "
                        "inside `train`, or in the taas cell and pass it to `train` as an argument."),
    (["main", "helper", "lock"], "`helper` reads the notebook global `lock`"),
])
def test_unshippable_advice_fits_where_the_value_is(chain, advice):
    assert package._advice(chain).startswith(advice)
