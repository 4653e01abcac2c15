"""The job host on a Ray cluster: a detached, named actor that runs one detached cell to its end.

It is what ``python -m taas.host`` is on one machine (taas.host.main), with the cluster in the
kernel's place: it runs the job the kernel's Session prepared on its cluster launcher
(:func:`taas.host.main.run_prepared`, its shared files sent as their bytes) on a Ray launcher of
its own Session's, so the node agents -- and through them the ranks and loader workers -- are
actors and processes this actor created and owns.  Its output, view, metrics,
results and record go to the cluster's KV (:class:`~taas.host.ray.store.RayStore`).

A host may be made ahead of need, as a kernel's warm spare (taas.host.ray.spares): made with
no job id, it imports what a job imports and starts the agents of the cluster's GPU nodes; until
``start`` gives it a job it watches the kernel that made it (that kernel's Ray job), and ends
itself, agents and all, when that kernel is gone.  Both begin with its creation, which the
cluster carries out even if the kernel dies first (a method call would die with the kernel).

Ray ends what an actor owns when the actor dies, so the agents are told their owner is this
actor, not the kernel's Ray job (which ends with the kernel: ``owned_by_host``).  ``cancel``
proves the job's secret, then interrupts the cell as a kernel's interrupt would (at the
supervisor's next checkpoint: :func:`taas.shield.interrupt_thread`); past
:data:`CANCEL_GRACE` the actor ends itself, and its agents with it.

A ``--keep`` job's ranks stay after its cell: the actor serves them as a host on one machine
does (:class:`taas.host.kept.KeptHost`), at a TCP door of its node (taas.host.ray.door), until
they are released, pass their idle limit or are cancelled.
"""

from __future__ import annotations

import hmac
import logging
import os
import pickle
import threading
import time

from taas.host.ray import keys
from taas.shield import interrupt_thread

log = logging.getLogger(__name__)

CANCEL_GRACE = 3.0  # the cell's interrupt path stops every process within this, or the actor ends
WATCH_EVERY = 1.0  # seconds between a spare's looks at whether the kernel that made it is there


class JobHost:
    def __init__(self, owner: str, job_id: str, address: str, workdir: str = "auto",
                 workdir_limit: int | None = None):
        """``job_id`` "": a spare, given its job by :meth:`start`."""
        from taas.host.ray.store import RayKV, RayStore

        self.owner, self.job_id, self.address = owner, job_id, address
        self.workdir, self.workdir_limit = workdir, workdir_limit
        self.store = RayStore(RayKV(), where=address, owner=owner)
        self._thread: threading.Thread | None = None
        self._ended = threading.Event()
        self._taken = threading.Event()  # a job was given: no longer a spare
        self._lock = threading.Lock()
        self._warming = threading.Lock()  # held while the Session is made and warmed
        self._session = None
        self._cancelled = False
        self._kept = None  # a --keep job's KeptHost, once its first cell ended
        if not job_id:  # a spare: from its creation on, not from a call its kernel may never make
            threading.Thread(target=self._warm, name="taas-spare-warm", daemon=True).start()
            threading.Thread(target=self._watch_kernel, name="taas-spare-watch", daemon=True).start()

    def _warm(self) -> None:
        """A spare's: what a job needs made ready (the Session, its imports, the GPU nodes'
        agents), unless a job came first (it makes what it needs itself)."""
        with self._warming:
            if self._taken.is_set():
                return
            session = self._made()
            try:
                session.launcher_for(self.address).cuda_devices()  # the GPU nodes' agents, started
                import taas.host.main  # noqa: F401  (run_prepared and what it imports)
            except Exception as exc:  # broad: the job, if one comes, meets it and says it
                log.debug("warming: %r", exc)

    def _made(self):
        """The Session the job runs on (made once)."""
        if self._session is None:
            from taas.launch.ray.cluster import owned_by_host
            from taas.session import Session

            session = Session()
            session.cluster, session.workdir, session.workdir_limit = self.address, self.workdir, self.workdir_limit
            session.launcher_for(self.address).cluster.owner_gone = owned_by_host
            self._session = session
        return self._session

    def _watch_kernel(self) -> None:
        """A spare ends itself (and the agents it started) once the kernel that made it is gone."""
        from taas.launch.ray.cluster import kernel_gone

        while not self._taken.wait(WATCH_EVERY):
            if kernel_gone():
                with self._lock:  # a job given meanwhile is run; none is taken from now on
                    if self._taken.is_set():
                        return
                    self._cancelled = True
                log.debug("spare: the kernel that made it is gone")
                _end_self()

    def cuda_devices(self) -> int:
        """The CUDA devices a job's ranks see on this cluster (the GPU nodes' agents, started)."""
        with self._warming:  # a spare still warming: that is what it warms
            session = self._made()
        return session.launcher_for(self.address).cuda_devices()

    def start(self, prepared: bytes, job_id: str | None = None) -> int:
        """Run the job (``prepared``: a pickled (taas.host.api.Prepared, its shared files' bytes);
        ``job_id``: a spare's job) in a thread; this actor's pid."""
        with self._lock:
            if self._thread is None and not self._cancelled:
                if job_id:
                    self.job_id = job_id
                self._taken.set()
                self._thread = threading.Thread(target=self._job, args=(prepared,), name="taas-job",
                                                daemon=True)
                self._thread.start()
        return os.getpid()

    def _job(self, data: bytes) -> None:
        import psutil

        from taas.host.main import replan, run_prepared
        from taas.host.sink import RecordSink
        from taas.host.wire import memory_files
        from taas.jobs import api as records
        from taas.jobs.api import State

        store, job_id = self.store, self.job_id
        record = store.read(job_id)
        me = psutil.Process()
        record = record.replace(host_pid=me.pid, host_started=me.create_time())
        store.write(record)
        with self._warming:  # a spare still warming: the job waits for what it warms
            session = self._made()
        session.job_name = job_id
        out = store.log_writer(job_id, records.OUT)
        sink = RecordSink(None, out, store.log_writer(job_id, records.METRICS),
                          save_view=lambda view: store.save_view(job_id, view))
        try:
            try:
                prepared, contents = pickle.loads(data)
                if os.path.isdir(prepared.job.cwd):
                    os.chdir(prepared.job.cwd)
            except Exception as exc:  # broad: whatever it is, the record must say it
                record = record.replace(state=State.FAILED, cause=f"its job could not be read: {exc}")
            else:
                job = prepared.job
                job.shared_fds = tuple(memory_files(contents))  # run_prepared closes them
                launcher = session.launcher_for(self.address)
                replan(job, launcher)  # the data plane's hub and relays where this launcher puts them
                record = run_prepared(launcher, store, record, prepared, sink, lambda: None, session.keeper)
                if record.state is State.KEPT:  # --keep: the ranks stay, for a notebook to adopt
                    record = self._serve_kept(session, record, sink)
        except KeyboardInterrupt:  # the cancel landed outside the cell's own interrupt path
            record = store.read(job_id).replace(state=State.CANCELLED, cause="cancelled")
        except BaseException as exc:  # the record must say why, whatever it was
            record = store.read(job_id).replace(state=State.FAILED, cause=f"{type(exc).__name__}: {exc}")
        finally:
            sink.close()
            out.close()
            store.write(record.replace(ended=time.time()))
            self._ended.set()
            session.close()
        log.debug("job %s %s", job_id, record.state.value)
        _end_self()

    def _serve_kept(self, session, record, sink):
        """A --keep job's ranks, served at this node's door until they end; the final record."""
        from taas.host.kept import KeptHost
        from taas.host.ray.door import TcpDoor
        from taas.jobs.api import State

        try:
            kept = KeptHost(session, self.store, record, sink, door=TcpDoor(self.store, record.id))
        except OSError as exc:  # no door: no notebook could adopt them, so they end now
            session.release()
            return record.replace(state=State.DONE, cause=f"its kept ranks could not be served: {exc}")
        with self._lock:
            cancelled, self._kept = self._cancelled, kept
        if cancelled:  # a cancel came before the door opened
            kept.cancel()
        return kept.serve(ready=lambda: self.store.write(record))

    def cancel(self, token: str) -> str:
        """Stop the job (``token``: its secret): the cell interrupted; what the record says then."""
        if not self.job_id:  # a spare given no job yet: no secret to prove
            return "refused: no job here"
        secret = (self.store.get(self.job_id, keys.SECRET) or b"").decode()
        if not secret or not hmac.compare_digest(secret, token):
            return "refused: wrong secret"
        from taas.jobs.api import State

        with self._lock:
            thread, self._cancelled, kept = self._thread, True, self._kept
        if kept is not None:  # kept ranks: their host ends them (a running cell interrupted)
            kept.cancel()
            if not self._ended.wait(CANCEL_GRACE):
                threading.Thread(target=_end_self, daemon=True).start()
            return "cancelled"
        if thread is None:  # the job never began: nothing runs
            record = self.store.read(self.job_id)
            self.store.write(record.replace(state=State.CANCELLED, ended=time.time(), cause="cancelled"))
            threading.Thread(target=_end_self, daemon=True).start()
            return "cancelled"
        if thread.ident is not None and not self._ended.is_set():
            # At the supervisor's next checkpoint, between polls (taas.shield): never in the
            # middle of a step, as an exception raised into the thread at any bytecode could be.
            # A thread blocked elsewhere (a launch waiting on the cluster) meets the grace below.
            interrupt_thread(thread.ident)
            if not self._ended.wait(CANCEL_GRACE):
                record = self.store.read(self.job_id)
                self.store.write(record.replace(state=State.CANCELLED, ended=time.time(),
                                                cause="cancelled: its host ended it, and its agents"))
                threading.Thread(target=_end_self, daemon=True).start()
        return "cancelled"

    def pid(self) -> int:
        return os.getpid()


def _end_self() -> None:
    """End this actor (its agents, ranks and loader workers end with it: Ray's ownership)."""
    time.sleep(0.1)  # the method that asked has answered
    os._exit(0)
