"""Keep a Ctrl-C / kernel interrupt from landing in the middle of a step that must not be cut.

A KeyboardInterrupt raised half-way through ``import torch`` leaves half-initialised modules in
``sys.modules`` (the next import crashes the interpreter or raises ``SystemError: bad call
flags``); one raised between two messages of a protocol desynchronises it.  Inside
:func:`deferred_interrupt` a SIGINT is only noted; it is raised as KeyboardInterrupt when the
block ends, so the interrupt still happens, just at a safe point.

Only the main thread receives SIGINT (and only it may set a handler); elsewhere this does
nothing.  A job that runs in another thread (a Ray actor's, taas.host.ray) is interrupted with
:func:`interrupt_thread`: it raises KeyboardInterrupt at its next :func:`checkpoint`, which the
supervisor's watch loops pass between polls, where nothing is half done.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_asked: set[int] = set()  # threads asked to raise KeyboardInterrupt at their next checkpoint


@contextlib.contextmanager
def deferred_interrupt():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:  # not Python's KeyboardInterrupt: leave it
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def import_shielded(*names: str) -> None:
    """Import ``names`` so that an interrupt cannot leave one of them half-imported."""
    import importlib
    import sys

    if all(name in sys.modules for name in names):
        return
    with deferred_interrupt():
        for name in names:
            importlib.import_module(name)


def interrupt_thread(ident: int) -> None:
    """Interrupt thread ``ident`` (another thread: a SIGINT interrupts the main one; or the main
    thread itself, to have an interrupt held by :func:`deferred_interrupt` land at a loop's
    checkpoint): it raises KeyboardInterrupt at its next :func:`checkpoint`."""
    _asked.add(ident)


def checkpoint() -> None:
    """Raise KeyboardInterrupt here if this thread was interrupted (:func:`interrupt_thread`)."""
    if _asked and threading.get_ident() in _asked:
        _asked.discard(threading.get_ident())
        raise KeyboardInterrupt


def forget_interrupt() -> None:
    """This thread's interrupt that no checkpoint met (it came as its work ended) is dropped."""
    _asked.discard(threading.get_ident())
