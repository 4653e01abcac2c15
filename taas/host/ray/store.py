"""A Ray cluster's job records: this user's records in the cluster's key-value store.

:class:`RayStore` offers the calls of this machine's :class:`~taas.jobs.store.Store` (read,
write, put, get, resolve, ids, listing, remove) plus the output's readers, so the viewers of
taas.host (``Follower``, ``follow``, ``raise_failure``, ``listing.render``) work on it as they
are.  Its KV is any object with ``get``, ``put``, ``delete``, ``keys(prefix)`` (:class:`RayKV`:
``ray.experimental.internal_kv`` in taas's namespace; tests give a dict).

The output log is bounded as on disk (taas.jobs.log's rule, the same ``TAAS_LOG_CAP``): its
records go in chunks (one KV value each, at most :data:`CHUNK` bytes, written every
:data:`FLUSH_EVERY` s); the chunks of the first half of the cap stay, later ones are kept up to
another half, the oldest removed first; a gap in the records' numbers is read as one
``dropped`` record (LogReader's rule).
"""

from __future__ import annotations

import json
import re
import threading
import time

from taas.host.ray import keys
from taas.jobs import api
from taas.jobs.api import JobRecord, Listed, State
from taas.jobs.log import LogReader
from taas.jobs.store import JobError, resolve_id

CHUNK = 256 << 10
FLUSH_EVERY = 0.2


class RayKV:
    """``ray.experimental.internal_kv`` in taas's namespace (the process is connected to Ray)."""

    def __init__(self):
        from ray.experimental import internal_kv

        self._kv = internal_kv

    def get(self, name: str) -> bytes | None:
        return self._kv._internal_kv_get(name, namespace=keys.NAMESPACE)

    def put(self, name: str, value: bytes) -> None:
        self._kv._internal_kv_put(name, value, overwrite=True, namespace=keys.NAMESPACE)

    def delete(self, name: str, by_prefix: bool = False) -> int:
        return int(self._kv._internal_kv_del(name, del_by_prefix=by_prefix, namespace=keys.NAMESPACE) or 0)

    def keys(self, prefix: str) -> list[str]:
        return [k.decode() for k in self._kv._internal_kv_list(prefix, namespace=keys.NAMESPACE)]


class RayStore:
    """This user's job records on a Ray cluster.  ``alive(job_id)``: whether the job's host
    actor lives (True, False, or None: cannot tell); a record still saying waiting or running
    whose host is gone reads LOST."""

    def __init__(self, kv, where: str = "the cluster", owner: str | None = None, alive=None):
        self.kv = kv
        self.where = where
        self.owner = owner or keys.owner()
        self.alive = alive or (lambda job_id: None)

    def _key(self, job_id: str, part: str) -> str:
        return keys.key(self.owner, job_id, part)

    # -- one record ----------------------------------------------------------------------
    def create(self, record: JobRecord) -> None:
        self.write(record)

    def write(self, record: JobRecord) -> None:
        self.kv.put(self._key(record.id, keys.RECORD), json.dumps(record.to_json()).encode())

    def put(self, job_id: str, name: str, data: bytes) -> None:
        self.kv.put(self._key(job_id, name), data)

    def get(self, job_id: str, name: str) -> bytes | None:
        return self.kv.get(self._key(job_id, name))

    def read(self, job_id: str) -> JobRecord:
        if not re.fullmatch(r"[0-9a-f]{6,32}", job_id):
            raise JobError(f"taas: no job {job_id!r} on {self.where}; `%taas jobs` lists yours")
        data = self.get(job_id, keys.RECORD)
        if data is None:
            raise JobError(f"taas: no job {job_id!r} on {self.where}; `%taas jobs` lists yours")
        try:
            record = JobRecord.from_json(json.loads(data))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise JobError(f"taas: job {job_id}'s record is damaged ({type(exc).__name__}: {exc}); "
                           f"`%taas forget {job_id}` removes it") from None
        taken = self.get(job_id, api.TAKEN)
        if taken is not None:
            try:
                record = record.replace(taken=float(taken))
            except ValueError:
                record = record.replace(taken=0.0)
        return self._lost_if_orphaned(record)

    def _lost_if_orphaned(self, record: JobRecord) -> JobRecord:
        if record.state.final or self.alive(record.id) is not False:
            return record
        fresh = self.get(record.id, keys.RECORD)  # the host may have ended well meanwhile
        try:
            record = JobRecord.from_json(json.loads(fresh)) if fresh else record
        except (ValueError, TypeError, KeyError, AttributeError):
            pass
        if record.state.final:
            return record
        lost = record.replace(state=State.LOST, ended=time.time(), cause=(
            f"its job host (Ray actor {keys.actor_name(self.owner, record.id)}, pid {record.host_pid}) "
            "ended without a word: killed, or its node was lost; its ranks ended with it"))
        self.write(lost)
        return lost

    # -- all of this user's records ------------------------------------------------------
    def _parts(self) -> dict[str, dict[str, int]]:
        """job id -> {part: size}, for every key of this user's."""
        out: dict[str, dict[str, int]] = {}
        for name in self.kv.keys(keys.prefix(self.owner)):
            found = keys.split(self.owner, name)
            if found is not None:
                job_id, part = found
                sized = keys.chunk_of(part.split("/", 1)[0], part)
                out.setdefault(job_id, {})[part] = sized[1] if sized else -1
        return out

    def ids(self) -> list[str]:
        return sorted(job for job, parts in self._parts().items() if keys.RECORD in parts)

    def resolve(self, prefix: str) -> str:
        return resolve_id(prefix, self.ids(), where=f"on {self.where}", lister="`%taas jobs`")

    def listing(self, prune: bool = True) -> list[Listed]:
        """Every record, newest first, each with the bytes it holds in the KV; finished ones
        older than the age limit are removed first."""
        out, limit = [], api.max_age()
        for job_id, parts in sorted(self._parts().items()):
            if keys.RECORD not in parts:
                continue
            size = 0
            for part, known in parts.items():
                size += known if known >= 0 else len(self.get(job_id, part) or b"")
            try:
                record = self.read(job_id)
            except JobError as exc:
                out.append(Listed(JobRecord(job_id, State.LOST, 0, "", 0.0), size=size, problem=str(exc)))
                continue
            if prune and record.state.final and record.ended and time.time() - record.ended > limit:
                self.kv.delete(keys.key(self.owner, job_id, ""), by_prefix=True)
                continue
            out.append(Listed(record, size=size))
        out.sort(key=lambda item: item.record.started, reverse=True)
        return out

    def remove(self, job_id: str) -> None:
        try:
            record: JobRecord | None = self.read(job_id)
        except JobError:
            if keys.RECORD not in self._parts().get(job_id, {}):
                raise
            record = None  # a damaged record: forgetting it is how it goes
        if record is not None and not record.state.final:
            raise JobError(f"taas: job {job_id} is {record.state.value}; `%taas cancel {job_id}` "
                           "first, then forget it")
        self.kv.delete(keys.key(self.owner, job_id, ""), by_prefix=True)

    # -- the output ------------------------------------------------------------------------
    def log_writer(self, job_id: str, part: str = api.OUT, cap: int | None = None) -> KVLogWriter:
        return KVLogWriter(self.kv, self._key(job_id, part), part, cap)

    def log_reader(self, job_id: str, part: str = api.OUT) -> KVLogReader:
        return KVLogReader(self.kv, self._key(job_id, part), part)

    def save_view(self, job_id: str, view: dict) -> None:
        self.put(job_id, keys.VIEW, json.dumps(view, separators=(",", ":")).encode())

    def read_view(self, job_id: str) -> dict:
        try:
            return json.loads(self.get(job_id, keys.VIEW) or b"{}")
        except ValueError:
            return {}

    def delete(self, job_id: str, part: str) -> None:
        self.kv.delete(self._key(job_id, part))

    def claim(self, job_id: str, part: str) -> bytes | None:
        """One part, once: whoever deletes its key first has it (None: claimed already)."""
        data = self.get(job_id, part)
        if data is None or self.kv.delete(self._key(job_id, part)) == 0:
            return None
        return data

    def claim_results(self, job_id: str) -> bytes | None:
        """The results, once (None: taken already); the record says when they were taken."""
        data = self.claim(job_id, api.RESULTS)
        if data is not None:
            self.put(job_id, api.TAKEN, repr(time.time()).encode())
        return data


class KVLogWriter:
    """LogWriter's calls (append, count, close) over KV chunks under ``base`` (thread-safe)."""

    def __init__(self, kv, base: str, part: str, cap: int | None = None, flush_every: float = FLUSH_EVERY):
        self.kv, self.base, self.part = kv, base, part
        self.cap = cap if cap is not None else api.log_cap()
        self._lock = threading.Lock()
        self._index = 0
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._seq = 0
        self._head = 0  # bytes in the head chunks (kept for good)
        self._tail: list[tuple[str, int]] = []  # (key, bytes) of the later chunks, oldest first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flusher, args=(flush_every,), name="taas-kv-log",
                                        daemon=True)
        self._thread.start()

    def append(self, record: dict) -> None:
        with self._lock:
            self._buffer.append(json.dumps(dict(record, i=self._index), separators=(",", ":")).encode() + b"\n")
            self._buffered += len(self._buffer[-1])
            self._index += 1
            if self._buffered >= min(CHUNK, max(1, self.cap // 8)):
                self._flush()

    @property
    def count(self) -> int:
        return self._index

    def _flusher(self, every: float) -> None:
        while not self._stop.wait(every):
            with self._lock:
                self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        data = b"".join(self._buffer)
        self._buffer, self._buffered = [], 0
        name = f"{self.base.rsplit('/', 1)[0]}/{keys.chunk(self.part, self._seq, len(data))}"
        self._seq += 1
        self.kv.put(name, data)
        if self._head + len(data) <= self.cap // 2 and not self._tail:
            self._head += len(data)
            return
        self._tail.append((name, len(data)))
        while sum(size for _, size in self._tail) > self.cap // 2 and len(self._tail) > 1:
            old, _ = self._tail.pop(0)
            self.kv.delete(old)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            self._flush()


class KVLogReader(LogReader):
    """LogReader's calls (read, start_at_latest_bytes) over a KVLogWriter's chunks."""

    def __init__(self, kv, base: str, part: str):
        super().__init__(base, part)
        self.kv, self.part = kv, part
        self._parent = base.rsplit("/", 1)[0] + "/"
        self._at = 0  # the next chunk's seq to read

    def _chunks(self) -> list[tuple[int, int, str]]:
        out = []
        for name in self.kv.keys(self._parent + self.part + "/"):
            found = keys.chunk_of(self.part, name[len(self._parent):])
            if found is not None:
                out.append((found[0], found[1], name))
        return sorted(out)

    def start_at_latest_bytes(self, nbytes: int) -> bool:
        chunks = self._chunks()
        need = nbytes
        for seq, size, name in reversed(chunks):
            need -= size
            if need <= 0 or seq == chunks[0][0]:
                data = self.kv.get(name)
                first = self._first_index(data) if data else None
                self._at = seq
                if first is not None:
                    self._next = first
                return first is not None and first > 0
        return False

    def read(self, with_index: bool = False) -> list[dict]:
        self._with_index = with_index
        out: list[dict] = []
        for seq, _, name in self._chunks():
            if seq < self._at:
                continue
            data = self.kv.get(name)
            if data is not None:  # None: removed meanwhile (the cap): the gap says so
                for line in data.splitlines():
                    self._take(line, out)
            self._at = seq + 1
        return out
