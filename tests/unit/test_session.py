"""The session as the composition root, driven by a scripted launcher (no process anywhere):
a cell becomes a Job, the job runs, rank 0's results come back through taas.job.results."""

from __future__ import annotations

import pickle

import pytest

from taas import directive
from taas.errors import CellSyntaxError
from taas.job import results
from taas.job.api import PAYLOAD
from taas.launch.api import RESULT, ProcessExit
from taas.session import CellResult, Session, transport_for, working_directory  # noqa: F401 - the re-exports
from tests.support.scripted import OneMachine, ScriptedHandle, Sink


class OneShotLauncher(OneMachine):
    """Every process exits 0 at once; rank 0 left ``result`` (if any)."""

    def __init__(self, result: bytes | None = None):
        self.result, self.specs = result, []

    def start(self, spec):
        self.specs.append(spec)
        return ScriptedHandle(spec, [ProcessExit(p.key, 0, 0) for p in spec.processes],
                              {} if self.result is None else {("rank0", RESULT): self.result})


def _run(launcher, source, namespace=None, argline="--gpus 2"):
    session = Session(launcher)
    try:
        return session, session.run_cell(source, namespace if namespace is not None else {},
                                         directive.parse_options(argline), sink=Sink())
    finally:
        session.close()


def test_rank_0s_results_become_names_out_and_notes():
    sent = results.collect({"x": 41, "mod": pickle}, ("x", "mod"), "out", to_cpu=True)
    session, got = _run(OneShotLauncher(results.encode(sent)), "x = 41\nmod = pickle\n'out'",
                        {"pickle": pickle})
    assert isinstance(got, CellResult)
    assert got.values == {"x": 41, "mod": pickle} and got.has_out and got.out == "out"
    assert session.last.outcome == "ok" and session.last.world_size == 2


def test_the_job_carries_the_cell_and_the_payload_name_is_the_launchers_file():
    launcher = OneShotLauncher(results.encode(results.Results()))
    _run(launcher, "y = 1")
    [spec] = launcher.specs
    payload = pickle.loads(spec.files[PAYLOAD])
    assert payload.source == "y = 1" and payload.bound == ("y",) and payload.results_to_cpu


def test_no_results_file_brings_nothing_back():
    _, got = _run(OneShotLauncher(None), "import sys; sys.exit(0)")
    assert got == CellResult()


def test_results_off_brings_nothing_back_even_when_rank_0_wrote_some():
    sent = results.encode(results.collect({"x": 1}, ("x",), None, to_cpu=True))
    _, got = _run(OneShotLauncher(sent), "x = 1", argline="--gpus 2 --no-results")
    assert got == CellResult()


def test_a_syntax_error_fails_before_launch_at_the_cells_line():
    launcher = OneShotLauncher()
    with pytest.raises(CellSyntaxError) as info:
        _run(launcher, "x = 1\ny = (")
    assert launcher.specs == []
    assert "SyntaxError" in str(info.value) and "(line 2)" in str(info.value)


class CheckedLauncher(OneShotLauncher):
    """Records what the session asks it to make room for."""

    def __init__(self):
        super().__init__(None)
        self.checked = []

    def check(self, processes, device="cpu", ranks=None):
        self.checked.append((processes, ranks))


class HeldNothing:
    """Kept ranks (as the session sees them while it makes a cell's job) holding no value."""

    def holds(self, name, value):
        return False


def test_room_is_checked_for_the_processes_a_cell_starts_and_none_on_kept_ranks():
    launcher = CheckedLauncher()
    session = Session(launcher)
    try:
        options = directive.parse_options("--gpus 2")
        for kept in (None, HeldNothing()):
            _, _, big = session._job(launcher, ".", "y = 1", "<cell>", 1, {}, options, Sink(),
                                     frozenset(), None, kept=kept, keep=kept is not None)
            big.unlink(wait=False)
    finally:
        session.close()
    assert launcher.checked == [(2, 2)]  # fresh ranks: two start; kept ones run already


def test_a_ctrl_c_before_the_run_takes_the_job_leaves_no_results_channel(monkeypatch):
    """The job's results channel (a socket pair and its thread) is made with the job: a Ctrl-C
    before the run took it over closes it (an interrupt fuzz leaked four descriptors a time)."""
    import os
    import threading

    session = Session(OneShotLauncher(None))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # the user's Ctrl-C, as the run is about to begin

    monkeypatch.setattr(session, "_run", interrupted)
    fds, threads = len(os.listdir("/proc/self/fd")), threading.active_count()
    try:
        with pytest.raises(KeyboardInterrupt):
            session.run_cell("y = 1", {}, directive.parse_options("--gpus 2"), sink=Sink())
        assert len(os.listdir("/proc/self/fd")) == fds
        assert threading.active_count() == threads
    finally:
        session.close()
