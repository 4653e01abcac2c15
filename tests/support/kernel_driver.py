"""Drive a real Jupyter kernel from tests: run cells, collect outputs, check for leftovers."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field

import psutil
from jupyter_client import KernelManager
from traitlets import List, Unicode

from tests.support.notebooks import OFFLINE, cell, plain  # noqa: F401 (tests import these from here too)
from tests.support.paths import with_repo_on_path
from tests.support.processes import (  # noqa: F401 (tests import these from here too)
    cmdline, is_alive, listening_ports, open_files, process_name, shm_entries, unmapped_shm, wait_for,
    wait_until_gone)


def one_line_usage_error(run) -> str:
    """IPython shows a UsageError as one stderr line (no traceback)."""
    assert run.status == "error", run.stdout + run.stderr
    usage = [line for line in run.stderr.splitlines() if line.startswith("UsageError: ")]
    assert len(usage) == 1 and run.stderr.strip() == usage[0], run.stderr
    return usage[0]


@dataclass
class CellRun:
    stdout: str = ""
    stderr: str = ""
    error: dict | None = None  # ename, evalue, traceback
    result: str | None = None  # execute_result text/plain
    displays: list = field(default_factory=list)
    # The live rank panel's display messages (marked in their metadata, taas.io.board.METADATA),
    # kept apart from the cell's own displays and progress lines: it shows on any job that runs
    # past a couple of seconds, whatever the cell does.
    panels: list = field(default_factory=list)
    status: str = ""
    messages: list = field(default_factory=list)  # every iopub message of the cell, in order
    # Every input_request of the cell (its prompt), in order, and the stdout text shown before
    # each (what the cell showed when the input box opened), for tests that answer them.
    prompts: list = field(default_factory=list)
    before_prompt: list = field(default_factory=list)

    @property
    def traceback(self) -> str:
        return "\n".join(self.error["traceback"]) if self.error else ""


INTERRUPT = object()  # a scripted reply: interrupt the kernel at this prompt instead of typing


class Replies:
    """Scripted answers to a cell's input requests, as a front end gives them: each request
    is matched to the next ``(expected, reply)`` in order -- its prompt must contain
    ``expected`` -- and answered with ``reply`` (:data:`INTERRUPT`: the kernel is interrupted
    instead, as the toolbar's stop does; a callable: called with the prompt, for ranks that
    ask in any order).  A request with no reply left fails the test."""

    def __init__(self, *pairs: tuple[str, object]):
        self.pairs = list(pairs)
        self.used = 0

    def next(self, prompt: str) -> object:
        assert self.used < len(self.pairs), f"an input request with no scripted reply: {prompt!r}"
        expected, reply = self.pairs[self.used]
        assert expected in prompt, f"input request {self.used}: {prompt!r} does not contain {expected!r}"
        self.used += 1
        return reply(prompt) if callable(reply) else reply

    @property
    def done(self) -> bool:
        return self.used == len(self.pairs)


class _PrefixedKernelManager(KernelManager):
    """Starts the kernel command behind ``command_prefix`` (e.g. ``nsenter ...`` to run it in
    another namespace); restarts keep the prefix."""

    command_prefix = List(Unicode())

    def format_kernel_cmd(self, extra_arguments=None):
        return [*self.command_prefix, *super().format_kernel_cmd(extra_arguments)]


class Kernel:
    def __init__(self, cwd: str, load_taas: bool = True, env: dict | None = None,
                 transport: str = "tcp", command_prefix: list[str] | None = None):
        """A kernel started in ``cwd``, with ``env`` added to this process's environment.

        ``transport="ipc"``: the channels are Unix sockets next to the connection file, for a
        kernel whose loopback is not ours (another network namespace).  ``command_prefix``:
        argv put before the kernel's command (then ``pid`` is the prefix command's)."""
        self.km = _PrefixedKernelManager(kernel_name="python3", transport=transport,
                                         command_prefix=list(command_prefix or []))
        self._ipc_dir = None
        if transport == "ipc":
            # Absolute socket paths: the default ("kernel-ipc-PORT") is relative to each
            # side's working directory, which differ.
            self._ipc_dir = tempfile.mkdtemp(prefix="taas-kipc-")
            self.km.connection_file = os.path.join(self._ipc_dir, "kernel.json")
            self.km.ip = os.path.join(self._ipc_dir, "k")
        # No job host started ahead of a --detach that these tests' cells never use: each would
        # import torch once more per kernel (CPU the suite cannot spare on 2 cores).  The
        # detached-job tests ask for one (tests/kernel/test_detach_kernel.py).
        env = with_repo_on_path({"TAAS_WARM_HOST": "0", **os.environ, **(env or {})})
        self.km.start_kernel(cwd=cwd, env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=self.CELL_TIMEOUT)
        self.pid = self.km.provisioner.process.pid
        self._stacks = self._dump_stacks_on_sigusr1()
        if load_taas:
            run = self.run("%load_ext taas")
            assert run.error is None, run.traceback

    # Upper bounds for "until it is done": only a real hang reaches them, however busy the
    # machine is.  Bounds the product promises (stop within 5 s) are asserted by the tests.
    CELL_TIMEOUT = 600.0

    def _dump_stacks_on_sigusr1(self) -> str:
        """Have the kernel write every thread's Python stack to a file on SIGUSR1 (silently: no
        execution count, no history), so that a cell that hangs fails with where it hung."""
        fd, path = tempfile.mkstemp(prefix="taas-kernel-stacks-")
        os.close(fd)
        code = (f"import faulthandler as _fh, signal as _sig\n"
                f"_fh.register(_sig.SIGUSR1, file=open({path!r}, 'w'), all_threads=True)\n"
                "del _fh, _sig")
        reply = self.reply(self.kc.execute(code, silent=True, store_history=False))
        assert reply["content"]["status"] == "ok", reply["content"]
        self._dumping = self._kernel_process()  # only it writes them (a restarted one would die)
        return path

    def _kernel_process(self) -> psutil.Process | None:
        """The kernel's own process: ours (started by this harness), not a prefix command's."""
        try:
            return next((p for p in [psutil.Process(self.pid), *self.descendants()]
                         if "ipykernel" in " ".join(cmdline(p))), None)
        except psutil.Error:
            return None

    def stacks(self, timeout: float = 10.0) -> str:
        """Every thread's Python stack in the kernel now (its faulthandler dump), or why not."""
        kernel = self._kernel_process()
        if kernel is None or kernel != self._dumping:  # psutil compares pid and start time
            return "(not the kernel that was asked to dump its stacks: restarted?)"
        size = os.path.getsize(self._stacks)
        try:
            kernel.send_signal(signal.SIGUSR1)
            wait_for(lambda: os.path.getsize(self._stacks) > size, timeout=timeout, what="the kernel's stacks")
        except (psutil.Error, TimeoutError) as exc:
            return f"(the kernel's stacks could not be had: {exc})"
        # faulthandler writes thread by thread: on a loaded machine the first bytes come well
        # before the last (the main thread's stack was missing once); read it once it is whole.
        grown = -1
        while grown != os.path.getsize(self._stacks):
            grown = os.path.getsize(self._stacks)
            time.sleep(0.1)
        with open(self._stacks, errors="replace") as f:
            f.seek(size)
            return f.read()

    def execute(self, code: str, batch: bool = False) -> str:
        """Send ``code`` for execution without waiting; its msg_id, for :meth:`reply`.
        ``batch``: as nbval and nbconvert send it (no stdin), not as JupyterLab does."""
        return self.kc.execute(code, allow_stdin=False if batch else None)

    def reply(self, msg_id: str, timeout: float = CELL_TIMEOUT) -> dict:
        """The shell reply to request ``msg_id`` (see :func:`_answers`)."""
        for msg in _answers(self.kc.get_shell_msg, msg_id, timeout, self.km.is_alive):
            return msg
        self._check_alive()
        raise TimeoutError(f"no reply to {msg_id} in {timeout}s")

    def _check_alive(self) -> None:
        """A kernel that died answers nothing: say so now, not after the cell's whole timeout."""
        if not self.km.is_alive():
            raise RuntimeError("the kernel died (its process ended) while the test waited for it")

    def run(self, code: str, timeout: float = CELL_TIMEOUT, on_output=None, batch: bool = False,
            on_panel=None, replies: Replies | None = None) -> CellRun:
        """Run ``code`` and collect what it shows.  ``on_output(out)`` is called after each
        stream message, ``on_panel(out)`` after each message of the rank panel (``out.panels``
        so far): a test reacts to what the cell shows while it runs.  ``replies``: the cell's
        input requests are answered with them on the stdin channel, as a front end does (the
        cell is sent with ``allow_stdin``); without, a request fails the test."""
        msg_id = self.execute(code, batch)
        out = CellRun()
        messages = (_answers(self.kc.get_iopub_msg, msg_id, timeout, self.km.is_alive) if replies is None
                    else self._answering(msg_id, timeout, replies, out))
        try:
            finished = self._collect(messages, out, on_output, on_panel)
        except BaseException as exc:
            if type(exc).__name__ == "Failed" and str(exc).startswith("Timeout") and hasattr(exc, "add_note"):
                # pytest-timeout's own limit (its SIGALRM) struck while the kernel worked: say where.
                exc.add_note(f"the kernel's threads then:\n{self.stacks()}")
            raise
        if not finished:  # no idle status in time (or the kernel died)
            self._check_alive()
            stacks = self.stacks()
            self._abandon(msg_id)
            raise TimeoutError(f"cell did not finish in {timeout}s:\n{code}\nthe kernel's threads then:\n{stacks}")
        out.status = self.reply(msg_id)["content"]["status"]
        return out

    @staticmethod
    def _collect(messages, out: CellRun, on_output, on_panel) -> bool:
        """Fill ``out`` from the cell's iopub ``messages``; whether its idle status came."""
        for msg in messages:
            out.messages.append(msg)
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                if content["name"] == "stdout":
                    out.stdout += content["text"]
                else:
                    out.stderr += content["text"]
                if on_output:
                    on_output(out)
            elif kind == "error":
                out.error = content
            elif kind == "execute_result":
                out.result = content["data"].get("text/plain")
            elif kind in ("display_data", "update_display_data"):
                panel = (content.get("metadata") or {}).get("taas", {}).get("panel")
                (out.panels if panel else out.displays).append((kind, content["data"]))
                if panel and on_panel:
                    on_panel(out)
            elif kind == "status" and content["execution_state"] == "idle":
                return True
        return False

    def _answering(self, msg_id: str, timeout: float, replies: Replies, out: CellRun):
        """The cell's iopub messages, answering its input requests meanwhile (each request's
        parent is the cell: replies are matched to this cell's requests only)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                request = self.kc.get_stdin_msg(timeout=0)
            except queue.Empty:
                request = None
            if request is not None and request["parent_header"].get("msg_id") == msg_id:
                prompt = request["content"]["prompt"]
                # What the cell showed before the box opened (iopub may still be on its way).
                for msg in _answers(self.kc.get_iopub_msg, msg_id, 0.2):
                    yield msg
                out.prompts.append(prompt)
                out.before_prompt.append(out.stdout)
                reply = replies.next(prompt)
                if reply is INTERRUPT:
                    self.km.interrupt_kernel()
                else:
                    self.kc.input(str(reply))
                continue
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                yield msg

    def _abandon(self, msg_id: str) -> None:
        """A cell that ran too long: interrupt it and wait for its reply, so the next cell
        starts on an idle kernel (its messages are told apart by msg_id in any case)."""
        try:
            self.km.interrupt_kernel()
            self.reply(msg_id, timeout=60)
        except Exception:  # best effort: the TimeoutError that follows is the failure
            pass

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)
        with contextlib.suppress(OSError):
            os.unlink(self._stacks)
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _answers(get, msg_id: str, timeout: float, alive=None):
    """The messages ``get`` (a channel's ``get_*_msg``) returns that answer request ``msg_id``,
    for up to ``timeout`` s, or until ``alive()`` says the kernel is gone (then the generator
    ends); answers to other requests (an earlier cell that timed out, say) are skipped, never
    taken for this one's."""
    deadline = time.monotonic() + timeout
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            msg = get(timeout=min(remaining, 1))
        except queue.Empty:
            if alive is not None and not alive():
                return
            continue
        if msg["parent_header"].get("msg_id") == msg_id:
            yield msg


