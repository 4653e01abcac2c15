"""The supervisor's states as data, and the supervisor driven by a scripted launcher: no
processes anywhere in this module."""

from __future__ import annotations

import pickle

import pytest

from taas.errors import JobFailed, LaunchError
from taas.job.api import Job, Policy, World
from taas.job.package import Payload
from taas.launch.api import (
    RESULT,
    OutputChunk,
    ProcessExit,
    error_name,
)
from taas.supervisor.machine import Ev, InvalidTransition, Machine, State
from taas.supervisor.supervisor import Supervisor
from tests.support.scripted import ScriptedLauncher, Sink

S = State

# (max_restarts, has_loaders, events, expected states after each event)
PATHS = [
    (0, False, [Ev.STARTED, Ev.ALL_EXITED], [S.RUNNING, S.SUCCEEDED]),
    (0, True, [Ev.STARTED, Ev.LOADERS_READY, Ev.LOADERS_READY, Ev.ALL_EXITED],
     [S.PREFETCHING, S.RUNNING, S.RUNNING, S.SUCCEEDED]),
    (0, True, [Ev.STARTED, Ev.ALL_EXITED], [S.PREFETCHING, S.SUCCEEDED]),  # ended during prefetch
    (0, False, [Ev.STARTED, Ev.FAILURE, Ev.FAILURE, Ev.STOPPED], [S.RUNNING, S.STOPPING, S.STOPPING, S.FAILED]),
    (0, False, [Ev.LAUNCH_FAILED], [S.FAILED]),
    (0, False, [Ev.INTERRUPT], [S.INTERRUPTED]),
    (0, False, [Ev.STARTED, Ev.TIMEOUT, Ev.STOPPED], [S.RUNNING, S.STOPPING, S.TIMED_OUT]),
    (0, True, [Ev.STARTED, Ev.TIMEOUT, Ev.STOPPED], [S.PREFETCHING, S.STOPPING, S.TIMED_OUT]),
    (0, False, [Ev.STARTED, Ev.INTERRUPT, Ev.STOPPED], [S.RUNNING, S.STOPPING, S.INTERRUPTED]),
    # restarts: a failure with restarts left goes round; the last one fails
    (2, False, [Ev.STARTED, Ev.FAILURE, Ev.STOPPED, Ev.RESTART, Ev.STARTED, Ev.ALL_EXITED],
     [S.RUNNING, S.STOPPING, S.RESTARTING, S.PREPARING, S.RUNNING, S.SUCCEEDED]),
    (1, False, [Ev.STARTED, Ev.FAILURE, Ev.STOPPED, Ev.RESTART, Ev.STARTED, Ev.FAILURE, Ev.STOPPED],
     [S.RUNNING, S.STOPPING, S.RESTARTING, S.PREPARING, S.RUNNING, S.STOPPING, S.FAILED]),
    # a timeout or an interrupt is never restarted
    (3, False, [Ev.STARTED, Ev.TIMEOUT, Ev.STOPPED], [S.RUNNING, S.STOPPING, S.TIMED_OUT]),
    (3, False, [Ev.STARTED, Ev.FAILURE, Ev.INTERRUPT, Ev.STOPPED],
     [S.RUNNING, S.STOPPING, S.STOPPING, S.INTERRUPTED]),
    (3, False, [Ev.STARTED, Ev.FAILURE, Ev.STOPPED, Ev.INTERRUPT],
     [S.RUNNING, S.STOPPING, S.RESTARTING, S.INTERRUPTED]),
    (3, False, [Ev.STARTED, Ev.FAILURE, Ev.STOPPED, Ev.RESTART, Ev.INTERRUPT],
     [S.RUNNING, S.STOPPING, S.RESTARTING, S.PREPARING, S.INTERRUPTED]),
    (1, False, [Ev.STARTED, Ev.FAILURE, Ev.STOPPED, Ev.RESTART, Ev.LAUNCH_FAILED],
     [S.RUNNING, S.STOPPING, S.RESTARTING, S.PREPARING, S.FAILED]),
]


@pytest.mark.parametrize("max_restarts, loaders, events, states", PATHS)
def test_paths_through_the_states(max_restarts, loaders, events, states):
    machine = Machine(max_restarts, has_loaders=loaders)
    assert machine.state is S.PREPARING
    assert [machine.on(event) for event in events] == states


@pytest.mark.parametrize("state, event", [
    (S.PREPARING, Ev.ALL_EXITED), (S.PREPARING, Ev.STOPPED), (S.RUNNING, Ev.STARTED),
    (S.RUNNING, Ev.STOPPED), (S.RUNNING, Ev.RESTART), (S.STOPPING, Ev.ALL_EXITED),
    (S.RESTARTING, Ev.STARTED), (S.SUCCEEDED, Ev.FAILURE), (S.FAILED, Ev.RESTART),
])
def test_impossible_transitions_are_refused(state, event):
    machine = Machine(5)
    machine.state = state
    with pytest.raises(InvalidTransition):
        machine.on(event)


def test_restarts_count_and_history():
    machine = Machine(2)
    for event in (Ev.STARTED, Ev.FAILURE, Ev.STOPPED, Ev.RESTART) * 2:
        machine.on(event)
    assert machine.restarts == 2 and machine.state is S.PREPARING and machine.cause is None
    assert machine.history[:5] == [S.PREPARING, S.RUNNING, S.STOPPING, S.RESTARTING, S.PREPARING]


def test_every_state_is_reachable_and_finals_are_final():
    reached = {s for _, _, _, states in PATHS for s in states} | {S.PREPARING}
    assert reached == set(State)
    assert {s for s in State if s.final} == {S.SUCCEEDED, S.FAILED, S.INTERRUPTED, S.TIMED_OUT}


# -- the supervisor, driven by a scripted launcher ---------------------------------------------


def _job(world=2, **policy):
    payload = Payload(source="x = 1", filename="<cell>", first_line=1, names=b"", bound=("x",),
                      device="cpu", backend="gloo", pg_timeout=60.0)
    return Job("j1", "/nowhere", payload, World(world, "cpu", "gloo"), Policy(**policy))


def _ok(world=2):
    return ([OutputChunk("rank0", "stdout", b"hi\n")] + [ProcessExit(f"rank{r}", 0, 0) for r in range(world)],
            {("rank0", RESULT): pickle.dumps({"values": {}, "skipped": {}, "out": None})})


def _fail(rank=1, message="boom"):
    record = {"time": 1.0, "exit_code": 1, "chain": [{"type": "ValueError", "module": "builtins",
                                                     "text": f"ValueError: {message}",
                                                     "frames": [], "relation": None}]}
    import json

    return ([ProcessExit(f"rank{rank}", 0, 1), ProcessExit(f"rank{1 - rank}", 0, -15)],
            {(f"rank{rank}", error_name(f"rank{rank}")): json.dumps(record).encode()})


def test_a_job_that_succeeds_brings_the_result_back_and_closes_its_attempt():
    launcher, sink = ScriptedLauncher([_ok()]), Sink()
    supervisor = Supervisor(launcher, _job(), sink)
    outcome = supervisor.run()
    assert outcome.result is not None and outcome.exit_codes == {"rank0": 0, "rank1": 0}
    assert supervisor.machine.history == [S.PREPARING, S.RUNNING, S.SUCCEEDED]
    spec = launcher.specs[0]
    assert [p.rank for p in spec.processes] == [0, 1] and spec.restart == 0
    assert pickle.loads(spec.files["payload.pkl"]).source == "x = 1"
    assert launcher.handles[0].closed and ("stdout", "[rank0] hi\n") in sink.text


def test_a_failure_restarts_with_the_next_count_and_one_line():
    launcher, sink = ScriptedLauncher([_fail(message="first"), _ok()]), Sink()
    supervisor = Supervisor(launcher, _job(max_restarts=2), sink)
    supervisor.run()
    assert [s.restart for s in launcher.specs] == [0, 1]
    assert [s.max_restarts for s in launcher.specs] == [2, 2]
    assert ("stderr", "taas: restart 1/2: rank1 failed: ValueError: first\n") in sink.text
    assert all(h.closed for h in launcher.handles)
    assert supervisor.machine.history[-3:] == [S.PREPARING, S.RUNNING, S.SUCCEEDED]


def test_the_last_failure_is_raised_with_the_restart_count():
    launcher = ScriptedLauncher([_fail(message="a"), _fail(message="b")])
    supervisor = Supervisor(launcher, _job(max_restarts=1), Sink())
    with pytest.raises(JobFailed) as info:
        supervisor.run()
    assert str(info.value) == "rank1 failed: ValueError: b (after 1 restart)"
    assert supervisor.machine.state is S.FAILED and len(launcher.specs) == 2


def test_a_launch_error_fails_the_job_at_once():
    class Refusing(ScriptedLauncher):
        def start(self, spec):
            raise LaunchError("no room")

    supervisor = Supervisor(Refusing([]), _job(max_restarts=3), Sink())
    with pytest.raises(LaunchError):
        supervisor.run()
    assert supervisor.machine.history == [S.PREPARING, S.FAILED]


def test_an_error_while_preparing_fails_the_job():
    """Anything that goes wrong before the processes start (a registered loader that cannot
    be sent, say) ends the job as failed, not stuck in PREPARING."""
    class Broken(ScriptedLauncher):
        def start(self, spec):
            raise OSError("the disk went away")

    supervisor = Supervisor(Broken([]), _job(), Sink())
    with pytest.raises(OSError):
        supervisor.run()
    assert supervisor.machine.history == [S.PREPARING, S.FAILED]


# -- bad input on the events pipe: ignored and logged, never the job's end ---------------------
class DisplaySink(Sink):
    """A sink that shows displays, refusing what IPython's publisher refuses."""

    def __init__(self):
        super().__init__()
        self.displays = []

    def display(self, data, metadata):
        if not isinstance(data, dict) or not isinstance(metadata, dict):
            raise TypeError(f"data must be a dict, got: {data!r}")
        if "application/x-refused" in data:
            raise ValueError("the notebook refuses this bundle")
        self.displays.append((data, metadata))


def _events(key, *lines):
    # Sent in pieces that split lines, as a pipe may deliver them.
    data = b"".join(lines)
    return [OutputChunk(key, "events", data[i:i + 7]) for i in range(0, len(data), 7)]


BAD_LINES = (b'{"kind": "display", "data": 5}\n', b"not json\n", b"[1, 2]\n",
             b'{"kind": "stack", "frames": 7}\n', b'{"kind": "comm", "ops": "many"}\n',
             b'{"kind": "data.progress", "loader": 3}\n', b'{"kind": "done", "n": ' + b"9" * 5000 + b"}\n")


def test_lines_that_are_not_messages_are_ignored_and_the_job_still_succeeds(caplog):
    script, files = _ok()
    good = b'{"kind": "display", "data": {"text/plain": "shown"}, "metadata": {}}\n'
    refused = b'{"kind": "display", "data": {"application/x-refused": 1}, "metadata": {}}\n'
    comm = b'{"kind": "comm", "ops": 3}\n'
    script = _events("rank0", *BAD_LINES, good, refused, comm) + _events("rank1", *BAD_LINES) + script
    launcher, sink = ScriptedLauncher([(script, files)]), DisplaySink()
    supervisor = Supervisor(launcher, _job(), sink)
    with caplog.at_level("WARNING", logger="taas"):
        outcome = supervisor.run()
    assert outcome.result is not None and supervisor.machine.history[-1] is S.SUCCEEDED
    assert sink.displays == [({"text/plain": "shown"}, {})]
    assert outcome.comm_ops == {"rank0": 3}
    assert ("stdout", "[rank0] hi\n") in sink.text
    logged = [r.getMessage() for r in caplog.records]
    assert sum("rank0's events pipe" in m for m in logged) == len(BAD_LINES)
    assert sum("rank1's events pipe" in m for m in logged) == len(BAD_LINES)
    assert any("the notebook cannot show" in m for m in logged)


class FakePlane:
    """The data plane as the supervisor uses it, keeping the figures it is given."""

    def __init__(self, fail_on=None):
        self.settings: dict = {}
        self.figures, self.fail_on, self.finished = [], fail_on, False

    def open(self, attempt_id, transport):
        pass

    def processes(self, env, storage):
        return []

    def cleanups(self):
        return []

    def on_event(self, key, message, sink):
        if message.get("worker") == self.fail_on:
            raise KeyError("worker")
        self.figures.append((key, message))

    def ready(self):
        return any(m.get("ready") for _, m in self.figures)

    def finish(self, sink):
        self.finished = True

    def close(self):
        pass


def test_data_plane_figures_reach_the_plane_only_when_well_formed(caplog):
    import dataclasses

    script, files = _ok()
    progress = b'{"kind": "data.progress", "loader": "train", "worker": 0, "produced": 2, "ready": true}\n'
    unusable = b'{"kind": "data.progress", "loader": "train", "worker": 9, "produced": 2}\n'
    bad = (b'{"kind": "data.progress", "loader": "train", "worker": "0", "produced": 2}\n',
           b'{"kind": "data.stats", "loader": "train", "rank": 0}\n')
    script = _events("loader:train:0", *bad, unusable, progress) + script
    plane = FakePlane(fail_on=9)
    job = dataclasses.replace(_job(), data=plane)
    supervisor = Supervisor(ScriptedLauncher([(script, files)]), job, Sink())
    with caplog.at_level("WARNING", logger="taas"):
        outcome = supervisor.run()
    assert outcome.result is not None
    assert [m["worker"] for _, m in plane.figures] == [0] and plane.finished
    assert supervisor.machine.history == [S.PREPARING, S.PREFETCHING, S.RUNNING, S.SUCCEEDED]
    assert len(caplog.records) == 3, [r.getMessage() for r in caplog.records]


def test_an_unreadable_failure_report_is_no_report():
    script, _ = _fail()
    files = {("rank1", error_name("rank1")): b"[1, 2]"}
    supervisor = Supervisor(ScriptedLauncher([(script, files)]), _job(), Sink())
    with pytest.raises(JobFailed) as info:
        supervisor.run()
    assert str(info.value) == "rank1 exited with code 1"
