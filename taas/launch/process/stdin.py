"""A rank's stdin: how ``input()`` and pdb in a rank read the notebook's input box.

A rank has no terminal; the notebook's input box is the kernel's stdin channel.  So a rank that
wants a line asks the kernel, and the kernel asks the front end:

    rank: flush stdout, stderr ──> events pipe {"kind": "ask", "id", "prompt", "password",
          "debugger", "post_mortem"} ──> kernel (taas.supervisor.events.Ask) ──> Sink.ask(prompt) (the
          notebook's input box; ranks asking together are served one after another)
    kernel ──> JobHandle.answer(key, Answer) ──> the rank's FIFO ``<job_dir>/stdin/<key>``:
          one JSON line {"id", "text"} | {"id", "eof": true} | {"id", "error": "..."}
          ──> :func:`ask` returns the text, or raises EOFError or :class:`StdinUnavailable`

An interrupt at the prompt is the kernel's: it stops the job's processes, or (kept ranks)
sends SIGINT, which raises KeyboardInterrupt in the rank's read here.

The FIFO is made and opened read-write by the rank before it asks (:func:`ask`), so the rank
never blocks on an absent writer and an answer written before it reads is not lost.  The kernel
side (:func:`answer`) opens it non-blocking: a rank that is gone is a False at once, not a
hang.  Lines from an earlier question (an id other than the one asked) are skipped, as is a
line that is not an answer: user code can write this FIFO, it is never unpickled.

Launcher-neutral: the kernel reaches the FIFO only through ``JobHandle.answer``; a launcher
whose processes run elsewhere (a Ray node's agent) writes it where they run.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass

from taas.launch.process import events

FIFO_DIR = "stdin"


class StdinUnavailable(RuntimeError):
    """The notebook cannot answer (its front end does not allow stdin): the rank's input()
    raises this, as a notebook's own input() raises StdinNotImplementedError."""


StdinUnavailable.__module__ = "taas"  # the cell's one line: "taas.StdinUnavailable: ..."


@dataclass(frozen=True)
class Answer:
    """The kernel's answer to question ``id``: a line of text (no newline), or end of input
    (``eof``), or ``error`` (one line: stdin cannot be read here)."""

    id: int
    text: str = ""
    eof: bool = False
    error: str = ""

    def line(self) -> bytes:
        fields: dict = {"id": self.id}
        if self.eof:
            fields["eof"] = True
        elif self.error:
            fields["error"] = self.error
        else:
            fields["text"] = self.text
        return (json.dumps(fields) + "\n").encode()


def read_answer(line: bytes) -> Answer | None:
    """The answer on ``line``, or None when it is not one."""
    try:
        m = json.loads(line)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None
    if not isinstance(m, dict) or not isinstance(m.get("id"), int) or isinstance(m.get("id"), bool):
        return None
    if m.get("eof") is True:
        return Answer(m["id"], eof=True)
    if isinstance(m.get("error"), str) and m["error"]:
        return Answer(m["id"], error=m["error"])
    if isinstance(m.get("text"), str):
        return Answer(m["id"], text=m["text"])
    return None


def fifo_path(job_dir: str, key: str) -> str:
    return os.path.join(job_dir, FIFO_DIR, key)


# ---- rank side -----------------------------------------------------------------------------
class _Inbox:
    """The rank's end of its FIFO, opened on the first question."""

    def __init__(self) -> None:
        self.path: str | None = None  # set by setup()
        self.fd: int | None = None
        self.buffer = b""
        self.next_id = 0
        self.lock = threading.Lock()  # one question at a time per rank (its threads queue)

    def open(self) -> int:
        if self.fd is None:
            path = self.path
            assert path is not None
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if not os.path.exists(path):
                os.mkfifo(path, 0o600)
            self.fd = os.open(path, os.O_RDWR)
        return self.fd

    def wait(self, wanted: int) -> Answer:
        fd = self.open()
        while True:
            while b"\n" in self.buffer:
                line, self.buffer = self.buffer.split(b"\n", 1)
                got = read_answer(line)
                if got is not None and got.id == wanted:
                    return got
            data = os.read(fd, 65536)  # an interrupt (SIGINT) here raises KeyboardInterrupt
            self.buffer += data


_inbox = _Inbox()


def setup(job_dir: str, key: str) -> None:
    """This process is ``key`` with its directory ``job_dir``: it may ask from now on (the
    FIFO is made on the first question)."""
    _inbox.path = fifo_path(job_dir, key)


def available() -> bool:
    """Whether this process can ask the kernel (it runs under a launcher with an events pipe)."""
    return bool(os.environ.get("TAAS_EVENTS_FD") and _inbox.path)


def ask(prompt: str, *, password: bool = False, debugger: bool = False, post_mortem: bool = False) -> str:
    """A line from the notebook's input box, asked with ``prompt`` (shown as given).  Raises
    EOFError (end of input) or StdinUnavailable (the front end does not allow stdin)."""
    if not available():
        raise StdinUnavailable("taas: this process has no way to ask the notebook for input")
    with _inbox.lock:
        _inbox.next_id += 1
        wanted = _inbox.next_id
        _inbox.open()  # before asking: the answer may come before we read
        sys.stdout.flush()
        sys.stderr.flush()
        events.send("ask", id=wanted, prompt=str(prompt), password=password, debugger=debugger,
                    post_mortem=post_mortem)
        got = _inbox.wait(wanted)
    if got.error:
        raise StdinUnavailable(got.error)
    if got.eof:
        raise EOFError
    return got.text


# ---- kernel side ---------------------------------------------------------------------------
def answer(job_dir: str, key: str, reply: Answer) -> bool:
    """Give process ``key`` (its directory ``job_dir``) ``reply``; False when it cannot be
    reached (it ended, or never asked)."""
    try:
        fd = os.open(fifo_path(job_dir, key), os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: nobody reads it (any more); ENOENT: never made
        return False
    try:
        os.set_blocking(fd, True)  # a long line goes whole; the rank reads as it comes
        view = memoryview(reply.line())
        while view:
            view = view[os.write(fd, view):]
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
