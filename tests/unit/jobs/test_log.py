"""taas.jobs.log: the output log stays within its cap, keeps the first and the latest records, says
what it dropped, survives a follower that fell behind and a line cut by a crash; view.json."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest

from taas.jobs import api
from taas.jobs.log import HEAD, LogReader, LogWriter, read_view, write_view


def text(i: int) -> dict:
    return {"op": "w", "s": "stdout", "x": f"line {i:05d} " + "." * 40 + "\n"}


def on_disk(out) -> int:
    return sum(entry.stat().st_size for entry in out.iterdir())


def indices(out) -> list[int]:
    """Every record's index on disk, segment by segment in order (head, then tails)."""
    names = sorted(os.listdir(out), key=lambda n: -1 if n == HEAD else int(n.split("-")[1].split(".")[0]))
    return [json.loads(line)["i"] for name in names for line in (out / name).read_bytes().splitlines()]


def test_a_log_under_its_cap_reads_back_whole_in_order(tmp_path):
    writer = LogWriter(tmp_path, cap=1 << 20)
    for i in range(100):
        writer.append(text(i))
    assert writer.count == 100
    assert os.listdir(tmp_path / api.OUT) == [HEAD]
    assert LogReader(tmp_path).read() == [text(i) for i in range(100)]  # "i" is the reader's own


def test_files_are_private(tmp_path):
    old = os.umask(0)
    try:
        writer = LogWriter(tmp_path, cap=4096)
        for i in range(200):
            writer.append(text(i))
        writer.close()
    finally:
        os.umask(old)
    out = tmp_path / api.OUT
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert len(os.listdir(out)) == 3
    for entry in out.iterdir():
        assert stat.S_IMODE(entry.stat().st_mode) == 0o600


@pytest.mark.parametrize("cap", [4096, 8192, 65536])
def test_the_cap_holds_and_the_first_and_latest_records_stay(tmp_path, cap):
    writer = LogWriter(tmp_path, cap=cap)
    total = 20 * cap // 90
    one = len(json.dumps(dict(text(total), i=total), separators=(",", ":"))) + 1  # the longest record
    biggest = 0
    for i in range(total):
        writer.append(text(i))
        biggest = max(biggest, on_disk(writer.out))
    writer.close()
    assert biggest <= cap + one

    records = LogReader(tmp_path).read()
    gaps = [n for n, item in enumerate(records) if item["op"] == "dropped"]
    assert len(gaps) == 1  # one record for the whole gap
    head, dropped, latest = records[:gaps[0]], records[gaps[0]], records[gaps[0] + 1:]
    assert head == [text(i) for i in range(len(head))]  # the first records, from the first
    assert latest == [text(i) for i in range(total - len(latest), total)]  # the latest, to the last
    assert dropped == {"op": "dropped", "n": total - len(head) - len(latest)}
    longest = max(len(line) + 1 for line in (writer.out / HEAD).read_bytes().splitlines())
    assert (writer.out / HEAD).stat().st_size > cap // 2 - longest  # the head was filled first
    assert len(latest) * longest >= cap // 4 - longest  # at least a whole tail segment of the latest


def test_indices_on_disk_are_the_written_order_with_one_gap(tmp_path):
    writer = LogWriter(tmp_path, cap=4096)
    for i in range(500):
        writer.append(text(i))
    found = indices(writer.out)
    assert found == sorted(found) and len(set(found)) == len(found)
    gaps = [(a, b) for a, b in zip(found, found[1:]) if b != a + 1]
    assert len(gaps) == 1 and found[0] == 0 and found[-1] == 499


def test_a_record_bigger_than_a_segment_is_kept_whole(tmp_path):
    writer = LogWriter(tmp_path, cap=4096)
    big = {"op": "w", "s": "stdout", "x": "x" * 5000}
    writer.append(text(0))
    writer.append(big)
    writer.append(text(2))
    assert LogReader(tmp_path).read() == [text(0), big, text(2)]


def test_a_follower_that_fell_behind_a_removed_segment_goes_on_from_the_oldest_left(tmp_path):
    writer = LogWriter(tmp_path, cap=4096)
    reader = LogReader(tmp_path)
    i = 0
    while "tail-0.jsonl" not in os.listdir(writer.out):
        writer.append(text(i))
        i += 1
    seen = reader.read()
    assert seen == [text(n) for n in range(i)]
    assert len((writer.out / "tail-0.jsonl").read_bytes().splitlines()) == 1  # it read into the first tail
    while "tail-0.jsonl" in os.listdir(writer.out):  # the writer goes on until tail-0 is removed
        writer.append(text(i))
        i += 1
    assert sorted(os.listdir(writer.out)) == [HEAD, "tail-1.jsonl", "tail-2.jsonl"]
    oldest = json.loads((writer.out / "tail-1.jsonl").read_bytes().splitlines()[0])["i"]
    assert oldest > len(seen)
    more = reader.read()
    assert more[0] == {"op": "dropped", "n": oldest - len(seen)}
    assert more[1:] == [text(n) for n in range(oldest, i)]
    writer.append(text(i))
    assert reader.read() == [text(i)]  # and follows on


def test_a_follower_reads_what_each_look_added(tmp_path):
    writer = LogWriter(tmp_path, cap=4096)
    reader = LogReader(tmp_path)
    assert reader.read() == []
    got = []
    for i in range(300):  # across the head, and tail segments begun and removed
        writer.append(text(i))
        if i % 7 == 0:
            got += reader.read()
    got += reader.read()
    assert [item for item in got if item["op"] == "dropped"] == []  # it never fell behind
    assert got == [text(i) for i in range(300)]


def test_a_reader_before_the_writer_reads_nothing(tmp_path):
    assert LogReader(tmp_path).read() == []
    (tmp_path / api.OUT).mkdir()
    assert LogReader(tmp_path).read() == []
    assert LogReader(tmp_path).start_near_end(10) == 0


def test_a_partial_last_line_is_not_read_until_it_is_complete(tmp_path):
    writer = LogWriter(tmp_path, cap=1 << 20)
    writer.append(text(0))
    line = json.dumps(dict(text(1), i=1), separators=(",", ":")).encode() + b"\n"
    with open(writer.out / HEAD, "ab") as file:  # a crash mid-write: half a line
        file.write(line[:20])
    reader = LogReader(tmp_path)
    assert reader.read() == [text(0)]
    assert reader.read() == []
    assert LogReader(tmp_path).start_near_end(5) == 0
    with open(writer.out / HEAD, "ab") as file:
        file.write(line[20:])
    assert reader.read() == [text(1)]


def test_an_unreadable_line_is_skipped(tmp_path):
    writer = LogWriter(tmp_path, cap=1 << 20)
    writer.append(text(0))
    with open(writer.out / HEAD, "ab") as file:
        file.write(b'{"op": "w", "x": \n[1, 2]\n{"no index": 1}\n')
    writer.append(text(1))
    assert LogReader(tmp_path).read() == [text(0), text(1)]


def test_concurrent_appends_keep_every_index_unique(tmp_path):
    writer = LogWriter(tmp_path, cap=1 << 24)
    threads, each = 8, 500
    start = threading.Barrier(threads)

    def append(t: int) -> None:
        start.wait()
        for n in range(each):
            writer.append({"op": "w", "s": "stdout", "x": f"{t}:{n}\n"})

    workers = [threading.Thread(target=append, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert writer.count == threads * each
    assert sorted(indices(writer.out)) == list(range(threads * each))
    assert indices(writer.out) == list(range(threads * each))  # written in index order too
    records = LogReader(tmp_path).read()
    assert len(records) == threads * each
    for t in range(threads):  # each thread's own records in its order
        assert [r["x"] for r in records if r["x"].startswith(f"{t}:")] == [f"{t}:{n}\n" for n in range(each)]


def test_concurrent_appends_past_the_cap_stay_within_it(tmp_path):
    cap = 8192
    writer = LogWriter(tmp_path, cap=cap)
    workers = [threading.Thread(target=lambda t=t: [writer.append(text(t * 1000 + n)) for n in range(300)])
               for t in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    found = indices(writer.out)
    assert len(set(found)) == len(found) and found == sorted(found) and found[-1] == 1199
    assert on_disk(writer.out) <= cap + len(json.dumps(dict(text(0), i=1199))) + 1


# -- starting near the end ---------------------------------------------------------------------
def test_start_near_end_in_the_head(tmp_path):
    writer = LogWriter(tmp_path, cap=1 << 20)
    for i in range(100):
        writer.append(text(i))
    reader = LogReader(tmp_path)
    assert reader.start_near_end(10) == 90
    assert reader.read() == [text(i) for i in range(90, 100)]
    writer.append(text(100))
    assert reader.read() == [text(100)]


def test_start_near_end_asking_more_than_there_is_starts_at_the_start(tmp_path):
    writer = LogWriter(tmp_path, cap=1 << 20)
    for i in range(5):
        writer.append(text(i))
    reader = LogReader(tmp_path)
    assert reader.start_near_end(400) == 0
    assert reader.read() == [text(i) for i in range(5)]


@pytest.mark.parametrize("latest", [1, 3, 20])
def test_start_near_end_across_tail_segments(tmp_path, latest):
    writer = LogWriter(tmp_path, cap=8192)
    total = 600
    for i in range(total):
        writer.append(text(i))
    assert len(os.listdir(writer.out)) == 3  # the head and two tails
    assert len(indices(writer.out)) - len((writer.out / HEAD).read_bytes().splitlines()) > latest
    reader = LogReader(tmp_path)
    assert reader.start_near_end(latest) == total - latest
    assert reader.read() == [text(i) for i in range(total - latest, total)]


def test_start_near_end_reaching_into_the_head_says_the_gap(tmp_path):
    writer = LogWriter(tmp_path, cap=4096)
    total = 400
    for i in range(total):
        writer.append(text(i))
    kept = len(indices(writer.out))
    head = len((writer.out / HEAD).read_bytes().splitlines())
    reader = LogReader(tmp_path)
    skipped = reader.start_near_end(kept - head + 2)  # the last two of the head, then every tail
    assert skipped == head - 2
    records = reader.read()
    assert records[:2] == [text(head - 2), text(head - 1)]
    assert records[2] == {"op": "dropped", "n": total - kept}
    assert records[3:] == [text(i) for i in range(total - (kept - head), total)]


# -- a log of its own (metrics) ----------------------------------------------------------------
def test_a_part_of_its_own(tmp_path):
    out = LogWriter(tmp_path, cap=4096)
    metrics = LogWriter(tmp_path, cap=4096, part=api.METRICS)
    out.append(text(0))
    metrics.append({"op": "m", "r": 0, "rows": [[1, {"loss": 0.5}]]})
    assert LogReader(tmp_path).read() == [text(0)]
    assert LogReader(tmp_path, part=api.METRICS).read() == [{"op": "m", "r": 0, "rows": [[1, {"loss": 0.5}]]}]


@pytest.mark.parametrize("value, cap", [
    (None, api.LOG_CAP), ("", api.LOG_CAP), ("64M", 64 << 20), ("1G", 1 << 30), ("512k", 512 << 10),
    ("100000", 100000), ("10", 4096), ("1k", 4096), ("lots", api.LOG_CAP)])
def test_log_cap_from_the_environment(monkeypatch, tmp_path, value, cap):
    if value is None:
        monkeypatch.delenv("TAAS_LOG_CAP", raising=False)
    else:
        monkeypatch.setenv("TAAS_LOG_CAP", value)
    assert api.log_cap() == cap
    writer = LogWriter(tmp_path)
    assert writer.cap == cap
    writer.close()


# -- view.json -----------------------------------------------------------------------------------
def test_the_view_is_replaced_whole(tmp_path):
    assert read_view(tmp_path) == {}
    write_view(tmp_path, {"progress": {"k\nstdout": "10%"}, "panel": None, "live": {}, "at": 1.0})
    write_view(tmp_path, {"progress": {}, "panel": {"data": {"text/plain": "r0"}, "md": {}}, "live": {}, "at": 2.0})
    assert read_view(tmp_path) == {"progress": {}, "panel": {"data": {"text/plain": "r0"}, "md": {}},
                                   "live": {}, "at": 2.0}
    assert stat.S_IMODE((tmp_path / api.VIEW).stat().st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == [api.VIEW]


def test_a_damaged_view_reads_as_none(tmp_path):
    (tmp_path / api.VIEW).write_text('{"progress": ')
    assert read_view(tmp_path) == {}
