"""The launchers a real-kernel test can run on, and the one decorator that runs it on both.

``local`` is taas's own launcher (what a kernel gets by default).  ``private`` is the second
launcher (:mod:`tests.support.private_launcher`: a fresh interpreter per process, a private root
per process, nothing shared through files), selected the way a user would, with
``TAAS_LAUNCHER``.  A core real-kernel test marked :data:`on_both_launchers` runs once on each,
unchanged: that it passes on an implementation so unlike the local one is what proves the
launcher contract (results back, torchrun's environment, a failing rank's traceback, exits and
signals, the timeout and its hang doctor, interrupt, the storage rule, restarts, kept ranks
and a kept cell's loader job beside them).

The parameter goes to the ``kernel_launcher`` fixture (tests/conftest.py), which both ``kernel``
and ``workdir`` follow: each launcher's kernel has its own working directory, as if it were
another notebook."""

from __future__ import annotations

import pytest

from tests.support.kernel_driver import Kernel

LOCAL = "local"

# Launcher name (the test id's suffix) -> TAAS_LAUNCHER for its kernel (None: taas's default).
LAUNCHERS: dict[str, str | None] = {
    LOCAL: None,
    "private": "tests.support.private_launcher:PrivateLauncher",
}

on_both_launchers = pytest.mark.parametrize("kernel_launcher", list(LAUNCHERS), indirect=True)


def kernel_on(launcher: str, cwd: str, env: dict | None = None) -> Kernel:
    """A real kernel in ``cwd`` with ``env`` whose taas session runs ``launcher`` (a key of
    :data:`LAUNCHERS`).  A launcher chosen by ``TAAS_LAUNCHER`` is checked to be the one the
    session really runs: a typo there must not quietly rerun the local launcher's tests."""
    spec = LAUNCHERS[launcher]
    k = Kernel(cwd, env=dict(env or {}, **({"TAAS_LAUNCHER": spec} if spec else {})))
    if spec:
        try:
            run = k.run("import taas; print(type(taas._loaded['session'].launcher).__name__)")
            assert run.stdout.strip() == spec.rpartition(":")[2], run.stdout + run.traceback
        except BaseException:  # the kernel would outlive the failed fixture: stop it, then fail
            k.shutdown()
            raise
    return k
