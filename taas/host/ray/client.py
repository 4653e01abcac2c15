"""The viewer's side of a job on a Ray cluster: start it under a JobHost actor, take its results,
cancel it, and the store of a connected kernel.  Following it and its failure are taas.host's
own (``client.follow``, ``client.raise_failure``) on a :class:`RayStore`."""

from __future__ import annotations

import pickle
import secrets
import time

from taas.errors import LaunchError
from taas.host import client
from taas.host.api import Prepared, Returned
from taas.host.ray import keys
from taas.host.ray.spares import ClusterSpares, Spare
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


def start_there(session, launcher, store: RayStore, source: str, namespace: dict, options, *, filename: str,
                text: str, hidden: frozenset, name_for, notebook: str, hashed: str, sink,
                spares: ClusterSpares) -> JobRecord:
    """The cell's detached job on ``launcher``'s cluster: made by ``session`` as an attached
    cluster cell's is (:meth:`taas.session.Session.detached_job`), then run by a host actor
    there (:func:`start`); its record once its ranks run.

    The host comes first (``spares``' warm one, else one made now; ``spares`` is the kernel's,
    which keeps a host the cell did not use): it tells the kernel how many
    CUDA devices the ranks will see, from the node agents it starts for the job anyway, so the
    kernel starts none of its own.  If the cell fails before its job is handed over, the host
    stays as the kernel's spare (let go if it could not answer)."""
    from taas.host.cells import cell_sources

    job_id = fresh_id(store)
    host = spares.take(launcher, session.workdir, session.workdir_limit)
    if host is None:
        host = spares.make(launcher, session.workdir, session.workdir_limit,
                           name=keys.actor_name(store.owner, job_id))
    handed = False

    def hand_over(job, shown: tuple, seen: int) -> JobRecord:
        nonlocal handed
        handed = True
        sources = cell_sources()  # the notebook's cells, and how each is named ("Cell In[7]")
        labels = {name: label for name in sources if (label := name_for(name))}
        return start(launcher, store, Prepared(job, sources, labels, shown, options.keep), host, job_id=job_id,
                     notebook=notebook, sink=sink, hashed=hashed, skip=seen)  # the cell showed those lines

    try:
        cuda = spares.cuda_devices(host, STARTED)
    except LaunchError:  # it cannot say: no host to keep
        spares.let_go(host)
        raise
    except BaseException:  # interrupted while it warms: it stays the spare
        spares.give_back(host)
        raise
    try:
        record = session.detached_job(source, namespace, options, job_name=job_id, hand_over=hand_over,
                                      filename=filename, first_line=2, sink=sink, hidden=hidden,
                                      name_for=name_for, text=text, launcher=launcher, cuda_devices=cuda)
    except BaseException:
        if not handed:
            spares.give_back(host)
        raise
    spares.prewarm(launcher, session.workdir, session.workdir_limit)  # the next detached cell's host
    return record


def fresh_id(store: RayStore) -> str:
    """A job id no record of ``store`` has."""
    taken = set(store.ids())
    job_id = new_id()
    while job_id in taken:
        job_id = new_id()
    return job_id


def start(launcher, store: RayStore, work: Prepared, host: Spare, *, job_id: str, notebook: str, sink,
          hashed: str, skip: int = 0) -> JobRecord:
    """``work`` (the job the kernel's Session prepared on ``launcher``) under ``host``, a
    detached JobHost actor on that cluster; its output shown until the ranks run (``skip``: the
    first output records the cell showed already); its record then.  An interrupt meanwhile
    cancels it.  The job's shared files go as their bytes (the actor may be on another machine)."""
    from taas.host.wire import prepared_bytes

    job = work.job
    record = JobRecord(id=job_id, state=State.WAITING, ranks=job.world.size, where=launcher.address,
                       started=time.time(), notebook=notebook,
                       first_line=client.first_code_line(job.payload.text or job.payload.source),
                       source_hash=client.source_hash(hashed), cwd=job.cwd)
    data = prepared_bytes(work)
    store.put(job_id, keys.SECRET, secrets.token_hex(32).encode())
    store.put(job_id, keys.HOST, host.name.encode())  # the record names its host before it can be listed
    store.create(record)
    try:
        host.handle.start.remote(data, job_id)
    except Exception as exc:  # broad: any Ray error means no host
        store.write(record.replace(state=State.FAILED, ended=time.time(), cause=f"no job host: {exc}"))
        raise LaunchError(f"taas: could not start a job host for job {job_id} on the cluster: {exc}") from None
    follower = client.Follower(store, job_id, sink, skip=skip)
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
