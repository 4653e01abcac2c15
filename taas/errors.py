"""The exception tree of taas.

Every error a user can meet says, in one line, what is wrong and what to do.

    TaasError
    ├── DirectiveError     bad '#pragma taas' / '%%taas' options (shown as IPython's UsageError)
    ├── PackagingError     a value the cell reads cannot be shipped to the ranks (before launch)
    ├── RegistrationError  taas.register() refused a loader
    ├── LaunchError        the ranks could not be started at all
    └── JobFailed          a rank or loader worker failed; renders the root cause's traceback

``JobFailed`` implements IPython's ``_render_traceback_`` hook (as ipyparallel's RemoteError
does), so a notebook shows the failing rank's traceback, not the kernel-side frames of taas.
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


class JobFailed(TaasError):
    """A job ended in failure.

    ``report`` is a :class:`taas.io.report.FailureReport`-like object that knows how to render
    the root cause's traceback and one line per other process; it is kept opaque here so this
    module stays free of imports.
    """

    def __init__(self, summary: str, rendered: list[str] | None = None, report=None):
        super().__init__(summary)  # str(): the one-line summary (a notebook's "evalue")
        self.summary = summary
        self.rendered = rendered or [summary]
        self.report = report
        if len(self.rendered) > 1 and hasattr(self, "add_note"):
            # Plain Python prints notes under the exception line: the whole story there too.
            import re

            self.add_note(re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(self.rendered[1:])))

    def _render_traceback_(self) -> list[str]:
        return list(self.rendered)
