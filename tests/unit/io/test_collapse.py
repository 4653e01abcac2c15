"""Table tests of taas.io.collapse and of the router's collapsed output: data in, lines out."""

from __future__ import annotations

import pytest

from taas.io.collapse import Collapser, Shown, bar_shape, expand, tag
from taas.io.output import LineSplitter, OutputRouter
from tests.support.ranks import per_rank
from tests.support.sinks import Recorder


@pytest.mark.parametrize("ranks, text", [
    ([0], "0"), ([0, 1], "0-1"), ([1, 3], "1,3"), ([0, 1, 2, 5], "0-2,5"),
    (list(range(32)), "0-31"), ([3, 1, 2, 7, 9, 8], "1-3,7-9"),
])
def test_tag_and_expand(ranks, text):
    assert tag(ranks) == text
    assert expand(text) == sorted(ranks)


def run(events, ranks=(0, 1, 2, 3), hold=1.0, end=None, settle=0.0):
    """Feed (rank, text, time) events; the lines shown as "tag text", then what a flush shows."""
    c = Collapser(ranks, hold=hold, settle=settle)
    out: list[Shown] = []
    for rank, text, now in events:
        out += c.due(now)
        out += c.add(rank, "stdout", text + "\n", now)
    if end is not None:
        out += c.due(end)
    shown = [f"{tag(s.ranks)} {s.text[:-1]}" for s in out]
    return shown, [f"{tag(s.ranks)} {s.text[:-1]}" for s in c.flush()]


def test_every_rank_printing_a_line_shows_it_once_at_once():
    shown, left = run([(r, "epoch done", 0.0) for r in (2, 0, 3, 1)])
    assert shown == ["0-3 epoch done"] and left == []


def test_distinct_lines_stay_per_rank_and_show_in_rank_order_once_decided():
    events = [(2, "loss 0.30", 0.0), (0, "loss 0.31", 0.0), (3, "loss 0.28", 0.0)]
    shown, left = run(events)
    assert shown == []  # rank 1 may still print "loss 0.30": wait for it
    events.append((1, "loss 0.29", 0.0))
    shown, left = run(events)
    # rank 0's line goes first; the others wait for rank 0's next line (it might be the same).
    assert shown == ["0 loss 0.31"] and left == ["1 loss 0.29", "2 loss 0.30", "3 loss 0.28"]
    shown, left = run(events + [(r, "next", 0.1) for r in range(4)])
    assert shown == ["0 loss 0.31", "1 loss 0.29", "2 loss 0.30", "3 loss 0.28", "0-3 next"]


def test_a_line_some_ranks_print_shows_with_their_tags():
    events = [(1, "odd", 0.0), (3, "odd", 0.1), (0, "even", 0.2), (2, "even", 0.3)]
    assert run(events, hold=1.0) == (["1,3 odd"], ["0,2 even"])
    assert run(events, hold=1.0, end=1.2) == (["1,3 odd", "0,2 even"], [])


def test_the_last_line_of_some_ranks_waits_for_the_others_until_the_hold():
    events = [(r, "done", 0.0) for r in range(4)] + [(1, "odd", 0.1), (3, "odd", 0.2)]
    assert run(events, hold=1.0, end=1.0) == (["0-3 done"], ["1,3 odd"])
    assert run(events, hold=1.0, end=1.1) == (["0-3 done", "1,3 odd"], [])


def test_a_rank_whose_earlier_line_came_late_still_collapses():
    """Pipes are read in any order: rank 0's next line may come before rank 1's previous
    one.  Only each rank's first waiting line is shown, so rank 1's "odd" goes first."""
    events = [(0, "epoch 1", 0.0), (2, "epoch 1", 0.0), (1, "odd 0", 0.0), (3, "odd 0", 0.0),
              (1, "epoch 1", 0.05), (3, "epoch 1", 0.05)]
    assert run(events, settle=0.1, end=0.2) == (["1,3 odd 0", "0-3 epoch 1"], [])


def test_the_hold_is_bounded_in_time():
    shown, left = run([(0, "only rank 0", 0.0)], hold=0.5, end=0.4)
    assert shown == [] and left == ["0 only rank 0"]
    shown, _ = run([(0, "only rank 0", 0.0)], hold=0.5, end=0.5)
    assert shown == ["0 only rank 0"]


def test_a_rank_that_prints_but_is_behind_is_waited_for_up_to_max_hold():
    c = Collapser([0, 1], hold=0.3, max_hold=2.0, settle=0)
    c.extend(0, "stdout", ["a\n", "b\n"], 0.0)
    assert c.add(1, "stdout", "a\n", 0.2) == [Shown("stdout", (0, 1), "a\n")]
    assert c.due(0.45) == []  # rank 1 printed in this round of reads: behind, not silent
    assert c.add(1, "stdout", "b\n", 0.5) == [Shown("stdout", (0, 1), "b\n")]
    c.extend(0, "stdout", ["c\n"], 0.5)
    assert c.due(0.85) == []  # rank 1 printed in the round before
    assert c.due(0.9) == [Shown("stdout", (0,), "c\n")]  # silent for two rounds
    c = Collapser([0, 1], hold=0.3, max_hold=1.0, settle=0)
    c.extend(0, "stdout", [f"{i}\n" for i in range(10)], 0.0)
    for i in range(3):
        assert c.add(1, "stdout", f"{i}\n", 0.25 * (i + 1)) == [Shown("stdout", (0, 1), f"{i}\n")]
    shown = c.add(1, "stdout", "3\n", 1.0)  # rank 0's lines waited max_hold: all go
    assert shown[0] == Shown("stdout", (0, 1), "3\n") and shown[-1] == Shown("stdout", (0,), "9\n")
    assert c.held == 0


def test_one_ranks_lines_keep_their_order():
    # rank 1 prints b before a: it cannot join rank 0's "a" (its "b" would come after it).
    events = [(0, "a", 0), (0, "b", 0), (1, "b", 0), (1, "a", 0)]
    shown, left = run(events, ranks=(0, 1))
    got = shown + left
    for rank in (0, 1):
        mine = [line.split(" ", 1)[1] for line in got if rank in expand(line.split(" ", 1)[0])]
        assert mine == (["a", "b"] if rank == 0 else ["b", "a"]), got
    assert got == ["0 a", "0-1 b", "1 a"]


def test_stdout_and_stderr_keep_one_ranks_order():
    c = Collapser([0, 1], hold=1.0, settle=0)
    got = c.add(0, "stdout", "out\n", 0) + c.add(0, "stderr", "err\n", 0)
    got += c.add(1, "stdout", "out\n", 0) + c.add(1, "stderr", "err\n", 0)
    assert got == [Shown("stdout", (0, 1), "out\n"), Shown("stderr", (0, 1), "err\n")]


def test_a_rank_that_ended_is_not_waited_for():
    c = Collapser([0, 1], hold=10.0, settle=0)
    assert c.add(0, "stdout", "x\n", 0) == []
    assert c.end(1, 0) == [Shown("stdout", (0,), "x\n")]


def test_through_shows_a_ranks_held_lines_before_what_it_shows_elsewhere():
    c = Collapser([0, 1, 2], hold=10.0, settle=0)
    c.add(0, "stdout", "a\n", 0)
    c.add(1, "stdout", "b\n", 0)
    c.add(0, "stdout", "c\n", 0)
    assert [s.text for s in c.through(1)] == ["b\n"]  # rank 1's lines, no other rank's
    assert [s.text for s in c.flush()] == ["a\n", "c\n"]


def test_identical_lines_cost_linear_work_and_bounded_memory():
    """32 ranks x N identical lines, rank by rank in chunks as pipes deliver them: the work
    per line stays the same however many lines, and what is held stays under the limit."""
    per_line = []
    for n in (1_000, 10_000):
        c = Collapser(range(32), hold=1.0, settle=0)
        shown, most_held = 0, 0
        for chunk in range(0, n, 500):  # each rank's next 500 lines, one rank after the other
            for rank in range(32):
                for _ in range(min(500, n - chunk)):
                    shown += len(c.add(rank, "stdout", "epoch done\n", 0.0))
                    most_held = max(most_held, c.held)
        shown += len(c.flush())
        assert shown == n  # every line collapsed into one for the 32 ranks
        assert most_held <= 32 * 500
        per_line.append(c.steps / (32 * n))
    assert per_line[1] <= per_line[0] * 1.1 and per_line[1] < 5, per_line


def test_a_rank_far_ahead_is_bounded_by_the_limit():
    c = Collapser(range(2), hold=100.0, limit=100, settle=0)
    shown = sum(len(c.add(0, "stdout", f"{i}\n", 0.0)) for i in range(1000))
    assert c.held == 2 * 100 and shown == 800  # the limit is per rank


def test_distinct_lines_cost_linear_work():
    per_line = []
    for n in (500, 5_000):
        c = Collapser(range(8), hold=1.0, settle=0)
        for i in range(n):
            for rank in range(8):
                c.add(rank, "stdout", f"rank {rank} step {i}\n", 0.0)
        c.flush()
        per_line.append(c.steps / (8 * n))
    assert per_line[1] <= per_line[0] * 1.1, per_line


@pytest.mark.parametrize("a, b, same", [
    ("Epoch 1:  50%|█████     | 5/10 [00:01<00:01, 4.50it/s]",
     "Epoch 1:  60%|██████    | 6/10 [00:01<00:01, 1.20s/it]", True),
    ("train: 3/20 loss=0.31", "train: 4/20 loss=0.29", True),
    ("train: 3/20", "eval: 3/20", False),
])
def test_bar_shape(a, b, same):
    assert (bar_shape(a) == bar_shape(b)) is same


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def router(keys, show=None, **kw):
    sink, clock = Recorder(), Clock()
    return sink, clock, OutputRouter(sink, keys, show, tag=len(keys) > 1, clock=clock,
                                     progress_interval=0.0, **kw)


def test_router_collapses_identical_lines_and_keeps_distinct_ones():
    sink, clock, r = router([f"rank{i}" for i in range(4)])
    for i in range(4):
        r.feed(f"rank{i}", "stdout", f"epoch done\nloss 0.{i}\n".encode())
    r.feed("rank1", "stdout", b"odd\n")
    r.feed("rank3", "stdout", b"odd\n")
    r.close()
    assert sink.text() == ("[rank0-3] epoch done\n[rank0] loss 0.0\n[rank1] loss 0.1\n"
                           "[rank2] loss 0.2\n[rank3] loss 0.3\n[rank1,3] odd\n")


def test_router_shows_held_lines_on_tick_once_their_time_is_up():
    sink, clock, r = router(["rank0", "rank1"], hold=0.5)
    r.feed("rank0", "stdout", b"only rank 0\n")
    r.tick()
    assert sink.out == []
    clock.now = 0.5
    r.tick()
    assert sink.text() == "[rank0] only rank 0\n"


def test_router_one_rank_is_untagged_and_immediate():
    sink, clock, r = router(["rank0"])
    r.feed("rank0", "stdout", b"plain\n")
    assert sink.text() == "plain\n"


def test_router_show_filter_collapses_only_the_shown_ranks():
    sink, clock, r = router(["rank0", "rank1", "rank2"], show={"rank0", "rank2"})
    for i in range(3):
        r.feed(f"rank{i}", "stdout", b"same\n")
    clock.now = 0.1
    r.tick()
    assert sink.text() == "[rank0,2] same\n"  # settled: both shown ranks printed it
    r.replay_hidden("--- {key} ---")
    assert sink.text("stderr") == "--- rank1 ---\n" and sink.text().endswith("[rank1] same\n")


def test_router_merges_other_ranks_matching_progress_bars_into_rank0s():
    sink, clock, r = router(["rank0", "rank1", "rank2"], hold=0.5)
    r.feed("rank0", "stderr", b"\rstep 1/3")
    r.feed("rank1", "stderr", b"\rstep 1/3")
    r.feed("rank2", "stderr", b"\reval 9")  # another bar: shown on its own after the hold
    clock.now = 0.2
    r.feed("rank0", "stderr", b"\rstep 2/3")
    r.feed("rank1", "stderr", b"\rstep 3/3\n")
    clock.now = 0.6
    r.feed("rank0", "stderr", b"\rstep 3/3\n")
    r.tick()
    r.close()
    keys = {key for key, _, _ in sink.bars}
    assert keys == {"rank0", "rank2"}, sink.bars
    assert ("rank0", "[rank0-1] step 3/3", True) in sink.bars
    assert [b for b in sink.bars if b[0] == "rank2"][-1] == ("rank2", "[rank2] eval 9", True)
    assert sink.out == []


def test_router_another_ranks_bar_that_matches_nothing_ends_as_a_line():
    sink, clock, r = router(["rank0", "rank1"], hold=0.5)
    r.feed("rank1", "stderr", b"\rdownload 1/2\rdownload 2/2\n")
    r.close()
    assert sink.bars == [] and sink.text("stderr") == "[rank1] download 2/2\n"


def test_router_a_ranks_held_lines_come_before_its_long_line():
    sink, clock, r = router(["rank0", "rank1"], hold=5.0)
    r._splitters[("rank0", "stdout")] = LineSplitter(max_line=4)
    r.feed("rank0", "stdout", b"first\n" + b"x" * 10)
    assert sink.text() == "[rank0] first\n[rank0] " + "x" * 10


def test_per_rank_reads_collapsed_output_back_as_each_rank_printed_it():
    sink, clock, r = router(["rank0", "rank1", "rank2", "rank3"])
    for i in range(4):
        r.feed(f"rank{i}", "stdout", b"done\n" + (b"odd\n" if i % 2 else b""))
    r.close()
    assert sink.text() == "[rank0-3] done\n[rank1,3] odd\n"
    assert per_rank(sink.text()) == "[rank0] done\n[rank1] done\n[rank2] done\n[rank3] done\n[rank1] odd\n[rank3] odd\n"
    assert per_rank("plain\n[rank2] y") == "plain\n[rank2] y"


def test_router_one_shown_rank_of_several_is_tagged_and_immediate():
    sink, clock, r = router(["rank0", "rank1"], show={"rank0"})
    r.feed("rank0", "stdout", b"now\n")
    assert sink.text() == "[rank0] now\n"
