"""Table tests of taas.io.output: line splitting, long lines, progress states, rank tags."""

from __future__ import annotations

import pytest

from taas.io.output import LineSplitter, OutputRouter
from tests.support.sinks import Recorder


def feed_all(splitter: LineSplitter, chunks) -> tuple[list[str], list[bool]]:
    pieces, progress = [], []
    for chunk in chunks:
        got, changed = splitter.feed(chunk)
        pieces += got
        progress.append(changed)
    return pieces, progress


@pytest.mark.parametrize("chunks, expected", [
    ([b"a\nb\n"], ["a\n", "b\n"]),
    ([b"a", b"b", b"\nc"], ["ab\n"]),
    ([b"abc\r\n"], ["abc\n"]),
    ([b"abc\r", b"\n"], ["abc\n"]),  # '\r\n' split across reads
    ([b"1/3\r2/3\r3/3\n"], ["3/3\n"]),
    ([b"1/3\r2/3\r", b"3/3", b"\n"], ["3/3\n"]),
    ([b"done\r\r\n"], ["done\n"]),
    (["é".encode()[:1], "é".encode()[1:] + b"\n"], ["é\n"]),  # a character split across reads
])
def test_lines(chunks, expected):
    pieces, _ = feed_all(LineSplitter(), chunks)
    assert pieces == expected


def test_flush_ends_the_open_line():
    s = LineSplitter()
    assert s.feed(b"x\npartial") == (["x\n"], False)
    assert s.flush() == ["partial\n"]
    assert s.flush() == []


def test_progress_is_the_latest_state_and_ends_as_the_line():
    s = LineSplitter()
    assert s.feed(b"\rstep 1") == ([], True)
    assert s.progress_text() == "step 1"
    assert s.feed(b"\r") == ([], True)
    assert s.progress_text() == "step 1"  # the new state is still empty: the last one shows
    assert s.feed(b"step 2") == ([], True)
    assert s.progress_text() == "step 2"
    assert s.feed(b"\nnext") == (["step 2\n"], False)


def test_a_long_line_comes_in_pieces_of_max_line():
    s = LineSplitter(max_line=10)
    pieces, _ = feed_all(s, [b"x" * 7, b"x" * 7, b"x" * 7, b"y\nz"])
    assert pieces == ["x" * 14, "x" * 7 + "y\n"]
    assert "".join(pieces + s.flush()) == "x" * 21 + "y\nz\n"


def test_without_max_line_a_line_is_whole():
    s = LineSplitter(max_line=None)
    pieces, _ = feed_all(s, [b"x" * 100] * 50 + [b"\n"])
    assert pieces == ["x" * 5000 + "\n"]


def test_a_long_progress_bar_keeps_only_its_latest_state():
    s = LineSplitter()
    for i in range(20000):
        s.feed(f"\rstep {i:5d} of 20000".encode())
    assert s._size < 100 and len(s._parts) == 1 and len(s._done) < 100
    assert s.flush() == ["step 19999 of 20000\n"]


def test_router_tags_a_long_line_once():
    sink = Recorder()
    router = OutputRouter(sink, ["rank0", "rank1"], None, tag=True, hold=0.0)  # nothing held
    router._splitters[("rank0", "stdout")] = LineSplitter(max_line=10)
    router.feed("rank0", "stdout", b"a" * 25)
    router.feed("rank1", "stderr", b"other stream\n")
    router.feed("rank0", "stdout", b"b\nc\n")
    router.close()
    assert sink.text() == "[rank0] " + "a" * 25 + "b\n[rank0] c\n"
    assert len(sink.out) == 3  # the long line's start went out before its end came


def test_router_progress_final_state():
    sink = Recorder()
    router = OutputRouter(sink, ["rank0"], None, tag=False, progress_interval=0.0)
    for i in range(1, 6):
        router.feed("rank0", "stderr", f"\r{i}/5".encode())
    router.feed("rank0", "stderr", b"\ndone\n")
    router.close()
    assert sink.bars[-1] == ("rank0", "5/5", True)
    assert [b for b in sink.bars if not b[2]][-1][1] == "5/5"
    assert sink.text("stderr") == "done\n"


def test_router_replays_hidden_pieces_with_one_tag():
    sink = Recorder()
    router = OutputRouter(sink, ["rank0", "rank1"], {"rank0"}, tag=True)
    router._splitters[("rank1", "stdout")] = LineSplitter(max_line=4)
    router.feed("rank1", "stdout", b"abcdefgh\nxy\n")
    assert sink.out == []
    router.replay_hidden("--- {key} ---")
    assert sink.text() == "[rank1] abcdefgh\n[rank1] xy\n"


def test_router_never_mixes_two_processes_in_one_line():
    sink = Recorder()
    router = OutputRouter(sink, ["rank0", "rank1"], None, tag=True, hold=0.0)  # nothing held
    router._splitters[("rank0", "stdout")] = LineSplitter(max_line=4)
    router.feed("rank0", "stdout", b"aaaaaa")
    router.feed("rank1", "stdout", b"hi\n")
    router.feed("rank0", "stdout", b"bb\n")
    router.close()
    assert sink.text() == "[rank0] aaaaaa\n[rank1] hi\n[rank0] bb\n"


def test_a_terminal_answers_a_ranks_question_from_its_stdin(monkeypatch, capsys):
    import io

    from taas.io.output import TerminalSink

    monkeypatch.setattr("sys.stdin", io.StringIO("Ada\n"))
    assert TerminalSink().ask("[rank1] name? ") == "Ada"
    assert capsys.readouterr().out == "[rank1] name? "
    with pytest.raises(EOFError):  # the end of its input: the rank's input() raises EOFError
        TerminalSink().ask("[rank1] again? ")
