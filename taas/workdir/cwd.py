"""The kernel's working directory as a job needs it: there, and enterable.

Checked before anything else of a job (even importing torch needs a working directory), so a
deleted or forbidden directory is one line that says what to do, not a traceback from deep
inside a launcher.
"""

from __future__ import annotations

import os

from taas.errors import LaunchError


def working_directory() -> str:
    """The kernel's working directory, where the ranks start; a one-line LaunchError if it
    was deleted (``os.getcwd()`` fails) or cannot be entered."""
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        try:  # Linux still knows the path it had
            path = os.readlink("/proc/self/cwd").removesuffix(" (deleted)")
        except OSError:
            path = os.environ.get("PWD", "")
        again = " (a new directory of that name is not the same one)" if path and os.path.isdir(path) else ""
        raise LaunchError(
            f"the notebook's working directory {path} no longer exists{again}; `%cd` to an "
            "existing directory and run the cell again".replace("  ", " ")) from None
    if not os.access(cwd, os.X_OK):
        raise LaunchError(f"the notebook's working directory {cwd} cannot be entered "
                          "(permission denied); `%cd` to another directory or fix its "
                          "permissions, and run the cell again")
    return cwd
