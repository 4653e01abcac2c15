"""A rank's console (taas.rank.console) in this process: what reads a terminal asks the
notebook instead -- here a scripted stand-in for taas.launch.process.stdin.ask."""

from __future__ import annotations

import bdb
import builtins
import getpass
import pdb  # noqa: T100 (what the rank's console replaces)
import sys

import pytest

from taas.launch.process import stdin
from taas.rank import console, heartbeat


class _Asked(list):
    """What was asked, in order; ``replies``: the answers still to give."""

    def __init__(self):
        super().__init__()
        self.replies: list = []


@pytest.fixture
def asked(monkeypatch):
    """Install the console as rank 1 (everything it replaces restored afterwards); the list of
    (prompt, debugger, post_mortem, heartbeat state) asked, answered from ``asked.replies``."""
    for owner, name in ((builtins, "input"), (getpass, "getpass"), (sys, "breakpointhook"), (pdb, "set_trace")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.setattr(console, "_last_failure", [])
    log = _Asked()
    replies = log.replies

    def ask(prompt, *, password=False, debugger=False, post_mortem=False):
        log.append((prompt, debugger, post_mortem, heartbeat._prompt[-1]))
        reply = replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    monkeypatch.setattr(stdin, "ask", ask)
    monkeypatch.delenv("PYTHONBREAKPOINT", raising=False)
    console.install(1)
    yield log
    sys.settrace(None)


def test_input_asks_with_the_rank_tagged_prompt(asked):
    asked.replies[:] = ["Ada"]
    assert input("name? ") == "Ada"
    assert asked == [("[rank1] name? ", False, False, "input")]


def _stops_here():
    v = 41
    breakpoint()  # noqa: T100 (what is tested)
    v += 1
    return v


def test_breakpoint_opens_pdb_at_the_next_line_and_c_goes_on(asked, capsys):
    asked.replies[:] = ["p v", "n", "p v", "c"]
    assert _stops_here() == 42
    assert [a[0] for a in asked] == ["(Pdb) [rank1] "] * 4
    assert all(a[1] and not a[2] and a[3] == "debugger" for a in asked)
    out = capsys.readouterr().out
    assert "-> v += 1" in out and "-> return v" in out  # where it stopped, then after n
    assert out.index("\n41\n") < out.index("-> return v") < out.index("\n42\n")  # p v, n, p v
    assert not heartbeat._prompt  # the beats say running again


@pytest.mark.parametrize("reply", ["q", KeyboardInterrupt()])
def test_q_or_an_interrupt_at_the_prompt_leaves_the_cell(asked, reply):
    asked.replies[:] = [reply]
    with pytest.raises(bdb.BdbQuit) as left:
        _stops_here()
    assert console.quitting(left.value)
    console.remember(left.value)
    assert console._last_failure == []  # leaving the debugger is no failure to debug later


def test_post_mortem_opens_at_the_frame_that_raised_and_a_kept_rank_remembers_it(asked, capsys):
    def inverse(x):
        return 1 / x

    try:
        inverse(0)
    except ZeroDivisionError as exc:
        console.remember(exc)
    asked.replies[:] = ["p x", "q"]
    console.debug_last(0)  # another rank's: nothing asked
    assert asked == []
    console.debug_last(1)
    assert [a[2] for a in asked] == [True, True]
    out = capsys.readouterr().out
    assert "ZeroDivisionError: division by zero" in out and "return 1 / x" in out and "\n0\n" in out


def test_end_of_input_leaves_the_debugger_and_input_raises_it(asked):
    asked.replies[:] = [EOFError(), EOFError()]
    with pytest.raises(bdb.BdbQuit):
        _stops_here()
    with pytest.raises(EOFError):
        input()
