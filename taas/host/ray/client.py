"""The viewer's side of a job on a Ray cluster: start it under a JobHost actor, take its results,
cancel it, and the store of a connected kernel.  Following it and its failure are taas.host's
own (``client.follow``, ``client.raise_failure``) on a :class:`RayStore`."""

from __future__ import annotations

import pickle
import secrets
import time

from taas.errors import LaunchError
from taas.host import client
from taas.host.api import Request, Returned
from taas.host.ray import keys
from taas.host.ray.spares import ClusterSpares, new_host
from taas.host.ray.store import RayKV, RayStore
from taas.jobs.api import JobRecord, State
from taas.jobs.store import JobError, new_id

STARTED = 600.0  # the host has this long to say its ranks run (a cold actor imports torch)


def connect(address: str):
    """A connection to the cluster at ``address`` for a terminal (``taas --cluster``): what
    :func:`store_for` and :func:`cancel` take (``connect()``, ``address``)."""
    from taas.launch.ray.cluster import RayCluster

    return RayCluster(address)


def store_for(launcher) -> RayStore:
    """The records of this user on ``launcher``'s cluster (connects if needed)."""
    ray = launcher.connect()
    who = keys.owner()

    def alive(job_id: str) -> bool | None:
        try:
            ray.get_actor(host_name(store, job_id), namespace=keys.NAMESPACE)
            return True
        except ValueError:  # no such actor: it died (or never started)
            return False
        except Exception:  # broad: the GCS did not answer; cannot tell
            return None

    store = RayStore(RayKV(), where=launcher.address, owner=who, alive=alive)  # alive() reads its host key
    return store


def host_name(store: RayStore, job_id: str) -> str:
    """The name of the actor that hosts ``job_id``: a kernel's spare that took it, or its own."""
    return (store.get(job_id, keys.HOST) or b"").decode() or keys.actor_name(store.owner, job_id)


def _actor(ray, store: RayStore, job_id: str):
    try:
        return ray.get_actor(host_name(store, job_id), namespace=keys.NAMESPACE)
    except ValueError:
        return None


def start(launcher, store: RayStore, request: Request, *, ranks: int, notebook: str, sink,
          hashed: str, workdir: str = "auto", workdir_limit: int | None = None,
          spares: ClusterSpares | None = None) -> JobRecord:
    """``request`` under a detached JobHost actor on ``launcher``'s cluster (``spares``' warm
    one, else a new one); its output shown until the ranks run; its record then (and the
    next spare on its way).  An interrupt meanwhile cancels it."""
    ray = launcher.connect()
    taken = set(store.ids())
    job_id = new_id()
    while job_id in taken:
        job_id = new_id()
    record = JobRecord(id=job_id, state=State.WAITING, ranks=ranks, where=launcher.address,
                       started=time.time(), notebook=notebook,
                       first_line=client.first_code_line(request.text or request.source),
                       source_hash=client.source_hash(hashed), cwd=request.cwd)
    store.put(job_id, keys.SECRET, secrets.token_hex(32).encode())
    spare = spares.take(launcher, workdir, workdir_limit) if spares is not None else None
    if spare is not None:  # the record names the host before it can be listed
        store.put(job_id, keys.HOST, spare.name.encode())
    store.create(record)
    try:
        if spare is not None:
            host = spare.handle
        else:
            host = new_host(ray, store.owner, keys.actor_name(store.owner, job_id), job_id, launcher.address,
                            workdir, workdir_limit)
        host.start.remote(pickle.dumps(request), job_id)
    except Exception as exc:  # broad: any Ray error means no host
        store.write(record.replace(state=State.FAILED, ended=time.time(), cause=f"no job host: {exc}"))
        raise LaunchError(f"taas: could not start a job host for job {job_id} on the cluster: {exc}") from None
    follower = client.Follower(store, job_id, sink)
    deadline = time.monotonic() + STARTED
    try:
        while True:
            follower.step()
            record = store.read(job_id)
            if record.state is not State.WAITING or time.monotonic() > deadline:
                break
            time.sleep(client.POLL)
    except KeyboardInterrupt:
        cancel(launcher, store, job_id)
        raise
    if spares is not None:  # the next detached cell's host, made while this job runs
        spares.prewarm(launcher, workdir, workdir_limit)
    if record.state is State.WAITING:
        cancel(launcher, store, job_id)
        raise LaunchError(f"taas: the job host of job {job_id} did not start within {STARTED:.0f} s")
    if record.state.final:
        follower.finish()
        client.raise_failure(store, record)
    return record


def take(store: RayStore, record: JobRecord) -> Returned:
    """Rank 0's names and Out[] of the finished job ``record``, once."""
    data = store.claim_results(record.id)
    if data is None:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(record.taken)) if record.taken else "earlier"
        raise JobError(f"taas: job {record.id}'s results were already taken ({when}); its output "
                       f"is still there: `%taas logs {record.id}`")
    return pickle.loads(data)


def cancel(launcher, store: RayStore, job_id: str) -> JobRecord:
    """Stop job ``job_id`` (its host proves nothing to us; we prove the job's secret to it)."""
    ray = launcher.connect()
    record = store.read(job_id)
    if record.state.final:
        raise JobError(f"taas: job {job_id} already ended ({record.state.value}); nothing to cancel")
    host = _actor(ray, store, job_id)
    if host is not None:
        token = (store.get(job_id, keys.SECRET) or b"").decode()
        try:
            ray.get(host.cancel.remote(token), timeout=30)
        except Exception:  # broad: the host died meanwhile; the record says what it says
            pass
    for _ in range(int(client.CANCEL_GRACE * 2 / client.POLL)):
        record = store.read(job_id)
        if record.state.final:
            break
        time.sleep(client.POLL)
    return record
