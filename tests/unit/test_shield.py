"""taas.shield: an interrupt of a thread other than the main one, raised at a checkpoint."""

from __future__ import annotations

import threading

import pytest

from taas import shield


def test_a_thread_is_interrupted_at_its_next_checkpoint_once():
    reached, asked, seen = threading.Event(), threading.Event(), []

    def work():
        shield.checkpoint()  # not asked yet: nothing
        reached.set()
        asked.wait()
        try:
            shield.checkpoint()
        except KeyboardInterrupt:
            seen.append("interrupted")
        shield.checkpoint()  # once: the next checkpoint goes on
        seen.append("went on")

    thread = threading.Thread(target=work)
    thread.start()
    reached.wait()
    shield.interrupt_thread(thread.ident)
    shield.checkpoint()  # another thread's interrupt is not this one's
    asked.set()
    thread.join()
    assert seen == ["interrupted", "went on"]


def test_an_interrupt_no_checkpoint_met_is_forgotten():
    shield.interrupt_thread(threading.get_ident())
    shield.forget_interrupt()
    shield.checkpoint()
    shield.interrupt_thread(threading.get_ident())
    with pytest.raises(KeyboardInterrupt):
        shield.checkpoint()
