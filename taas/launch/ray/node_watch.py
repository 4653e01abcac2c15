"""What a cluster node's agent leaves behind when Ray ends it: removed by a detached watcher.

Why a process of its own, detached (double fork, new session): when the kernel's Ray
connection ends (a killed kernel), Ray ends its actors -- the node agents -- and kills each
one's direct children with it (Ray's ``kill_child_processes_on_worker_exit``), the start
process's guard included.  The job's processes die with them (parent-death signals), but
nothing below the agent is left to run the job's clean-up hooks (``LaunchSpec.cleanups``: a
data relay's shared-memory rings, say) or to remove the node's copy of the working directory
(:mod:`taas.workdir.sync`).  So each agent starts one watcher (:func:`start`), which
holds nothing but the agent's pid and start time; the agent keeps the hooks of the jobs it runs
in a file of its own (:func:`record`, :func:`clear`), with the job's directory.  When the agent
is gone, the watcher runs the recorded hooks (in the agent's environment: ``TAAS_NODE_ID``
limits them to this node's share), removes that job directory and the agent's copies, and exits.
"""

from __future__ import annotations

import glob
import os
import pickle
import subprocess
import sys
import tempfile
import time

from taas.launch.api import process_stat, run_cleanups

POLL = 0.5  # seconds between two looks at the agent


def _record_path(agent_pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"taas-agent-{agent_pid}-cleanups")


def record(hooks, *job_dirs: str) -> None:
    """In the agent: ``hooks`` (``LaunchSpec.cleanups``) and ``job_dirs`` (see
    :mod:`taas.launch.local.jobdir`) are its current jobs' (a kept job and a kept cell's loader
    job may run side by side); written whole or not at all, readable by the agent's user only."""
    path = _record_path(os.getpid())
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + "-", dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as f:
        pickle.dump({"hooks": list(hooks), "dirs": [d for d in job_dirs if d]}, f)
    os.replace(tmp, path)


def clear() -> None:
    """In the agent: its job ended and ran its own hooks; nothing left for the watcher."""
    try:
        os.unlink(_record_path(os.getpid()))
    except FileNotFoundError:
        pass


def start(agent_pid: int) -> None:
    """Start the detached watcher of ``agent_pid`` (returns once it runs on its own)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "taas.launch.ray.node_watch", str(agent_pid)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    proc.wait()  # the intermediate process exits at once; its child watches


def _start_time(pid: int) -> bytes | None:
    fields = process_stat(pid)
    return fields[19] if fields else None  # a reused pid has another


def _watch(agent_pid: int) -> None:
    if os.fork():
        os._exit(0)  # the intermediate: the watcher is nobody's child in the agent's tree
    started = _start_time(agent_pid)
    while started is not None and _start_time(agent_pid) == started:
        time.sleep(POLL)
    after(agent_pid)
    os._exit(0)


def after(agent_pid: int) -> None:
    """What the watcher does once ``agent_pid`` is gone (also callable directly, in tests)."""
    from taas.launch.local.jobdir import remove
    from taas.workdir.sync import COPY_PREFIX

    path = _record_path(agent_pid)
    try:
        with open(path, "rb") as f:
            recorded = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):  # none recorded, or a torn file
        recorded = {}
    run_cleanups(recorded.get("hooks", []))
    for job_dir in recorded.get("dirs", []):  # gone already where the job ended normally
        if os.path.isdir(job_dir):
            remove(job_dir)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    for copy in glob.glob(os.path.join(tempfile.gettempdir(), f"{COPY_PREFIX}{agent_pid}-*")):
        remove(copy)


if __name__ == "__main__":
    _watch(int(sys.argv[1]))
