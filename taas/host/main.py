"""``python -m taas.host``: a job host -- wait for a job, then run it to its end, alone.

The host is started by a kernel (:mod:`taas.host.client`) in a session of its own, ahead of
need: it makes its Session warm and waits on its socket for a :class:`~taas.host.api.Take`,
which carries the record's lock (already held for it).  From then on it needs nothing of the
kernel; until then it ends with the kernel (the socket closes).  It runs the job the kernel
prepared as an attached cell's (:class:`~taas.host.api.Prepared`, its shared files handed
over with the Take) with the same supervisor on its own launcher (:func:`run_prepared`),
writing everything it would have shown into the record (:class:`~taas.host.sink.RecordSink`),
then rank 0's results or the failure.  For ``--keep --detach`` that job is the first cell on
kept ranks, which its Session's Keeper then keeps, and the host serves them to the kernel that
adopts them (:class:`~taas.host.kept.KeptHost`).  A Ray cluster's host actor runs its job the
same way (:func:`run_prepared`, taas.host.ray).

SIGTERM (``taas cancel``) is an interrupt: every process stopped, the record ``cancelled``.
SIGKILL leaves the record ``running`` with its lock free: readers mark it ``lost``; the ranks
end with the host, as they end with a killed kernel (the launcher's guard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import pickle
import signal
import socket
import sys
import time

import psutil

from taas.errors import TaasError
from taas.host.api import FAILURE, FDS_AT_ONCE, Failure, Prepared, Running, Take, decode, encode
from taas.host.cells import cause_of, failure_of
from taas.host.kept import KeptHost
from taas.host.sink import RecordSink
from taas.jobs import api as records
from taas.jobs.api import State
from taas.jobs.log import LogWriter
from taas.jobs.store import Store

log = logging.getLogger(__name__)


def _cancel(signum, frame):
    raise KeyboardInterrupt("cancelled")


def main() -> int:
    """Wait (warm) for a job on the socket the kernel gave (``TAAS_HOST_SOCKET``), then run it
    to its end.  The socket closing first means the kernel needs no host after all: exit."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal is no reason to stop
    if os.environ.get("TAAS_HOST_DEBUG"):  # the host's debug trail, into its host.log
        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s.%(msecs)03d %(name)s %(message)s",
                            datefmt="%H:%M:%S")
    channel = socket.socket(fileno=int(os.environ.pop("TAAS_HOST_SOCKET")))
    from taas.session import Session

    session = Session()
    session.warm()  # the start process imports torch while the kernel has no job for us yet
    # What a job's first steps import here (torch, through the GPU count), done ahead too: a
    # warm host adds no import to the job it is given.
    session.launcher.cuda_devices()
    try:
        take, lock, shared = _wait_for_job(channel)
    except (OSError, EOFError):
        take, shared = None, []
    spare_log = os.environ.pop("TAAS_HOST_LOG", None)
    if take is None:
        session.close()
        if spare_log:
            with contextlib.suppress(OSError):
                os.unlink(spare_log)
        return 0
    signal.signal(signal.SIGTERM, _cancel)
    folder = pathlib.Path(take.folder)
    log.debug("took job %s", folder.name)
    os.set_inheritable(lock, False)
    log_fd = os.open(folder / "host.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    if spare_log:
        with contextlib.suppress(OSError):
            os.unlink(spare_log)
    store = Store(folder.parent)
    record = store.read(folder.name)
    me = psutil.Process()
    record = record.replace(host_pid=me.pid, host_started=me.create_time())
    session.job_name = record.id  # the GPU leases name the job as `taas jobs` does
    store.write(record)
    name = records.PREPARED  # the job the kernel prepared (as an attached cell's)
    try:
        work: Prepared = pickle.loads((folder / name).read_bytes())
    except Exception as exc:  # broad: unpickling a job can raise anything; the record must say it
        for fd in shared:
            os.close(fd)
        store.write(record.replace(state=State.FAILED, ended=time.time(),
                                   cause=f"its request could not be read: {exc}"))
        _tell(channel, Running(record.id, ended=True))
        session.close()
        return 1
    os.unlink(folder / name)
    os.chdir(work.job.cwd)
    out = LogWriter(folder)
    sink = RecordSink(folder, out, LogWriter(folder, part=records.METRICS))
    job_id = record.id

    def running() -> None:
        _tell(channel, Running(job_id))

    try:
        work.job.shared_fds = tuple(shared)  # the same files, in the same order, as ours
        record = run_prepared(session.launcher, store, record, work, sink, running, session.keeper)
        if record.state is State.KEPT:  # --keep: the ranks stay, for a notebook to adopt
            kept_record = record
            try:
                kept = KeptHost(session, store, record, sink)
            except OSError as exc:  # no socket: no notebook could adopt them, so they end now
                session.release()
                record = record.replace(state=State.DONE, cause=f"its kept ranks could not be served: {exc}")
            except KeyboardInterrupt:  # cancelled meanwhile
                session.release()
                record = record.replace(state=State.CANCELLED, cause="cancelled")
            else:
                # The record says kept once a cancel is the kept ranks' cancel (serve's handler):
                # one that came between would leave the record saying kept with no host.
                record = kept.serve(ready=lambda: (store.write(kept_record),
                                                   _tell(channel, Running(kept_record.id, ended=True))))
    finally:
        # The job is over: a cancel now must not cut the writing of its end short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sink.close()  # the whole log is on disk before the record says the job ended
        out.close()
    store.write(record.replace(ended=time.time()))
    log.debug("job %s %s", record.id, record.state.value)
    _tell(channel, Running(record.id, ended=True))
    channel.close()
    session.close()  # after the record: a viewer need not wait for the start process to go
    return 0


def _wait_for_job(channel: socket.socket) -> tuple[Take | None, int, list[int]]:
    """The kernel's Take, its record's lock fd and a prepared job's shared fds (they follow
    in messages of their own past :data:`~taas.host.api.FDS_AT_ONCE`)."""
    while True:
        data, fds, _, _ = socket.recv_fds(channel, 65536, FDS_AT_ONCE)
        if not data:
            return None, -1, []  # the kernel closed its end (or died)
        message = decode(data)
        if isinstance(message, Take) and fds:
            shared = fds[1:]
            while len(shared) < message.fds:
                data, more, _, _ = socket.recv_fds(channel, 16, FDS_AT_ONCE)
                if not data:
                    break
                shared += more
            if len(shared) == message.fds:
                return message, fds[0], shared
            fds = [fds[0], *shared]  # fewer than told: not a job we could run as sent
        for fd in fds:
            os.close(fd)


def _tell(channel: socket.socket, message: Running) -> None:
    """Tell the kernel that started us, if it still listens (it may be gone: that is the point)."""
    try:
        channel.send(encode(message), socket.MSG_DONTWAIT)
    except OSError:
        pass


def run_prepared(launcher, store, record, prepared: Prepared, sink: RecordSink, running, keeper=None):
    """A job the kernel prepared (:class:`Prepared`: made as an attached cell's is), to its end
    on ``launcher`` with the supervisor an attached job has; its final record (``running()``:
    once the ranks run).  Its shared fds are closed however it ends.  ``--keep`` (``keeper``:
    the host Session's): the first cell on kept ranks, which ``keeper`` keeps afterwards (the
    record then reads KEPT, its cell's outcome in the folder)."""
    import linecache

    from taas import cellrun
    from taas.host.cells import returned
    from taas.job import results
    from taas.job.api import JobStats
    from taas.job.metrics import HISTORY
    from taas.job.results import CellResult
    from taas.session import WARN, write_note
    from taas.supervisor.cell import KeptCell
    from taas.supervisor.supervisor import Supervisor

    job = prepared.job
    for stream, text in prepared.shown:  # the record starts with what the detaching cell showed
        sink.write(stream, text)
    linecache.cache.update(prepared.sources)  # the cells' lines, quoted by tracebacks and stacks
    stats = JobStats(job.job_id, job.world.size, job.world.device, job.world.backend)
    on_state = _on_running(store, record, running, lambda: stats)
    plot, on_metrics = cellrun.live_plot(job, sink)
    HISTORY.observers.append(sink.metrics)
    hooks = dict(name_for=prepared.labels.get, on_state=on_state, on_metrics=on_metrics)
    keep = prepared.keep is not None and keeper is not None
    supervisor = (KeptCell(launcher, job, sink, kept=None, limit=prepared.keep, **hooks) if keep
                  else Supervisor(launcher, job, sink, **hooks))

    def after(state: State) -> State:  # the kept ranks stay (after a failed cell too): KEPT
        if not keep:
            return state
        keeper.after_cell(supervisor.kept, {})
        return State.KEPT if supervisor.kept is not None and state is not State.CANCELLED else state

    try:
        outcome = supervisor.run()
        cellrun.succeeded(job, outcome, job.data, stats, sink)
        back = (results.load(results.decode(outcome.result), None)
                if job.policy.results and outcome.result is not None else CellResult())
        store.put(record.id, records.RESULTS, pickle.dumps(returned(back, sink)))
        return _now(store, record).replace(state=after(State.DONE), has_results=True, keep=keep)
    except KeyboardInterrupt:
        write_note(sink, f"taas: job {record.id} cancelled: every process stopped", WARN)
        after(State.CANCELLED)
        return _now(store, record).replace(state=State.CANCELLED, cause="cancelled")
    except BaseException as exc:  # the record must say why, whatever it was
        _failed(store, record, failure_of(exc))
        return _now(store, record).replace(state=after(State.FAILED), cause=cause_of(exc), keep=keep)
    finally:
        HISTORY.observers.remove(sink.metrics)
        plot.close()
        for fd in job.shared_fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def replan(job, launcher) -> None:
    """A job prepared elsewhere (by a kernel on another machine of the cluster) run on
    ``launcher``: its data plane's transport where this launcher places the ranks (the TCP
    hub on this host's address, a relay per GPU node), not where the kernel would have."""
    if job.data is not None:
        from taas.wiring import transport_for

        job.transport = transport_for(launcher.topology(job.world.size))


def _on_running(store, record, running, stats):
    """The supervisor's ``on_state``: the record says running (with the job's size, ``stats()``)
    and the kernel is told, once, when the ranks run."""
    started = {"done": False}

    def on_state(state) -> None:
        if not started["done"] and state.value in ("prefetching", "running"):
            started["done"] = True
            now = stats()
            store.write(record.replace(state=State.RUNNING, ranks=now.world_size if now else record.ranks,
                                       device=now.device if now else ""))
            log.debug("ranks running")
            running()

    return on_state


def _now(store, record):
    """The record as the host last wrote it (its state changed since ``record`` was read)."""
    try:
        return store.read(record.id)
    except TaasError:
        return record


def _failed(store, record, failure: Failure) -> None:
    import json

    store.put(record.id, FAILURE, json.dumps(dataclasses.asdict(failure)).encode())


if __name__ == "__main__":
    sys.exit(main())
