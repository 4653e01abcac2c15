"""The session with kept ranks, driven by a scripted launcher whose ranks say ``done`` per cell
(no process anywhere): which names each cell ships, reuse, --fresh, lost ranks, refusals."""

from __future__ import annotations

import pickle

import pytest
import torch

from taas import directive
from taas.errors import DirectiveError
from taas.job.api import PAYLOAD
from taas.job.package import unship
from taas.launch.api import JobHandle, Launcher, OutputChunk, Topology
from taas.session import Session


class KeptHandle(JobHandle):
    """Ranks that say done after every cell; ``payloads`` holds each cell's payload."""

    def __init__(self, spec):
        self.spec, self.payloads, self.stopped, self.gone = spec, [pickle.loads(spec.files[PAYLOAD])], False, None
        self.script = self._done()

    def _done(self):
        return [OutputChunk(p.key, "events", b'{"kind": "done"}\n') for p in self.spec.processes]

    @property
    def keys(self):
        return [p.key for p in self.spec.processes]

    def events(self, timeout):
        out, self.script = self.script, []
        return out

    def drain(self, timeout=2.0):
        return []

    def stop(self, grace=1.0):
        self.stopped = True

    def fetch(self, key, name):
        return None

    def request_stacks(self, keys):
        return []

    def layers(self):
        return []

    def close(self):
        self.stop()

    def lost(self):
        return self.gone

    def next_cell(self, files, payload, result):
        self.payloads.append(pickle.loads(files[payload]))
        self.script = self._done()


class KeepingLauncher(Launcher):
    keeps_ranks = True

    def __init__(self):
        self.handles: list[KeptHandle] = []

    def cuda_devices(self):
        return 0

    def start(self, spec):
        assert all(p.env.get("TAAS_KEEP") == "1" for p in spec.processes)
        self.handles.append(KeptHandle(spec))
        return self.handles[-1]

    def topology(self, world):
        return Topology(rank_nodes=(0,) * world)

    def shutdown(self):
        pass


class Sink:
    def __init__(self):
        self.text = []

    def write(self, stream, text):
        self.text.append(text)


def shipped(payload) -> set:
    return set(unship(payload.names)) - {"__builtins__"}


def test_a_kept_cell_ships_only_what_the_ranks_lack_or_the_notebook_changed():
    launcher = KeepingLauncher()
    session = Session(launcher)
    ns = {"t": torch.zeros(3), "n": 1, "xs": [1]}
    try:
        session.run_cell("t; n; xs", ns, directive.parse_options("--gpus 2 --keep"), sink=Sink())
        session.run_cell("t; n; xs", ns, directive.parse_options(""), sink=Sink())
        ns["t"].add_(1)
        ns["xs"].append(2)
        session.run_cell("t; n; xs", ns, directive.parse_options("--gpus 2"), sink=Sink())
        ns["n"] = 2
        session.run_cell("t; n; xs", ns, directive.parse_options(""), sink=Sink())
        assert len(launcher.handles) == 1  # one start, four cells
        assert [shipped(p) for p in launcher.handles[0].payloads] == [
            {"t", "n", "xs"}, set(), {"t", "xs"}, {"n"}]
    finally:
        session.close()
    assert launcher.handles[0].stopped and session.kept is None


def test_fresh_another_world_and_lost_ranks_start_fresh_ones_with_one_line():
    launcher = KeepingLauncher()
    session = Session(launcher)
    try:
        session.run_cell("x = 1", {}, directive.parse_options("--gpus 2 --keep"), sink=Sink())
        for argline, why in [("--gpus 2 --fresh --keep", "--fresh"),
                             ("--gpus 1 --keep", "asks for 1 rank(s) on cpu/gloo")]:
            sink = Sink()
            session.run_cell("x = 1", {}, directive.parse_options(argline), sink=sink)
            lines = [t for t in sink.text if "released the kept ranks" in t]
            assert len(lines) == 1 and why in lines[0]
        launcher.handles[-1].gone = "rank0 ended (signal 9)"
        sink = Sink()
        session.run_cell("x = 1", {}, directive.parse_options("--keep"), sink=sink)
        assert any("rank0 ended (signal 9), so their state is lost" in t for t in sink.text)
        assert len(launcher.handles) == 4 and all(h.stopped for h in launcher.handles[:3])
        assert session.release() == "taas: released the kept ranks (1 on cpu/gloo)"
    finally:
        session.close()


class PlainLauncher(KeepingLauncher):
    keeps_ranks = False


def test_keep_is_refused_where_the_launcher_cannot_keep_ranks():
    session = Session(PlainLauncher())
    try:
        with pytest.raises(DirectiveError, match="--keep is not supported by this launcher"):
            session.run_cell("x = 1", {}, directive.parse_options("--keep"), sink=Sink())
        session.launcher_for = lambda address: PlainLauncher()  # a cluster's launcher
        with pytest.raises(DirectiveError, match="--keep is not supported on a cluster yet"):
            session.run_cell("x = 1", {}, directive.parse_options("--keep --cluster ray://x:1"), sink=Sink())
    finally:
        session.close()


class ClusterLauncher(KeepingLauncher):
    """A cluster's launcher that keeps ranks (as the Ray launcher does)."""

    where = "the cluster"

    def __init__(self, address):
        super().__init__()
        self.address, self.down = address, False

    def describe(self):
        return [f"taas: cluster at {self.address}"]

    def shutdown(self):
        self.down = True


def test_kept_ranks_on_a_cluster_the_session_leaves_are_released_first_with_one_line():
    session = Session(KeepingLauncher())
    try:
        for leave in ("%taas cluster local", "a cell on another cluster"):
            cluster = session._cluster_launcher = ClusterLauncher("ray://x:1")
            session.run_cell("x = 1", {}, directive.parse_options("--gpus 2 --keep --cluster ray://x:1"),
                             sink=Sink())
            assert session.kept is not None and session.kept.launcher is cluster
            if leave == "%taas cluster local":
                lines = session.use_cluster("local")
                assert lines[0] == ("taas: released the kept ranks (2 on cpu/gloo): the session now "
                                    "runs cells elsewhere"), lines
            else:
                sink = Sink()
                session.launcher_for = lambda address: KeepingLauncher()  # another cluster's
                session.run_cell("x = 1", {}, directive.parse_options("--gpus 2 --keep --cluster ray://y:1"),
                                 sink=sink)
                del session.launcher_for
                lines = [t for t in sink.text if "released the kept ranks" in t]
                assert len(lines) == 1 and "this cell runs elsewhere" in lines[0], sink.text
            assert cluster.handles[0].stopped
            assert session.kept is None or session.kept.launcher is not cluster  # the new cell's
            session.release()
    finally:
        session.close()


def test_a_registered_loader_on_kept_ranks_of_a_cluster_runs_its_loader_job_beside_them():
    """On a cluster (the TCP transport: relays on the GPU nodes) a kept cell that reads a
    registered loader starts that cell's loader job next to the kept ranks, every cell afresh."""
    from torch.utils.data import DataLoader

    from taas.data import registry

    class LoaderJob(KeptHandle):
        def __init__(self, spec):  # no payload, and nothing to say: the cell ends with its ranks
            self.spec, self.payloads, self.stopped, self.gone, self.script = spec, [], False, None, []

    class TcpCluster(ClusterLauncher):
        def __init__(self, address):
            super().__init__(address)
            self.loader_jobs: list[LoaderJob] = []

        def topology(self, world):
            return Topology(rank_nodes=(0,) * world, host="127.0.0.1", kernel_machine=False)

        def start(self, spec):
            if any(p.rank is not None for p in spec.processes):
                return super().start(spec)
            self.loader_jobs.append(LoaderJob(spec))
            return self.loader_jobs[-1]

    loader = DataLoader(list(range(8)), batch_size=2)
    registry.register(loader)
    session = Session(KeepingLauncher())
    try:
        cluster = TcpCluster("ray://x:1")
        session.launcher_for = lambda address: cluster
        options = directive.parse_options("--gpus 2 --cpus 1 --keep --cluster ray://x:1")
        for _ in range(2):
            session.run_cell("for b in loader:\n    pass", {"loader": loader}, options, sink=Sink())
        (kept,), (first, second) = cluster.handles, cluster.loader_jobs
        assert [p.key for p in kept.spec.processes] == ["rank0", "rank1"]
        for handle in (first, second):  # each cell's loader workers and its node's relay
            assert [(p.key, p.node) for p in handle.spec.processes] == [("loader:loader:0", None),
                                                                        ("data-relay:0", 0)]
            assert handle.stopped
        assert [p.loaders["loader"]["address"].endpoint for p in kept.payloads] == [
            "taas.data.tcp.endpoint:TcpEndpoint"] * 2
        assert kept.payloads[0].loaders["loader"]["address"] != kept.payloads[1].loaders["loader"]["address"]
        assert session.kept is not None and not kept.stopped  # the ranks stay
    finally:
        session.close()
        registry.unregister(loader)


def test_a_rank_gone_between_the_check_and_the_next_cell_gives_fresh_ranks_and_one_line():
    """The kept ranks looked whole when the cell began, but ``next_cell`` found a rank ended
    (it died meanwhile): nothing was sent, so the cell runs on fresh ranks, with one line."""
    from taas.errors import KeptRanksGone

    launcher, sink = KeepingLauncher(), Sink()
    session = Session(launcher)
    try:
        session.run_cell("x = 1", {}, directive.parse_options("--gpus 2 --keep"), sink=Sink())
        first = launcher.handles[0]

        def gone(files, payload, result):
            raise KeptRanksGone("rank1 ended (killed by SIGKILL)")

        first.next_cell = gone
        session.run_cell("y = 2", {}, directive.parse_options("--gpus 2 --keep"), sink=sink)
        assert len(launcher.handles) == 2 and first.stopped  # fresh ranks ran the cell
        assert launcher.handles[1].payloads[0].source == "y = 2"
        lines = [t for t in sink.text if "released the kept ranks" in t]
        assert lines == ["taas: released the kept ranks (2 on cpu/gloo): rank1 ended (killed by SIGKILL), "
                         "so their state is lost; this cell starts fresh ranks\n"], sink.text
    finally:
        session.close()


class InterruptedAsItGoes(KeptHandle):
    """Kept ranks whose next cell meets a Ctrl-C as it goes out to them (held until it went:
    taas.shield.deferred_interrupt); they return from the cell when interrupted."""

    def __init__(self, spec):
        super().__init__(spec)
        self.interrupted: list[str] = []

    def next_cell(self, files, payload, result):
        import signal

        self.payloads.append(pickle.loads(files[payload]))  # the ranks run it: no done yet
        signal.raise_signal(signal.SIGINT)

    def interrupt(self, keys):
        self.interrupted += list(keys)
        self.script = [OutputChunk(k, "events", b'{"kind": "done", "failed": true}\n') for k in keys]
        return list(keys)


def test_a_ctrl_c_as_a_kept_cell_goes_out_interrupts_it_on_the_ranks_which_stay(python_sigint):
    launcher = KeepingLauncher()
    launcher.start = lambda spec: launcher.handles.append(InterruptedAsItGoes(spec)) or launcher.handles[-1]
    session = Session(launcher)
    try:
        session.run_cell("x = 1", {}, directive.parse_options("--gpus 2 --keep"), sink=Sink())
        [handle] = launcher.handles
        with pytest.raises(KeyboardInterrupt):
            session.run_cell("import time\ntime.sleep(600)", {}, directive.parse_options(""), sink=Sink())
        assert handle.interrupted == ["rank0", "rank1"]  # not left running the cell
        assert session.kept is not None and session.kept.handle is handle  # the ranks and state stay
    finally:
        session.close()
