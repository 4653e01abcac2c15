"""Another user of this machine, for tests of what one user's files and locks let another do:
``setpriv``'s nobody (uid and gid 65534, no groups), which needs root (as CI runs)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import sys
import tempfile

import pytest

NOBODY = 65534

# A command prefix: what follows runs as nobody.
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups"]

needs_another_user = pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("setpriv") is None,
    reason="running as another user (setpriv) needs root and setpriv")


def python_as_nobody(source: str, *args: str) -> list[str]:
    """The command that runs ``source`` (python -c) as nobody, with ``args``."""
    return [*AS_NOBODY, sys.executable, "-c", source, *args]


@contextlib.contextmanager
def passable_folder(prefix: str):
    """A folder (removed after) that nobody may pass through but not list or write: pytest's tmp
    folders are root's own, 0700, so what stops nobody must then be the files' own modes."""
    base = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    try:
        os.chmod(base, 0o755)
        yield base
    finally:
        shutil.rmtree(base)
