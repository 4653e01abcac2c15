"""Where this checkout is, for the processes tests start (stdlib only: a process that
tests/support/private_launcher.py starts imports it, and must stay quick to start)."""

from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def with_repo_on_path(env: dict) -> dict:
    """``env`` (changed in place, and returned) with this checkout first on PYTHONPATH: a
    process started with it imports this checkout's taas and tests, whatever its directory."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    return env
