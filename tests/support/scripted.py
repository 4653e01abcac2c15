"""Test doubles of the launcher contract (taas.launch.api) that start no process: a handle that
plays a script of events, and launchers on one machine without CUDA that hand such handles
out.  The supervisor's and the session's unit tests drive taas with them."""

from __future__ import annotations

from taas.launch.api import JobHandle, Launcher, ProcessExit, Topology


class ScriptedHandle(JobHandle):
    """Plays one attempt's events, one per ``events()`` call; every process exits as the script
    says.  ``files``: what the processes left, ``(key, name) -> bytes``."""

    def __init__(self, spec, script=(), files=None):
        self.spec, self.script = spec, list(script)
        self.files = dict(files or {})
        self.stopped = self.closed = False

    @property
    def keys(self):
        return [p.key for p in self.spec.processes]

    def events(self, timeout):
        return [self.script.pop(0)] if self.script else []

    def drain(self, timeout=2.0):
        out, self.script = self.script, []
        return out

    def stop(self, grace=1.0):
        """The processes still to exit in the script exit as SIGTERM ends them (-15)."""
        self.stopped = True
        left = {e.key for e in self.script if isinstance(e, ProcessExit)}
        self.script = [ProcessExit(k, 0, -15) for k in self.keys if k in left]

    def fetch(self, key, name):
        return self.files.get((key, name))

    def request_stacks(self, keys):
        return []

    def layers(self):
        return []

    def close(self):
        self.closed = True


class OneMachine(Launcher):
    """A launcher double's fixed facts: every rank on node 0, no CUDA device."""

    def cuda_devices(self):
        return 0

    def topology(self, world):
        return Topology(rank_nodes=(0,) * world)

    def shutdown(self):
        pass


class ScriptedLauncher(OneMachine):
    """Each start plays the next ``(script, files)`` of ``attempts``; what it was given and what
    it handed out stay in ``specs`` and ``handles``."""

    def __init__(self, attempts):
        self.attempts = list(attempts)
        self.specs: list = []
        self.handles: list[ScriptedHandle] = []

    def start(self, spec):
        self.specs.append(spec)
        script, files = self.attempts.pop(0)
        self.handles.append(ScriptedHandle(spec, script, files))
        return self.handles[-1]


class Sink:
    """What a job showed, as ``(stream, text)`` in order."""

    def __init__(self):
        self.text: list[tuple[str, str]] = []

    def write(self, stream, text):
        self.text.append((stream, text))
