"""taas.host.ray.spares: a kernel's warm job host on a cluster, over a recording stand-in for
Ray.  A spare is made after a detached cell for the settings of that moment, taken once by the
next cell with the same settings, let go when the settings changed or the kernel closes it;
the job's record names the spare that took it (``host_name``)."""

from __future__ import annotations

import pytest

from taas.errors import LaunchError
from taas.host.ray import keys
from taas.host.ray.client import host_name
from taas.host.ray.spares import ClusterSpares
from taas.host.ray.store import RayStore
from tests.support.kv import DictKV


class Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args):
        self.actor.calls.append((self.name, args))
        return self.actor.answers.get(self.name)  # what ray.get of the call's ref gives (FakeRay.get)


class Actor:
    def __init__(self, options, args):
        self.options, self.args, self.calls = options, args, []
        self.answers = {"cuda_devices": 8}

    def __getattr__(self, name):
        return Method(self, name)


class FakeRay:
    """What the spares call of Ray: remote(cls).options(...).remote(...), kill."""

    def __init__(self, fail: bool = False):
        self.made: list[Actor] = []
        self.killed: list[Actor] = []
        self.fail = fail

    def remote(self, cls):
        ray = self

        class Options:
            def options(self, **options):
                class Made:
                    def remote(self, *args):
                        if ray.fail:
                            raise RuntimeError("the GCS did not answer")
                        actor = Actor(options, args)
                        ray.made.append(actor)
                        return actor
                return Made()
        return Options()

    def kill(self, actor):
        self.killed.append(actor)

    def get(self, ref, timeout=None):
        if isinstance(ref, Exception):  # the call failed on the actor's side
            raise ref
        return ref

    def get_actor(self, name, namespace):
        found = [a for a in self.made if a.options["name"] == name and a not in self.killed]
        if namespace != keys.NAMESPACE or not found:
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return found[0]


class Launcher:
    def __init__(self, ray, address="10.0.0.1:6379"):
        self.ray, self.address = ray, address

    def connect(self):
        return self.ray


def test_a_spare_is_a_detached_warming_host_taken_once_by_the_next_cell_with_its_settings(monkeypatch):
    monkeypatch.delenv("TAAS_WORKDIR_LIMIT", raising=False)
    ray = FakeRay()
    spares = ClusterSpares()
    launcher = Launcher(ray)
    assert spares.take(launcher, "auto", None) is None  # none made yet
    spares.prewarm(launcher, "auto", None)
    spares.prewarm(launcher, "auto", None)  # one at most
    assert len(ray.made) == 1
    actor = ray.made[0]
    assert actor.options["lifetime"] == "detached" and actor.options["num_cpus"] == 0
    assert actor.options["name"].startswith(f"taas-spare-{keys.owner()}-")
    assert actor.args[1] == ""  # no job yet
    assert actor.calls == []  # it warms itself as it is made: no call its kernel might not live to make
    spare = spares.take(launcher, "auto", None)
    assert spare is not None and spare.handle is actor and spare.name == actor.options["name"]
    assert spares.take(launcher, "auto", None) is None  # taken once
    assert ray.killed == []


@pytest.mark.parametrize("change", ["workdir", "address", "env"])
def test_a_spare_made_for_other_settings_is_let_go_and_not_taken(monkeypatch, change):
    ray = FakeRay()
    spares = ClusterSpares()
    spares.prewarm(Launcher(ray), "auto", None)
    launcher, workdir = Launcher(ray), "auto"
    if change == "workdir":
        workdir = "copy"
    elif change == "address":
        launcher = Launcher(ray, "10.0.0.2:6379")
    else:
        monkeypatch.setenv("TAAS_LOG_CAP", "1000")  # the host would run with other TAAS_* settings
    assert spares.take(launcher, workdir, None) is None
    assert ray.killed == ray.made


def test_a_spare_that_ended_meanwhile_is_not_taken():
    ray = FakeRay()
    spares = ClusterSpares()
    spares.prewarm(Launcher(ray), "auto", None)
    ray.killed.append(ray.made[0])  # it ended by itself (its kernel watch, a crash)
    assert spares.take(Launcher(ray), "auto", None) is None


def test_close_lets_the_spare_go_and_a_failing_cluster_means_no_spare():
    ray = FakeRay()
    spares = ClusterSpares()
    spares.prewarm(Launcher(ray), "auto", None)
    spares.close()
    assert ray.killed == ray.made and len(ray.made) == 1
    failing = ClusterSpares()
    failing.prewarm(Launcher(FakeRay(fail=True)), "auto", None)  # no spare; no error either
    assert failing.take(Launcher(FakeRay()), "auto", None) is None


def test_the_record_names_the_spare_that_took_the_job_else_the_jobs_own_actor():
    me = "ann.1000"
    store = RayStore(DictKV(), where="10.0.0.1:6379", owner=me)
    assert host_name(store, "a1b2c3") == keys.actor_name(me, "a1b2c3")
    store.put("d4e5f6", keys.HOST, keys.spare_name(me, "0123456789abcdef").encode())
    assert host_name(store, "d4e5f6") == f"taas-spare-{me}-0123456789abcdef"
    with pytest.raises(ValueError):
        keys.spare_name(me, "../x")


class FailingSession:
    """A kernel's Session whose cell cannot become a job (a value that cannot be shipped)."""

    workdir, workdir_limit = "auto", None

    def __init__(self):
        self.asked: dict = {}

    def detached_job(self, *args, **kwargs):
        self.asked = kwargs
        raise LaunchError("cannot ship `model`")


def _detach(session, ray, store: RayStore, spares: ClusterSpares):
    """A detached cell ``x = 1`` on the cluster, as the magic starts it."""
    from taas.host.ray.client import start_there

    return start_there(session, Launcher(ray), store, "x = 1", {}, None, filename="<cell>", text="x = 1",
                       hidden=frozenset(), name_for=lambda name: None, notebook="nb", hashed="x = 1", sink=None,
                       spares=spares)


def test_the_host_comes_first_says_the_cuda_devices_and_stays_the_spare_if_the_cell_fails(monkeypatch):
    """A detached cell on a cluster asks its host (the spare, else one made now) how many CUDA
    devices the ranks see -- the kernel starts no node agents of its own -- and a cell that
    fails before its job is handed over leaves that host as the kernel's spare, not killed."""
    monkeypatch.delenv("TAAS_WORKDIR_LIMIT", raising=False)
    ray = FakeRay()
    spares = ClusterSpares()
    session = FailingSession()
    store = RayStore(DictKV(), where="10.0.0.1:6379", owner=keys.owner())
    with pytest.raises(LaunchError, match="cannot ship"):
        _detach(session, ray, store, spares)
    assert len(ray.made) == 1 and ray.killed == []
    host = ray.made[0]
    assert host.args[1] == ""  # made as a spare: it ends itself if this kernel goes before a job comes
    assert ("cuda_devices", ()) in host.calls and session.asked["cuda_devices"] == 8
    assert not [c for c in host.calls if c[0] == "start"]  # no job given
    spare = spares.take(Launcher(ray), "auto", None)
    assert spare is not None and spare.handle is host  # the next detached cell takes it
    assert store.ids() == []  # no record of a job that never started


def test_a_host_that_cannot_say_its_cuda_devices_is_let_go_not_kept_as_the_spare(monkeypatch):
    monkeypatch.delenv("TAAS_WORKDIR_LIMIT", raising=False)
    ray = FakeRay()
    spares = ClusterSpares()
    spares.prewarm(Launcher(ray), "auto", None)
    ray.made[0].answers["cuda_devices"] = RuntimeError("the actor died")
    session = FailingSession()
    store = RayStore(DictKV(), where="10.0.0.1:6379", owner=keys.owner())
    with pytest.raises(LaunchError, match="could not start a job host on the cluster: the actor died"):
        _detach(session, ray, store, spares)
    assert ray.killed == ray.made and session.asked == {}  # no cell was made for a host that is not there
    assert spares.take(Launcher(ray), "auto", None) is None
