"""The exception tree of taas.

Every error a user can meet says, in one line, what is wrong and what to do.

    TaasError
    ├── DirectiveError     bad '#pragma taas' / '%%taas' options (shown as IPython's UsageError)
    ├── PackagingError     a value the cell reads cannot be shipped to the ranks (before launch)
    ├── RegistrationError  taas.register() refused a loader
    ├── LaunchError        the ranks could not be started at all
    └── RenderedError      shown by its own rendering, not kernel-side frames
        ├── CellSyntaxError    the cell body does not compile (before launch)
        └── JobFailed          a rank or loader worker failed; the root cause's traceback
"""

from __future__ import annotations


class TaasError(Exception):
    """Base class of every error taas raises on purpose."""


class DirectiveError(TaasError):
    """The directive's options are invalid. Nothing was started."""


class PackagingError(TaasError):
    """A notebook value the cell reads cannot travel to the ranks. Nothing was started."""


class RegistrationError(TaasError):
    """``taas.register`` refused a loader."""


class LaunchError(TaasError):
    """The job's processes could not be started."""


class NoStdin(TaasError):
    """The notebook cannot answer a rank's ``input()`` or pdb prompt (its front end does not
    allow stdin, as a notebook's own ``input()`` raises StdinNotImplementedError): one line."""


class KeptRanksGone(LaunchError):
    """``next_cell`` found the kept ranks short of a process before sending anything: none of
    them got the cell, so it can run on fresh ranks instead.  ``reason``: what ended."""

    def __init__(self, reason: str):
        super().__init__(f"the kept ranks are gone: {reason}")
        self.reason = reason


class RenderedError(TaasError):
    """An error that knows how a notebook should show it.

    ``str()`` is the one-line summary (a notebook's "evalue"); ``rendered`` is what IPython's
    ``_render_traceback_`` hook shows instead of kernel-side frames, as ipyparallel's
    RemoteError does.  Plain Python prints the rendering as an exception note.
    """

    def __init__(self, summary: str, rendered: list[str] | None = None):
        super().__init__(summary)
        self.summary = summary
        self.rendered = rendered or [summary]
        if len(self.rendered) > 1 and hasattr(self, "add_note"):
            import re

            self.add_note(re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(self.rendered[1:])))

    def _render_traceback_(self) -> list[str]:
        return list(self.rendered)


class CellSyntaxError(RenderedError):
    """The cell body is not valid Python. Nothing was started."""


class JobFailed(RenderedError):
    """A job ended in failure; ``report`` is the root cause's ``ProcessEnd``."""

    def __init__(self, summary: str, rendered: list[str] | None = None, report=None):
        super().__init__(summary, rendered)
        self.report = report
