"""taas.rank.display: rank 0's ``display()`` as a MIME bundle on the events pipe, by the
formatter the notebook named (or the object's repr without one)."""

from __future__ import annotations

import json
import os

import pytest

from taas.rank import display

IPYTHON = "IPython.core.formatters:DisplayFormatter"  # what taas.magics names for the ranks


class Rich:
    def _repr_html_(self):
        return "<b>rich</b>"

    def __repr__(self):
        return "Rich()"


class Broken:
    def __repr__(self):
        return "Broken()"


class RaisingFormatter:
    """A formatter that fails on everything (a user's ``_repr_*_`` may raise anything)."""

    def format(self, obj):
        raise RuntimeError("no")


class BytesFormatter:
    """A formatter whose bundle has a value that is not a string (JSON could not carry it)."""

    def format(self, obj):
        return {"text/plain": "plain", "image/png": b"\x89PNG"}, {"image/png": {"width": 2}}


def named(cls) -> str:
    return f"{__name__}:{cls.__name__}"


def test_without_a_formatter_the_bundle_is_the_repr():
    assert display.format_bundle(Rich(), None) == ({"text/plain": "Rich()"}, {})


def test_ipythons_formatter_gives_the_notebooks_bundle():
    data, metadata = display.format_bundle(Rich(), IPYTHON)
    assert data == {"text/plain": "Rich()", "text/html": "<b>rich</b>"}
    assert metadata == {}


@pytest.mark.parametrize("formatter", [named(RaisingFormatter), "no_such_module_here:Formatter",
                                       f"{__name__}:NoSuchFactory"])
def test_a_formatter_that_fails_or_is_missing_falls_back_to_the_repr(formatter):
    assert display.format_bundle(Broken(), formatter) == ({"text/plain": "Broken()"}, {})


def test_values_that_are_not_strings_are_left_out():
    data, metadata = display.format_bundle(object(), named(BytesFormatter))
    assert data == {"text/plain": "plain"}
    assert metadata == {"image/png": {"width": 2}}


@pytest.fixture
def events_pipe(monkeypatch):
    """The events pipe as a launched process has it; restores what ``install`` set."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    monkeypatch.setenv("TAAS_EVENTS_FD", str(write_end))
    monkeypatch.setattr(display, "_rank", display._rank)
    monkeypatch.setattr(display, "_formatter", display._formatter)
    yield read_end
    os.close(read_end)
    os.close(write_end)


def sent(read_end) -> list[dict]:
    try:
        return [json.loads(line) for line in os.read(read_end, 1 << 20).decode().splitlines()]
    except BlockingIOError:
        return []


def test_rank_zero_sends_each_object_formatted_by_the_installed_formatter(events_pipe, capsys):
    display.install(0, IPYTHON)
    display.display(Rich(), 42)
    assert sent(events_pipe) == [
        {"kind": "display", "data": {"text/plain": "Rich()", "text/html": "<b>rich</b>"}, "metadata": {}},
        {"kind": "display", "data": {"text/plain": "42"}, "metadata": {}},
    ]
    assert capsys.readouterr().out == ""


def test_other_ranks_print_the_repr_and_send_nothing(events_pipe, capsys):
    display.install(1, IPYTHON)
    display.display(Rich(), "two")
    assert sent(events_pipe) == []
    assert capsys.readouterr().out == "Rich()\n'two'\n"
