"""``python -m taas.host FOLDER``: run the job whose request is in FOLDER, to its end, alone.

The host is started by a kernel (:mod:`taas.host.client`) in a session of its own, with the
record's lock already held for it (fd ``TAAS_HOST_LOCK_FD``); from then on it needs nothing of
the kernel.  It runs the cell with a :class:`~taas.session.Session` of its own -- the same
supervisor, launcher and ranks as an attached cell -- and writes everything it would have shown
into the record (:class:`~taas.host.sink.RecordSink`), then rank 0's results or the failure.

SIGTERM (``taas cancel``) is an interrupt: every process stopped, the record ``cancelled``.
SIGKILL leaves the record ``running`` with its lock free: readers mark it ``lost``; the ranks
end with the host, as they end with a killed kernel (the launcher's guard).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import pickle
import signal
import sys
import time
import traceback

import cloudpickle
import psutil

from taas import directive
from taas.errors import JobFailed, RenderedError, TaasError
from taas.host.api import FAILURE, Failure, Request, Returned
from taas.host.sink import RecordSink
from taas.jobs import api as records
from taas.jobs.api import State
from taas.jobs.log import LogWriter
from taas.jobs.store import Store, hold_lock, write_file

log = logging.getLogger(__name__)


def _cancel(signum, frame):
    raise KeyboardInterrupt("cancelled")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv if argv is None else argv
    folder = pathlib.Path(argv[1])
    inherited = os.environ.pop("TAAS_HOST_LOCK_FD", None)
    lock = int(inherited) if inherited else hold_lock(folder)
    os.set_inheritable(lock, False)
    signal.signal(signal.SIGTERM, _cancel)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal is no reason to stop
    store = Store(folder.parent)
    record = store.read(folder.name)
    me = psutil.Process()
    record = record.replace(host_pid=me.pid, host_started=me.create_time())
    store.write(record)
    try:
        request: Request = pickle.loads((folder / records.REQUEST).read_bytes())
    except (OSError, pickle.PickleError, EOFError) as exc:
        store.write(record.replace(state=State.FAILED, ended=time.time(),
                                   cause=f"its request could not be read: {exc}"))
        return 1
    os.unlink(folder / records.REQUEST)
    os.chdir(request.cwd)
    out = LogWriter(folder)
    sink = RecordSink(folder, out, LogWriter(folder, part=records.METRICS))
    try:
        record = _run(store, record, request, sink)
    finally:
        sink.close()  # the whole log is on disk before the record says the job ended
        out.close()
    store.write(record.replace(ended=time.time()))
    return 0


def _run(store: Store, record, request: Request, sink: RecordSink):
    from taas.data import registry
    from taas.job import package
    from taas.job.metrics import HISTORY
    from taas.session import WARN, Session, write_note

    namespace: dict = {}
    registry.set_namespace_source(lambda: namespace)
    session = Session()
    started = {"done": False}

    def on_state(state) -> None:
        if not started["done"] and state.value in ("prefetching", "running"):
            started["done"] = True
            stats = session.last
            store.write(record.replace(state=State.RUNNING, ranks=stats.world_size if stats else record.ranks,
                                       device=stats.device if stats else ""))

    session.on_state = on_state
    HISTORY.observers.append(sink.metrics)
    try:
        # One namespace shared with the shipped functions, as in a rank (package.unship).
        namespace.update(package.unship(request.names))
        for name, (prefetch, buffer_mb) in request.loaders.items():
            registry.register(namespace[name], prefetch=prefetch, buffer_mb=buffer_mb)
        options = dataclasses.replace(directive.parse_options(request.options), detach=False)
        result = session.run_cell(
            request.source, namespace, options, filename=request.filename, first_line=request.first_line,
            sink=sink, name_for=lambda name: request.label if name == request.filename else None)
        values, notes = {}, list(result.notes)
        for name, value in result.values.items():
            try:
                values[name] = cloudpickle.dumps(value)
            except Exception as exc:  # one value that cannot be kept costs itself, not the others
                notes.append(f"taas: `{name}` ({type(value).__name__}) could not be kept for the "
                             f"notebook: {exc}")
        out = None
        if result.has_out:
            try:
                out = cloudpickle.dumps(result.out)
            except Exception as exc:  # the same for Out[]
                notes.append(f"taas: Out[] ({type(result.out).__name__}) could not be kept: {exc}")
        for line in notes:
            write_note(sink, line, WARN)
        write_file(store.folder(record.id) / records.RESULTS, pickle.dumps(
            Returned(values, out, result.has_out and out is not None, tuple(notes))))
        return _now(store, record).replace(state=State.DONE, has_results=True)
    except KeyboardInterrupt:
        write_note(sink, f"taas: job {record.id} cancelled: every process stopped", WARN)
        return _now(store, record).replace(state=State.CANCELLED, cause="cancelled")
    except RenderedError as exc:
        _failed(store, record, Failure(exc.summary, tuple(exc.rendered), type(exc).__name__))
        return _now(store, record).replace(state=State.FAILED, cause=_cause(exc))
    except TaasError as exc:
        _failed(store, record, Failure(str(exc), (), type(exc).__name__))
        return _now(store, record).replace(state=State.FAILED, cause=str(exc))
    except BaseException as exc:  # the record must say why, whatever it was
        lines = traceback.format_exception(exc)
        _failed(store, record, Failure(f"{type(exc).__name__}: {exc}", tuple(lines), type(exc).__name__))
        return _now(store, record).replace(state=State.FAILED, cause=f"{type(exc).__name__}: {exc}")
    finally:
        HISTORY.observers.remove(sink.metrics)
        session.close()


def _now(store: Store, record):
    """The record as the host last wrote it (its state changed since ``record`` was read)."""
    try:
        return store.read(record.id)
    except TaasError:
        return record


def _cause(exc: RenderedError) -> str:
    if isinstance(exc, JobFailed):
        return exc.summary
    return exc.summary.splitlines()[0] if exc.summary else type(exc).__name__


def _failed(store: Store, record, failure: Failure) -> None:
    import json

    write_file(store.folder(record.id) / FAILURE, json.dumps(dataclasses.asdict(failure)).encode())


if __name__ == "__main__":
    sys.exit(main())
