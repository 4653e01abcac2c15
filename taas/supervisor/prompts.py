"""The ranks' questions for the notebook's input box: ``input()`` and pdb in a rank.

A rank that wants a line sends an ``ask`` event (:class:`taas.supervisor.events.Ask`; the rank's
side is :mod:`taas.launch.process.stdin`).  :class:`Prompts` queues the questions in the order
they came and serves them one after another: the sink asks the user (``Sink.ask``: in a
notebook, the kernel's stdin channel), and the answer goes back to the rank through
``JobHandle.answer``.  Several ranks asking at once are therefore asked in turn, each prompt
tagged with its rank by the rank itself (``[rank1] name? ``, ``(Pdb) [rank1] ``).

    the sink returns a line    -> Answer(text)
    EOFError                   -> Answer(eof): the rank's input() raises EOFError (pdb: q)
    NoStdin (one line), or an  -> Answer(error): the rank's input() raises it (the front end
    OSError reading stdin         does not allow stdin, a detached job has no user, ...)
    KeyboardInterrupt          -> propagates: the supervisor's interrupt path stops the job
                                  (kept ranks: SIGINT to each, which leaves pdb)

Post-mortem (``%pdb on``) is the root cause's: the first rank whose post-mortem prompt comes is
debugged; a later rank's gets end of input, which leaves its debugger at once.

While a rank waits at a prompt it is no hang: :attr:`debugging` names the ranks at one (from the
questions and from their beats, which say ``debugger`` or ``input``), and the supervisor's stall
doctor stays quiet while there are any.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from taas.errors import NoStdin
from taas.launch.process.stdin import Answer
from taas.supervisor.events import Ask

log = logging.getLogger(__name__)

AT_PROMPT = ("debugger", "input")  # beat states of a rank that waits for the user


class Prompts:
    """One job's questions from its ranks, and who is at a prompt."""

    def __init__(self, sink, handle, board=None):
        self.sink, self.handle, self.board = sink, handle, board
        self.queue: deque[tuple[str, Ask]] = deque()
        self.at_prompt: set[str] = set()  # ranks whose last word was a question or a prompt beat
        self.post_mortem: str | None = None  # the rank whose failure the user debugs (the first)

    @property
    def waiting(self) -> bool:
        return bool(self.queue)

    @property
    def debugging(self) -> bool:
        return bool(self.at_prompt) or bool(self.queue)

    def asked(self, key: str, ask: Ask) -> None:
        self.queue.append((key, ask))
        self.at_prompt.add(key)
        if self.board is not None:
            self.board.asking(key, ask.debugger)

    def beat(self, key: str, state: str) -> None:
        if state in AT_PROMPT:
            self.at_prompt.add(key)
        else:
            self.at_prompt.discard(key)

    def left(self, key: str) -> None:
        """Rank ``key`` is done or ended: at no prompt, whatever its last beat said."""
        self.at_prompt.discard(key)

    def serve(self, gone: Callable[[str], bool]) -> None:
        """Ask the user every question waiting, in order; ``gone(key)``: that process ended (its
        question is dropped)."""
        while self.queue:
            key, ask = self.queue.popleft()
            if gone(key):
                continue
            if ask.post_mortem and self.post_mortem not in (None, key):
                # Post-mortem is the root cause's: the first rank to fail.  A rank that failed
                # after it (its consequence, most often) leaves its debugger at once.
                reply = Answer(ask.id, eof=True)
            else:
                if ask.post_mortem:
                    self.post_mortem = key
                reply = self._ask(ask)
            self.at_prompt.discard(key)  # its next beat says whether it still is
            if not self.handle.answer(key, reply):
                log.debug("%s asked but cannot be answered (it ended?)", key)

    def _ask(self, ask: Ask) -> Answer:
        return Answer(ask.id, **read_line(self.sink, ask.prompt, ask.password))


def read_line(sink, prompt: str, password: bool = False) -> dict:
    """The user's answer to ``prompt`` through ``sink.ask``, as an Answer's fields: ``text``,
    or ``eof``, or ``error`` (one line: why no line can be read).  KeyboardInterrupt propagates.
    Also what the kernel answers its job host with (taas.host.remote)."""
    ask = getattr(sink, "ask", None)
    if ask is None:
        return {"error": "this job has no input box to read from: input() and pdb in a rank need an "
                         "interactive notebook"}
    try:
        return {"text": ask(prompt, password)}
    except EOFError:
        return {"eof": True}
    except NoStdin as exc:
        return {"error": str(exc)}
    except OSError as exc:  # a terminal's stdin that cannot be read (closed, captured)
        return {"error": f"stdin cannot be read here: {exc}"}
