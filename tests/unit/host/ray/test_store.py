"""taas.host.ray's pure parts over a dict for the cluster's KV: the keys per user, records
written and read back, a running record whose host actor is gone read as lost, the listing,
the bounded chunked log read by the host's own Follower, results taken once, forget."""

from __future__ import annotations

import pickle
import time

import pytest

from taas.host import client
from taas.host.api import Returned
from taas.host.ray import keys
from taas.host.ray.client import take
from taas.host.ray.store import KVLogWriter, RayStore
from taas.host.sink import RecordSink
from taas.jobs import api, listing
from taas.jobs.api import JobRecord, State
from taas.jobs.store import JobError
from tests.support.kv import DictKV
from tests.support.sinks import Recorder

ME, OTHER = "ann.1000", "bob.1001"


def record(job_id="a1b2c3", state=State.RUNNING, **kw):
    return JobRecord(id=job_id, state=state, ranks=4, where="127.0.0.1:6379", started=kw.pop("started", 100.0),
                     notebook="nb.ipynb", first_line="train()", **kw)


@pytest.mark.parametrize("who, job_id, part, expected", [
    (ME, "a1b2c3", "record", "jobs/ann.1000/a1b2c3/record"),
    (ME, "a1b2c3", "out/0000000003-120", "jobs/ann.1000/a1b2c3/out/0000000003-120"),
])
def test_keys_name_the_user_the_job_and_the_part(who, job_id, part, expected):
    assert keys.key(who, job_id, part) == expected
    assert keys.split(who, expected) == (job_id, part)
    assert keys.split(OTHER, expected) is None  # another user's prefix never matches


@pytest.mark.parametrize("who, job_id", [("ann/..", "a1b2c3"), (ME, "../x"), (ME, "A1B2C3"), ("", "a1b2c3")])
def test_a_key_refuses_names_that_would_leave_their_prefix(who, job_id):
    with pytest.raises(ValueError):
        keys.key(who, job_id, "record")


def test_chunk_names_carry_order_and_size():
    assert keys.chunk_of("out", keys.chunk("out", 12, 345)) == (12, 345)
    assert keys.chunk_of("out", "metrics/0000000001-5") is None
    assert keys.actor_name(ME, "a1b2c3") == "taas-job-ann.1000-a1b2c3"


def test_records_are_per_user_and_listed_newest_first():
    kv = DictKV()
    mine, theirs = RayStore(kv, owner=ME), RayStore(kv, owner=OTHER)
    now = time.time()
    mine.write(record("a1b2c3", started=now - 20))
    mine.write(record("d4e5f6", started=now - 10, state=State.DONE, ended=now - 5))
    mine.write(record("0f0f0f", started=1.0, state=State.DONE, ended=2.0))  # past the age limit
    theirs.write(record("0a0b0c"))
    assert [item.record.id for item in mine.listing()] == ["d4e5f6", "a1b2c3"]
    assert "0f0f0f" not in mine.ids()  # removed by the listing
    assert [item.record.id for item in theirs.listing()] == ["0a0b0c"]
    with pytest.raises(JobError, match="no job '0a0b0c'"):
        mine.read("0a0b0c")  # another user's id is not found under mine
    assert mine.resolve("d4") == "d4e5f6"
    text = listing.render(mine.listing(), now=now)
    assert "d4e5f6" in text and "127.0.0.1:6379" in text and "train()" in text


def test_a_running_record_whose_host_actor_is_gone_reads_lost_with_why():
    kv = DictKV()
    alive = {"a1b2c3": True}
    store = RayStore(kv, owner=ME, alive=lambda job_id: alive.get(job_id))
    store.write(record("a1b2c3", host_pid=42))
    assert store.read("a1b2c3").state is State.RUNNING
    alive["a1b2c3"] = None  # the GCS cannot tell: not believed lost
    assert store.read("a1b2c3").state is State.RUNNING
    alive["a1b2c3"] = False
    lost = store.read("a1b2c3")
    assert lost.state is State.LOST and "taas-job-ann.1000-a1b2c3" in lost.cause and "pid 42" in lost.cause
    assert RayStore(kv, owner=ME).read("a1b2c3").state is State.LOST  # written so


def test_a_damaged_record_is_one_line_and_forget_removes_only_that_job():
    kv = DictKV()
    store = RayStore(kv, owner=ME)
    store.write(record("d4e5f6", state=State.DONE))
    kv.put(keys.key(ME, "a1b2c3", "record"), b"{half")
    with pytest.raises(JobError, match="damaged"):
        store.read("a1b2c3")
    assert [i.problem != "" for i in store.listing()].count(True) == 1
    store.remove("a1b2c3")
    assert store.ids() == ["d4e5f6"]
    store.write(record("a1b2c3"))
    with pytest.raises(JobError, match="cancel a1b2c3"):
        store.remove("a1b2c3")  # a running job's record stays


def test_the_chunked_log_replays_through_the_hosts_follower():
    kv = DictKV()
    store = RayStore(kv, owner=ME)
    store.write(record())
    out = store.log_writer("a1b2c3", api.OUT)
    sink = RecordSink(None, out, store.log_writer("a1b2c3", api.METRICS),
                      save_view=lambda view: store.save_view("a1b2c3", view))
    sink.write("stdout", "[rank0] step 1\n")
    sink.progress("rank0", "stderr", "50%", False)
    sink.close()
    out.close()
    assert store.read_view("a1b2c3")["progress"] == {}  # closed: nothing open in place
    seen = Recorder()
    client.Follower(store, "a1b2c3", seen).finish()
    assert seen.text() == "[rank0] step 1\n"


def test_the_log_is_bounded_keeps_head_and_latest_and_says_what_was_dropped():
    kv = DictKV()
    store = RayStore(kv, owner=ME)
    writer = KVLogWriter(kv, keys.key(ME, "a1b2c3", api.OUT), api.OUT, cap=8192, flush_every=3600)
    for n in range(2000):
        writer.append({"op": "w", "s": "stdout", "x": f"line {n}\n"})
    writer.close()
    stored = sum(len(v) for k, v in kv.data.items() if "/out/" in k)
    assert stored <= 8192 + 1024  # the cap, give or take the chunk being written
    seen = Recorder()
    client.Follower(store, "a1b2c3", seen).finish()
    text = seen.text()
    assert text.startswith("line 0\n") and text.endswith("line 1999\n")
    assert any("output records dropped" in t for s, t in seen.out if s == "stderr")
    latest = Recorder()  # an attach: the latest bytes only, and a line saying so
    client.Follower(store, "a1b2c3", latest, latest=200).finish()
    assert "earlier output not shown" in latest.text() and latest.text().endswith("line 1999\n")
    assert "line 0\n" not in latest.text()


def test_results_are_taken_once():
    kv = DictKV()
    store = RayStore(kv, owner=ME)
    done = record(state=State.DONE, has_results=True)
    store.write(done)
    store.put(done.id, api.RESULTS, pickle.dumps(Returned({"x": pickle.dumps(41)})))
    assert pickle.loads(take(store, done).values["x"]) == 41
    again = store.read(done.id)
    assert again.taken is not None and again.taken <= time.time()
    with pytest.raises(JobError, match="already taken"):
        take(store, again)


def test_the_same_cell_of_the_same_notebook_finds_its_running_job():
    kv = DictKV()
    store = RayStore(kv, owner=ME, alive=lambda job_id: True)
    cell = "--gpus 2 --detach\ntrain()"
    store.write(record("a1b2c3", source_hash=client.source_hash(cell)))
    store.write(record("d4e5f6", source_hash=client.source_hash(cell), state=State.DONE, ended=time.time()))
    assert client.running_copy(store, cell, "nb.ipynb").id == "a1b2c3"
    assert client.running_copy(store, cell, "other.ipynb") is None
    assert client.running_copy(store, cell + "\n", "nb.ipynb") is None
