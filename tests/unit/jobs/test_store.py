"""taas.jobs.store: private folders, damaged records reported in one line, lost detection through
the record's lock, forget, age pruning, ids by prefix."""

from __future__ import annotations

import json
import os
import pathlib
import stat
import subprocess
import sys
import time

import pytest

from taas.jobs import api
from taas.jobs.api import State
from taas.jobs.store import JobError, Store, write_file
from tests.support.jobs import make_record
from tests.support.users import needs_another_user, passable_folder, python_as_nobody

# A job host's part, and nothing else: hold the record's lock, say so, wait to be killed.
HOLDER = r"""
import pathlib, signal, sys
from taas.jobs.store import hold_lock
hold_lock(pathlib.Path(sys.argv[1]))
print("holding", flush=True)
while True:
    signal.pause()
"""


record = make_record


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "jobs")


@pytest.fixture
def holders():
    """Start a process that holds a record folder's lock (``start(folder)``: its Popen, once it
    holds it); every one still alive is killed by its pid at the test's end."""
    started: list[subprocess.Popen] = []

    def start(folder: pathlib.Path) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout.readline() == "holding\n"  # an event: it holds the lock now
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()
        process.stdout.close()


def one_line(text: str) -> bool:
    return bool(text) and "\n" not in text


# -- the folder: private to its user ---------------------------------------------------------
def test_folder_and_records_are_private_even_under_a_permissive_umask(store):
    old = os.umask(0)
    try:
        folder = store.create(record("a1b2c3"))
        write_file(folder / api.RESULTS, b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / api.OUT).stat().st_mode) == 0o700
    for name in (api.RECORD, api.LOCK, api.RESULTS):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600, name
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # write_file's temporary renamed


def test_a_folder_others_can_read_is_refused_in_one_line_naming_chmod(store):
    store.create(record("a1b2c3"))
    os.chmod(store.root, 0o755)
    for use in (store.ids, store.listing, lambda: store.read("a1b2c3"), lambda: store.resolve("a1b")):
        with pytest.raises(JobError) as caught:
            use()
        message = str(caught.value)
        assert one_line(message)
        assert f"chmod 700 {store.root}" in message
        assert "755" in message


def test_creating_a_record_makes_a_readable_folder_private_again(store):
    store.root.mkdir(parents=True, mode=0o755)
    os.chmod(store.root, 0o755)
    store.create(record("a1b2c3"))
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    assert [item.record.id for item in store.listing()] == ["a1b2c3"]


def test_a_missing_folder_is_no_jobs_not_an_error(store):
    assert store.ids() == []
    assert store.listing() == []
    assert not store.root.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_a_folder_owned_by_another_user_is_refused(store):
    store.create(record("a1b2c3"))
    os.chown(store.root, 65534, 65534)
    with pytest.raises(JobError) as caught:
        store.listing()
    assert one_line(str(caught.value))
    assert "belongs to another user (uid 65534)" in str(caught.value)
    assert "TAAS_HOME" in str(caught.value)


OTHER_USER = r"""
import os, pathlib, sys
from taas.jobs.store import JobError, Store
root = pathlib.Path(sys.argv[1])
try:
    print("listed", os.listdir(root))
except PermissionError:
    print("list refused")
try:
    print("read", (root / sys.argv[2] / "record.json").read_text())
except PermissionError:
    print("read refused")
try:
    print("store", Store(root).listing())
except JobError as exc:
    print("store refused:", exc)
try:
    print("store", Store(root).read(sys.argv[2]))
except JobError as exc:
    print("store refused:", exc)
"""


@needs_another_user
def test_another_user_can_neither_list_nor_read_the_records():
    with passable_folder("taas-store-") as base:  # what stops that user: the records' own modes
        store = Store(base / "jobs")
        store.create(record("a1b2c3"))
        result = subprocess.run(python_as_nobody(OTHER_USER, str(store.root), "a1b2c3"),
                                capture_output=True, text=True, cwd="/", timeout=60)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[:2] == ["list refused", "read refused"], result.stdout
        assert len(lines) == 4, result.stdout
        for line in lines[2:]:
            assert line.startswith("store refused: taas: the job records folder"), line
            assert "belongs to another user (uid 0)" in line


# -- damaged records ---------------------------------------------------------------------------
DAMAGED = {
    "half-written": '{"id": "bad000", "state": "run',
    "empty": "",
    "no state": json.dumps({"id": "bad000", "ranks": 2, "where": "x", "started": 1.0}),
    "missing keys": json.dumps({"id": "bad000", "state": "done"}),
    "unknown state": json.dumps({"id": "bad000", "state": "exploded", "ranks": 2, "where": "x", "started": 1.0}),
}


@pytest.mark.parametrize("text", list(DAMAGED.values()), ids=list(DAMAGED))
def test_a_damaged_record_is_one_line_and_the_others_are_still_listed(store, text):
    store.create(record("a1b2c3"))
    store.create(record("bad000"))
    (store.folder("bad000") / api.RECORD).write_text(text)
    with pytest.raises(JobError) as caught:
        store.read("bad000")
    message = str(caught.value)
    assert one_line(message)
    assert "job bad000's record is damaged" in message and "taas forget bad000" in message
    items = {item.record.id: item for item in store.listing()}
    assert set(items) == {"a1b2c3", "bad000"}
    assert items["a1b2c3"].problem == "" and items["a1b2c3"].record.state is State.DONE
    assert items["bad000"].problem == message
    assert (store.folder("bad000") / api.RECORD).read_text() == text  # reported, never rewritten


@pytest.mark.parametrize("text", ["null", "[1, 2]", '"done"'])
def test_a_record_that_is_not_a_json_object_is_one_line_too(store, text):
    store.create(record("a1b2c3"))
    store.create(record("bad000"))
    (store.folder("bad000") / api.RECORD).write_text(text)
    with pytest.raises(JobError, match="damaged"):
        store.read("bad000")
    assert {item.record.id for item in store.listing()} == {"a1b2c3", "bad000"}


def test_a_missing_record_file_is_one_line_and_listed_as_a_problem(store):
    store.create(record("a1b2c3"))
    os.unlink(store.folder("a1b2c3") / api.RECORD)
    with pytest.raises(JobError) as caught:
        store.read("a1b2c3")
    assert one_line(str(caught.value)) and "record is missing" in str(caught.value)
    [item] = store.listing()
    assert item.problem == str(caught.value)


def test_unknown_keys_in_a_record_are_ignored(store):
    written = record("a1b2c3")
    store.create(written)
    path = store.folder("a1b2c3") / api.RECORD
    path.write_text(json.dumps(dict(json.loads(path.read_text()), written_by_a_later_taas=True)))
    assert store.read("a1b2c3") == written


def test_folders_that_are_not_job_ids_are_not_jobs(store):
    store.create(record("a1b2c3"))
    (store.root / "notes").mkdir()
    (store.root / ".gone-ffffff-1").mkdir()
    (store.root / "abcdef.txt").write_text("")
    assert store.ids() == ["a1b2c3"]
    for name in ("notes", "../jobs", "ABCDEF"):
        with pytest.raises(JobError, match="no job"):
            store.read(name)


# -- the host's lock: running or lost ----------------------------------------------------------
@pytest.mark.parametrize("state", [State.RUNNING, State.WAITING])
def test_an_unfinished_record_whose_lock_is_free_reads_lost_and_is_written_so(store, state):
    store.create(record("a1b2c3", state, host_pid=4242, ended=None))
    read = store.read("a1b2c3")
    assert read.state is State.LOST
    assert read.ended is not None and abs(read.ended - time.time()) < 60
    assert "pid 4242" in read.cause and "ended without a word" in read.cause
    on_disk = json.loads((store.folder("a1b2c3") / api.RECORD).read_text())
    assert on_disk["state"] == "lost" and on_disk["cause"] == read.cause


def test_a_lock_held_by_another_process_keeps_running_until_it_dies(store, holders):
    folder = store.create(record("a1b2c3", State.RUNNING, ended=None))
    holder = holders(folder)
    before = (folder / api.RECORD).read_bytes()
    assert store.read("a1b2c3").state is State.RUNNING
    assert [item.record.state for item in store.listing()] == [State.RUNNING]
    assert (folder / api.RECORD).read_bytes() == before  # a reader does not write a running record
    holder.kill()
    holder.wait()
    assert store.read("a1b2c3").state is State.LOST
    assert json.loads((folder / api.RECORD).read_text())["state"] == "lost"


def test_a_finished_record_is_never_marked_lost(store):
    store.create(record("a1b2c3", State.FAILED, cause="boom"))
    assert store.read("a1b2c3").state is State.FAILED
    assert store.read("a1b2c3").cause == "boom"


def test_the_taken_marker_reads_as_when_the_results_were_taken(store):
    folder = store.create(record("a1b2c3", has_results=True))
    assert store.read("a1b2c3").taken is None
    (folder / api.TAKEN).touch()
    os.utime(folder / api.TAKEN, (1_700_000_000, 1_700_000_000))
    assert store.read("a1b2c3").taken == 1_700_000_000


# -- forget ------------------------------------------------------------------------------------
def test_remove_drops_a_finished_record_whole(store):
    store.create(record("a1b2c3"))
    store.create(record("d4e5f6"))
    store.remove("a1b2c3")
    assert sorted(os.listdir(store.root)) == ["d4e5f6"]  # no half folder, no .gone- left


def test_remove_drops_a_damaged_record(store):
    store.create(record("bad000"))
    (store.folder("bad000") / api.RECORD).write_text("{")
    store.remove("bad000")
    assert store.ids() == []


def test_remove_of_an_unknown_id_is_one_line(store):
    store.create(record("a1b2c3"))
    with pytest.raises(JobError) as caught:
        store.remove("ffffff")
    assert one_line(str(caught.value)) and "no job 'ffffff'" in str(caught.value)


def test_remove_refuses_a_running_job(store, holders):
    folder = store.create(record("a1b2c3", State.RUNNING, ended=None))
    holders(folder)
    with pytest.raises(JobError) as caught:
        store.remove("a1b2c3")
    assert "taas cancel a1b2c3" in str(caught.value)
    assert folder.is_dir()


def test_remove_of_a_running_record_whose_host_is_gone_drops_it(store):
    store.create(record("a1b2c3", State.RUNNING, ended=None))  # lock free: lost, so final
    store.remove("a1b2c3")
    assert store.ids() == []


# -- age pruning -------------------------------------------------------------------------------
def test_listing_prunes_old_finished_records_only(store, holders, monkeypatch):
    monkeypatch.setenv("TAAS_JOBS_MAX_AGE", "1h")
    now = time.time()
    store.create(record("00d001", State.DONE, started=now - 3 * 3600, ended=now - 2 * 3600))
    store.create(record("00d002", State.FAILED, started=now - 3 * 3600, ended=now - 2 * 3600, cause="x"))
    store.create(record("00d003", State.CANCELLED, started=now - 3 * 3600, ended=now - 2 * 3600))
    store.create(record("ece001", State.DONE, started=now - 1200, ended=now - 600))
    store.create(record("00d004", State.DONE, started=now - 3 * 3600, ended=None))  # no end known: kept
    running = store.create(record("00d005", State.RUNNING, started=now - 3 * 3600, ended=None))
    holders(running)
    assert {item.record.id for item in store.listing(prune=False)} == {
        "00d001", "00d002", "00d003", "ece001", "00d004", "00d005"}
    assert store.ids() == ["00d001", "00d002", "00d003", "00d004", "00d005", "ece001"]
    assert {item.record.id for item in store.listing()} == {"ece001", "00d004", "00d005"}
    assert store.ids() == ["00d004", "00d005", "ece001"]
    assert store.read("00d005").state is State.RUNNING


def test_listing_is_newest_first(store):
    now = time.time()
    for job_id, started in (("aaaaaa", now - 30), ("bbbbbb", now - 10), ("cccccc", now - 20)):
        store.create(record(job_id, started=started, ended=started + 1))
    assert [item.record.id for item in store.listing()] == ["bbbbbb", "cccccc", "aaaaaa"]
    assert all(item.size > 0 for item in store.listing())


@pytest.mark.parametrize("text, seconds", [
    (None, api.MAX_AGE), ("", api.MAX_AGE), ("90", 90), ("30m", 1800), ("12h", 43200), ("14d", 14 * 86400),
    ("2D", 2 * 86400), ("soon", api.MAX_AGE), ("xd", api.MAX_AGE)])
def test_max_age_from_the_environment(monkeypatch, text, seconds):
    if text is None:
        monkeypatch.delenv("TAAS_JOBS_MAX_AGE", raising=False)
    else:
        monkeypatch.setenv("TAAS_JOBS_MAX_AGE", text)
    assert api.max_age() == seconds


# -- ids as typed ------------------------------------------------------------------------------
@pytest.fixture
def three(store):
    for job_id in ("abc123", "abd456", "ffffff"):
        store.create(record(job_id))
    return store


@pytest.mark.parametrize("typed, job_id", [
    ("abc", "abc123"), ("abc123", "abc123"), ("ABD4", "abd456"), (" f ", "ffffff"), ("ffffff", "ffffff")])
def test_resolve_a_unique_prefix(three, typed, job_id):
    assert three.resolve(typed) == job_id


@pytest.mark.parametrize("typed, says", [
    ("ab", "'ab' names 2 jobs (abc123, abd456); type more of the id"),
    ("0123", "no job '0123' here; `taas jobs` lists yours"),
    ("abc1234", "no job 'abc1234' here"),
    ("xyz", "'xyz' is not a job id"),
    ("", "'' is not a job id"),
    ("ab-c", "'ab-c' is not a job id"),
    ("../etc", "'../etc' is not a job id"),
])
def test_resolve_refuses_in_one_line(three, typed, says):
    with pytest.raises(JobError) as caught:
        three.resolve(typed)
    assert one_line(str(caught.value))
    assert says in str(caught.value)


def test_new_records_need_new_ids(store):
    store.create(record("a1b2c3"))
    with pytest.raises(FileExistsError):
        store.create(record("a1b2c3"))
