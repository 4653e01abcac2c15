"""The live rank panel while a job runs (taas.io.board), on a fake clock and recording sinks:
when it shows, where (a display updated in place, or text), and what it ends with."""

from __future__ import annotations

from dataclasses import dataclass

from taas.io.board import METADATA, Board

KEYS = ["rank0", "rank1", "loader:train:0"]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class TextSink:
    """A terminal: no panel method."""

    def __init__(self):
        self.written = []

    def write(self, stream, text):
        self.written.append((stream, text))

    def progress(self, key, stream, text, final):
        pass


class NotebookSink(TextSink):
    def __init__(self, updates_in_place=True):
        super().__init__()
        self.updates_in_place = updates_in_place
        self.panels = []

    def panel(self, bundle, metadata, final):
        self.panels.append((bundle, metadata, final))


@dataclass(frozen=True)
class Beat:
    state: str = "running"
    line: int | None = 4
    call: str = "step"
    node: int = 0
    cpu: float = 50.0
    rss: int = 1 << 29
    gpu_mem: int | None = None
    gpu_util: int | None = None
    data: tuple = ()


def test_a_live_panel_appears_after_two_seconds_updates_each_second_and_ends_as_one_line():
    clock, sink = Clock(), NotebookSink()
    board = Board(sink, KEYS, clock=clock)
    for t in (0.5, 1.0, 1.9):
        clock.now = 100 + t
        board.tick()
    assert sink.panels == []  # a short cell never gets one
    board.beat("rank0", Beat())
    clock.now = 102.0
    board.tick()
    board.tick()
    clock.now = 102.5
    board.tick()
    assert len(sink.panels) == 1
    bundle, metadata, final = sink.panels[0]
    assert metadata == METADATA and not final
    assert "rank0  running   4     step" in bundle["text/plain"] and "<table" in bundle["text/html"]
    assert "rank1  starting" in bundle["text/plain"]
    clock.now = 103.0
    board.tick()
    assert len(sink.panels) == 2
    board.done("rank0")
    board.done("rank1")
    clock.now = 103.4
    board.close()
    assert sink.panels[-1] == ({"text/plain": "taas: 2 ranks, 3.4 s: done 2"}, METADATA, True)
    assert sink.written == []


def test_a_job_that_ends_before_the_panel_shows_leaves_nothing():
    clock, sink = Clock(), NotebookSink()
    board = Board(sink, KEYS, clock=clock)
    clock.now = 101.5
    board.tick()
    board.close()
    assert sink.panels == [] and sink.written == []


def test_in_a_terminal_it_is_text_every_ten_seconds():
    clock, sink = Clock(), TextSink()
    board = Board(sink, KEYS, clock=clock)
    shown = []
    for step in range(0, 260):
        clock.now = 100 + step / 10
        board.tick()
        shown += [(clock.now, text) for _, text in sink.written[len(shown):]]
    assert [round(t - 100) for t, _ in shown] == [10, 20]
    assert all(text.startswith("taas: 2 ranks, ") for _, text in shown)
    assert {stream for stream, _ in sink.written} == {"stderr"}
    board.close()
    assert len(sink.written) == 2  # no summary line in text


def test_a_batch_run_notebook_prints_it_only_after_a_long_silence():
    # nbconvert / nbval keep a display's last state and save the outputs: a job that keeps
    # printing gets nothing, however long it runs.
    clock, sink = Clock(), NotebookSink(updates_in_place=False)
    board = Board(sink, KEYS, clock=clock)
    for step in range(0, 1200):
        clock.now = 100 + step / 10
        if step % 50 == 0:
            board.output("rank0")
        board.tick()
    assert sink.written == [] and sink.panels == []
    start = clock.now
    while clock.now < start + 65:
        clock.now += 0.1
        board.tick()
    assert len(sink.written) == 2 and sink.panels == []  # after 30 s of silence, then 30 s later
    board.close()
    assert sink.panels == []


def test_states_follow_beats_done_and_exits():
    clock, sink = Clock(), NotebookSink()
    board = Board(sink, ["rank0", "rank1", "rank2", "rank3"], clock=clock)
    board.beat("rank0", Beat(state="waiting", call="all_reduce", line=9))
    board.beat("rank1", Beat())
    board.exited("rank1", 1)
    board.beat("rank1", Beat())  # a late beat does not bring it back
    board.beat("rank2", Beat())
    board.exited("rank2", -15, stopped=True)
    board.done("rank3")
    board.exited("rank3", -15, stopped=True)  # done first: stopped by us after its cell ended
    rows = {r.key: r for r in board.rank_rows(clock.now)}
    assert (rows["rank0"].state, rows["rank0"].call, rows["rank0"].line) == ("waiting", "all_reduce", 9)
    assert [rows[k].state for k in ("rank1", "rank2", "rank3")] == ["failed", "stopped", "done"]
    assert rows["rank1"].line is None and rows["rank1"].call == ""  # a finished rank is nowhere


def test_seconds_since_the_last_output_per_rank():
    clock, sink = Clock(), NotebookSink()
    board = Board(sink, ["rank0", "rank1"], clock=clock)
    board.output("rank0")
    clock.now += 4.5
    rows = board.rank_rows(clock.now)
    assert rows[0].quiet == 4.5 and rows[1].quiet is None


def test_loader_rows_units_and_the_ranks_data_wait():
    clock, sink = Clock(), NotebookSink()
    board = Board(sink, KEYS, clock=clock)
    board.beat("rank0", Beat(data=(("train", 10, 0.0),)))
    board.beat("rank1", Beat(data=(("train", 10, 0.0),)))
    board.loader("loader:train:0", 25)
    clock.now += 10
    board.beat("rank0", Beat(data=(("train", 30, 1.0),)))
    board.beat("rank1", Beat(data=(("train", 30, 3.0),)))
    [row] = board.loader_rows(clock.now)
    assert (row.key, row.state, row.units) == ("loader:train:0", "loading", 25)
    assert abs(row.wait - 0.2) < 1e-9  # 4 s of 20 rank-seconds
    board.loader("loader:train:0", 60, finished=True)
    assert board.loader_rows(clock.now)[0].state == "done"


def test_many_ranks_show_as_nodes():
    clock, sink = Clock(), NotebookSink()
    keys = [f"rank{i}" for i in range(32)]
    board = Board(sink, keys, clock=clock)
    for i in range(32):
        board.beat(f"rank{i}", Beat(node=i // 8))
    clock.now += 2
    board.tick()
    text = sink.panels[-1][0]["text/plain"]
    assert [line.split()[0] for line in text.splitlines()[2:]] == ["node0", "node1", "node2", "node3"]
    assert "running 8" in text


def test_a_rank_at_a_prompt_shows_debugger_or_input_until_it_is_done():
    from taas.io.board import Board as B

    class Quiet:
        def write(self, stream, text):
            pass

    board = B(Quiet(), ["rank0", "rank1"])
    board.asking("rank1", debugger=True)
    board.asking("rank0", debugger=False)
    states = {row.key: row.state for row in board.rank_rows(0.0)}
    assert states == {"rank0": "input", "rank1": "debugger"}
    board.done("rank1")
    board.asking("rank1", debugger=True)  # a late question never brings a finished rank back
    assert {row.key: row.state for row in board.rank_rows(0.0)}["rank1"] == "done"
