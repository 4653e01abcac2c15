"""A rank's console: ``input()`` and the debugger read the notebook's input box.

A rank has no terminal.  :func:`install` makes what reads one ask the kernel instead
(:func:`taas.launch.process.stdin.ask`: an ``ask`` event; the kernel's answer on the rank's
FIFO), the prompt tagged with the rank:

    input("name? ")                          -> the input box shows "[rank1] name? "
    getpass.getpass()                        -> the same, hidden
    breakpoint(), pdb.set_trace()            -> :class:`RankPdb` at the caller's line,
    torch.distributed.breakpoint(rank=R)        prompt "(Pdb) [rank1] " (on rank R only; every
                                                rank then passes a barrier, as torch's does)
    the cell raised, with IPython's %pdb on   -> :func:`post_mortem` at the frame that raised
    %taas debug on kept ranks                 -> :func:`debug_last`: the same, later

While the rank waits at a prompt its heartbeat says ``debugger`` (or ``input``): the panel shows
it and the kernel's stall doctor leaves it alone.  The other ranks wait where they are (in their
next collective): the group timeout is long when the job has no ``--timeout`` (taas.wiring).

``q`` in the debugger raises :class:`bdb.BdbQuit` out of the cell: the rank reports
:data:`QUIT` and the job stops (a kept rank's cell fails and the ranks stay).  An interrupt at
the prompt does the same (pdb's own asks again instead).  Where the front end does not allow
stdin, ``input()`` raises :class:`~taas.launch.process.stdin.StdinUnavailable`, one line.
"""

from __future__ import annotations

import bdb
import builtins
import getpass
import os
import pdb  # noqa: T100 (the rank's debugger is what this module gives)
import sys
import threading
import traceback
from types import TracebackType

from taas.launch.process import stdin
from taas.rank import heartbeat

QUIT = "left the debugger (q): the job was stopped"
QUIT_KEPT = "left the debugger (q)"
_rank = [0]
_in_pdb = threading.local()  # set while RankPdb reads a command (its input() is pdb's prompt)
_last_failure: list[BaseException] = []  # a kept rank's last cell exception (%taas debug)
_skips: dict[str, int] = {}  # torch.distributed.breakpoint(skip=N): calls seen per call site


def install(rank: int) -> None:
    """From now on, this process's ``input()``, ``getpass``, ``breakpoint()``, ``pdb.set_trace``
    and ``torch.distributed.breakpoint`` ask the notebook (rank ``rank``)."""
    _rank[0] = rank
    builtins.input = rank_input
    getpass.getpass = rank_getpass
    sys.breakpointhook = breakpointhook
    pdb.set_trace = set_trace
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        dist.breakpoint = dist_breakpoint


def _ask(prompt: str, password: bool = False) -> str:
    debugger = bool(getattr(_in_pdb, "on", False))
    with heartbeat.prompting("debugger" if debugger else "input"):
        return stdin.ask(prompt if debugger else f"[rank{_rank[0]}] {prompt}", password=password,
                         debugger=debugger, post_mortem=bool(getattr(_in_pdb, "post_mortem", False)))


def rank_input(prompt: object = "") -> str:
    """``input()`` in a rank: a line from the notebook's input box."""
    return _ask(str(prompt))


def rank_getpass(prompt: str = "Password: ", stream=None) -> str:
    return _ask(prompt, password=True)


class RankPdb(pdb.Pdb):
    """pdb reading the notebook's input box (its ``input()`` is :func:`rank_input`), prompt
    tagged with the rank; taas's own frames are never stepped into."""

    def __init__(self, post_mortem: bool = False) -> None:
        super().__init__(skip=["taas.*"])
        self.prompt = f"(Pdb) [rank{_rank[0]}] "
        self.post_mortem = post_mortem

    def _cmdloop(self) -> None:
        # pdb's own turns a Ctrl-C at the prompt into "--KeyboardInterrupt--" and asks again:
        # an interrupt of the kernel at the prompt must leave the debugger, as q does.
        _in_pdb.on, _in_pdb.post_mortem = True, self.post_mortem
        try:
            self.allow_kbdint = True
            self.cmdloop()
        except KeyboardInterrupt:
            self.message("--KeyboardInterrupt--")
            self.set_quit()
        finally:
            self.allow_kbdint = False
            _in_pdb.on = _in_pdb.post_mortem = False


def set_trace(*, header: str | None = None) -> None:
    """``pdb.set_trace()`` in a rank: the debugger at the caller's next line."""
    debugger = RankPdb()
    if header is not None:
        debugger.message(header)
    debugger.set_trace(sys._getframe().f_back)


def breakpointhook(*args, **kwargs) -> None:
    """``breakpoint()`` in a rank (``PYTHONBREAKPOINT=0`` still turns it off)."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    RankPdb().set_trace(sys._getframe().f_back)


def dist_breakpoint(rank: int = 0, skip: int = 0, timeout_s: float | None = 3600) -> None:
    """``torch.distributed.breakpoint(rank=R)`` in a rank: the debugger on rank R at the
    caller's next line; every rank passes a barrier (as torch's does), so the others wait in
    their next collective until R goes on."""
    import datetime

    import torch.distributed as dist

    caller = sys._getframe().f_back
    if skip > 0 and caller is not None:
        site = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        _skips[site] = _skips.get(site, 0) + 1
        if _skips[site] <= skip:
            return
    if timeout_s is not None:  # as torch's: the group's timeout must not cut the session short
        from torch.distributed import distributed_c10d

        set_timeout = getattr(distributed_c10d, "set_timeout", None) or distributed_c10d._set_pg_timeout
        for group in list(distributed_c10d._pg_map):
            set_timeout(datetime.timedelta(seconds=timeout_s), group)
    if dist.get_rank() == rank:
        RankPdb().set_trace(caller)  # stops at the caller's next line, after the barrier
    dist.barrier()


def post_mortem(exc: BaseException) -> None:
    """The debugger at the frame that raised ``exc`` (IPython's ``%pdb on``, ``%taas debug``);
    returns when the user leaves it (``q``, ``c``, an interrupt, end of input)."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_next is not None and _taas_frame(tb):
        tb = tb.tb_next  # start in the cell, not in taas's frames that ran it
    debugger = RankPdb(post_mortem=True)
    debugger.reset()
    debugger.message("".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n"))
    debugger.message(f"taas: post-mortem on rank{_rank[0]} at the frame that raised; q leaves it")
    try:
        debugger.interaction(None, tb)
    except bdb.BdbQuit:
        pass


def _taas_frame(tb: TracebackType) -> bool:
    return str(tb.tb_frame.f_globals.get("__name__", "")).startswith("taas.")


def quitting(exc: BaseException) -> bool:
    """``exc`` is the user leaving the debugger (``q``)."""
    return isinstance(exc, bdb.BdbQuit)


def remember(exc: BaseException) -> None:
    """A kept rank's cell raised ``exc``: ``%taas debug`` opens it later."""
    _last_failure[:] = [] if quitting(exc) else [exc]


def debug_last(rank: int) -> None:
    """``%taas debug RANK``, run as a cell on every kept rank: rank ``rank`` opens the debugger
    at the frame its last failed cell raised in; the others (and a rank with no failure, which
    says so) return at once.  Leaving it keeps the ranks and their state."""
    if _rank[0] != rank:
        return
    if not _last_failure:
        print(f"taas: rank{rank} has no failed cell to debug", file=sys.stderr)
        return
    post_mortem(_last_failure[0])
