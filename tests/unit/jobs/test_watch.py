"""taas.jobs.watch: a viewer is woken by each change of a record folder (inotify), not by a period."""

import os
import threading

from taas.jobs import api
from taas.jobs.api import JobRecord, State
from taas.jobs.log import LogWriter
from taas.jobs.store import Store, hold_lock
from taas.jobs.watch import Changes


def _later(action) -> threading.Thread:
    thread = threading.Thread(target=action)
    thread.start()
    return thread


def test_quiet_folder_waits_out_its_timeout(tmp_path):
    with Changes(tmp_path) as changes:
        assert changes.wait(0.05) is False


def test_a_record_replaced_and_a_log_line_wake_the_viewer(tmp_path):
    (tmp_path / "record.json").write_text("{}")
    writer = LogWriter(tmp_path)  # out/ exists before the watch
    with Changes(tmp_path) as changes:
        assert changes._watched == {str(tmp_path), str(tmp_path / api.OUT)}

        def replace():
            (tmp_path / "record.json.tmp").write_text('{"state": "done"}')
            os.rename(tmp_path / "record.json.tmp", tmp_path / "record.json")

        _later(replace).join()
        assert changes.wait(60) is True
        assert changes.wait(0.01) is False  # every event of that change was taken
        _later(lambda: writer.append({"op": "w", "s": "stdout", "x": "hi\n"})).join()
        assert changes.wait(60) is True
    writer.close()


def test_a_viewer_looking_at_a_running_job_does_not_wake_itself(tmp_path):
    """Reading the record (which looks at the host's lock) is no change: a viewer that woke for
    its own look would spin a core for the whole job."""
    store = Store(tmp_path / "jobs")
    record = JobRecord(id="a1b2c3", state=State.RUNNING, ranks=2, where="here", started=1.0)
    folder = store.create(record)
    lock = hold_lock(folder)  # the host's
    try:
        with Changes(folder) as changes:
            for _ in range(3):
                assert store.read(record.id).state is State.RUNNING
                assert changes.wait(0.05) is False
    finally:
        os.close(lock)


def test_a_log_folder_made_after_the_watch_is_watched_too(tmp_path):
    with Changes(tmp_path) as changes:
        metrics = LogWriter(tmp_path, part=api.METRICS)  # the folder's creation wakes the viewer
        assert changes.wait(60) is True
        assert str(tmp_path / api.METRICS) in changes._watched
        metrics.append({"op": "m", "r": 0, "rows": []})
        assert changes.wait(60) is True
        metrics.close()


def test_without_inotify_it_looks_at_its_fallback_period(tmp_path, monkeypatch):
    from taas.jobs import watch

    slept = []
    monkeypatch.setattr(watch.time, "sleep", slept.append)
    changes = Changes(tmp_path, fallback=0.01)
    changes.close()  # as if inotify_init1 had failed
    assert changes.wait(60) is False
    assert slept == [0.01]


def test_records_that_are_not_files_here_are_looked_at_each_fallback_period(monkeypatch):
    from taas.jobs import watch

    slept = []
    monkeypatch.setattr(watch.time, "sleep", slept.append)
    with Changes(None, fallback=0.02) as changes:
        assert changes.wait(0.5) is False
    assert slept == [0.02]
