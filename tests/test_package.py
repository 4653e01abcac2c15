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
    ("In", False), ("Out", False), ("get_ipython", False),
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
