"""The notebook face's plain parts: a cell as IPython hands it over, and where a job's output goes.

``pragma_transformer`` (``#pragma taas`` cells become ``%%taas`` cells), ``translate`` (a taas
cell's IPython syntax -- ``%run``, ``!cmd`` -- as the calls its ranks run, line for line),
``cell_number`` (the ``In [N]`` of the running cell), the display formatter rank 0 uses, and
``NotebookSink`` (the cell's streams, displays updated in place, the rank panel, and the
notebook's input box for a rank's ``input()`` and pdb).  :mod:`taas.magics` joins them to the
Session.  May import IPython (one of the two modules of the face that may), ``taas.directive``,
``taas.errors`` and ``taas.job``.
"""

from __future__ import annotations

import functools
import sys

from IPython.core.error import StdinNotImplementedError, UsageError
from IPython.core.formatters import DisplayFormatter
from IPython.core.inputtransformer2 import TransformerManager, leading_empty_lines
from IPython.display import display, publish_display_data

from taas import directive
from taas.errors import DirectiveError, NoStdin
from taas.job import package, syntax


def choose_display_formatter() -> None:
    """Rank 0 formats what a cell ``display()``s with IPython's DisplayFormatter, as the
    notebook itself would.  It travels by name (imported in the rank on first use), so the
    rank runtime never names IPython (see :mod:`taas.rank.display`)."""
    package.set_display_formatter(f"{DisplayFormatter.__module__}:{DisplayFormatter.__qualname__}")


def forget_display_formatter() -> None:
    package.set_display_formatter(None)


def pragma_transformer(lines: list[str]) -> list[str]:
    """``input_transformers_cleanup`` hook: ``#pragma taas`` cells become ``%%taas`` cells."""
    try:
        return directive.pragma_transformer(lines)
    except DirectiveError as exc:
        raise UsageError(str(exc)) from None


def _keeping_lines(transform: type) -> type:
    """IPython's token transform ``transform``, with the lines it joins (a ``\\`` continued
    ``!cmd``) replaced by blank ones, so that every line after keeps its number."""
    class Keeping(transform):
        def transform(self, lines: list[str]) -> list[str]:
            out = super().transform(lines)
            row = self.start_line + 1
            return out[:row] + ["\n"] * (len(lines) - len(out)) + out[row:]
    Keeping.__name__ = transform.__name__
    return Keeping


class _CellBody(TransformerManager):
    """IPython's own transformers, less what would move the body's lines."""

    def __init__(self) -> None:
        super().__init__()
        self.cleanup_transforms = [t for t in self.cleanup_transforms if t is not leading_empty_lines]
        self.token_transformers = [_keeping_lines(t) for t in self.token_transformers]


@functools.lru_cache(maxsize=64)
def translate(cell: str, first_line: int = 2) -> str:
    """A taas cell's body as its ranks run it: ``%run``, ``!cmd``, ``x = !cmd`` ... as IPython
    turns them into calls, line for line, routed to the rank's shell (taas.job.syntax); the body
    itself when it has no IPython syntax.  A magic with no meaning in a rank is a UsageError.
    Remembered per cell text (a function of it alone; a refused cell is translated again each
    time): IPython's transformers took a few tenths of a millisecond of every kept cell, and
    tens of milliseconds of a long one."""
    source = _CellBody().transform_cell(cell)
    if source.rstrip("\n") == cell.rstrip("\n"):
        source = cell  # (``get_ipython().system(...)`` written out is routed too, as IPython runs it)
    try:
        return syntax.route(source, first_line)
    except DirectiveError as exc:
        raise UsageError(str(exc)) from None


class NotebookSink:
    """Where a job's output goes in a notebook: the cell's streams, progress lines updated in
    place (a display per process), rank 0's display data, and the ranks' questions (input(),
    pdb) in the notebook's input box (``kernel``: ipykernel's, None outside a kernel)."""

    def __init__(self, updates_in_place: bool = True, kernel=None) -> None:
        self.kernel = kernel
        self._progress: dict[tuple[str, str], object] = {}
        self._last = None  # the stream written last
        # The live rank panel (taas.io.board) is a display updated in place only where the
        # front end shows updates as they come; elsewhere it is printed text, and rarely.
        self.updates_in_place = updates_in_place
        self._panel = None  # the panel's display handle

    def write(self, stream: str, text: str) -> None:
        target = sys.stdout if stream == "stdout" else sys.stderr
        if self._last is not None and self._last is not target:
            # Each stream is sent on its own timer: flush the other one first, so that the
            # cell shows stdout and stderr lines in the order they were written.
            self._last.flush()
        self._last = target
        target.write(text)

    def progress(self, key: str, stream: str, text: str, final: bool) -> None:
        handle = self._progress.get((key, stream))
        bundle = {"text/plain": text}
        if handle is None:
            sys.stdout.flush()
            sys.stderr.flush()
            handle = display(bundle, raw=True, display_id=True)
            self._progress[(key, stream)] = handle
        else:
            handle.update(bundle, raw=True)
        if final:
            del self._progress[(key, stream)]

    def display(self, data: dict, metadata: dict) -> None:
        sys.stdout.flush()
        publish_display_data(data, metadata)

    def live(self, name: str, data: dict, metadata: dict, final: bool) -> None:
        """Show ``data`` as the display ``name`` of this cell, updated in place on later calls
        (the metrics plot, taas.io.plot); ``final``: its last state."""
        handles = self.__dict__.setdefault("_live", {})  # name -> display handle, made on first use
        if name not in handles:
            sys.stdout.flush()
            sys.stderr.flush()
            handles[name] = display(data, raw=True, metadata=metadata, display_id=True)
        else:
            handles[name].update(data, raw=True, metadata=metadata)
        if final:
            del handles[name]

    def ask(self, prompt: str, password: bool = False) -> str:
        """A line from the notebook's input box (the kernel's stdin channel), or NoStdin."""
        sys.stdout.flush()
        sys.stderr.flush()
        if self.kernel is None:
            raise NoStdin("there is no notebook kernel to ask: input() and pdb in a rank need one")
        try:
            return (self.kernel.getpass if password else self.kernel.raw_input)(prompt)
        except StdinNotImplementedError:
            raise NoStdin("this front end does not allow stdin: input() and pdb in a rank need an "
                          "interactive notebook") from None

    def panel(self, bundle: dict, metadata: dict, final: bool) -> None:
        """Show (then update in place) the live rank panel; ``final``: its last state."""
        if self._panel is None:
            sys.stdout.flush()
            sys.stderr.flush()
            self._panel = display(bundle, raw=True, metadata=metadata, display_id=True)
        else:
            self._panel.update(bundle, raw=True, metadata=metadata)
        if final:
            self._panel = None


def no_kernel_post_mortem(shell) -> None:
    """The failing rank had its post-mortem (``%pdb on``): IPython's own must not open in taas's
    frames for this cell's JobFailed; ``%pdb`` is back on once the cell is over."""
    shell.call_pdb = False

    def restore(*args) -> None:
        shell.events.unregister("post_run_cell", restore)
        shell.call_pdb = True

    shell.events.register("post_run_cell", restore)


def cell_number(shell) -> int:
    """The execution count of the cell running now: the number of its ``In [N]`` prompt.

    ``shell.execution_count`` is not it: IPython 9 counts the cell before running it (so
    during the cell it is already N + 1), IPython 8 after.  The running cell's own
    ``ExecutionResult`` (the displayhook holds it while the cell runs) has the number in both;
    without one (a magic called from code, not from a cell) the shell's count is the best guess.
    """
    running = getattr(getattr(shell, "displayhook", None), "exec_result", None)
    number = getattr(running, "execution_count", None)
    return number if isinstance(number, int) else shell.execution_count
