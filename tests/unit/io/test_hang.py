"""Table tests of taas.io.hang: where the ranks were, and who is not where the others are."""

from __future__ import annotations

import pytest

from taas.io.hang import Place, groups, label, odd_ones, odd_sentence, one_line, render

CELL = "/tmp/ipykernel_1/123.py"


def at(key, line, call, frames=None):
    return Place(key, line, call, frames or [])


REDUCE = "dist.all_reduce(t)"
BARRIER = "dist.barrier()"

ODD = [
    # (places, odd keys)
    ([at("rank0", 9, REDUCE), at("rank1", 12, BARRIER), at("rank2", 9, REDUCE)], ["rank1"]),
    ([at("rank0", 9, REDUCE), at("rank1", 9, REDUCE)], []),  # all together
    ([at("rank0", 9, REDUCE), at("rank1", 12, BARRIER)], []),  # a tie: nobody to name
    ([at("rank0", 9, REDUCE), Place("rank1", ended="already ended (sys.exit(0))")], ["rank1"]),
    ([at("rank0", 9, REDUCE), at("rank1", 12, BARRIER), at("rank2", 9, REDUCE),
      Place("rank3", ended="already ended (code 0)")], ["rank1", "rank3"]),
    ([at("rank0", 9, REDUCE), at("rank1", 9, REDUCE), Place("rank2")], []),  # no answer: not named
    ([Place("rank0", ended="already ended (code 0)")], []),  # nobody is running
]


@pytest.mark.parametrize("places, odd", ODD)
def test_odd_ones(places, odd):
    assert odd_ones(places) == odd


def test_groups_and_one_line():
    places = [at("rank3", 9, REDUCE), at("rank1", 12, BARRIER), at("rank0", 9, REDUCE),
              at("rank2", 9, REDUCE)]
    assert groups(places) == [(["rank0", "rank2", "rank3"], "line 9 dist.all_reduce(t)"),
                              (["rank1"], "line 12 dist.barrier()")]
    assert one_line(places) == "rank0,2-3: line 9 dist.all_reduce(t) | rank1: line 12 dist.barrier()"


def test_where_outside_the_cell_and_without_answer():
    frames = [{"filename": "/x/torch/distributed/distributed_c10d.py", "lineno": 4000,
               "name": "init_process_group", "line": ""}]
    assert Place("rank0", frames=frames).where == "in init_process_group (distributed_c10d.py:4000)"
    assert Place("rank0").where == "no answer"


def test_label():
    assert label(["rank0", "rank2"]) == "rank0,2"
    assert label(["loader:x:0"]) == "loader:x:0"


def test_odd_sentence():
    assert odd_sentence(ODD[0][0]) == "rank1 is not where the others are"
    assert odd_sentence(ODD[4][0]) == "rank1 and rank3 are not where the others are"
    assert odd_sentence(ODD[1][0]) is None


def test_render_names_the_odd_rank_and_shows_the_stacks():
    frames = [{"filename": CELL, "lineno": 12, "name": "<module>", "line": BARRIER},
              {"filename": "/x/torch/distributed/c10d_logger.py", "lineno": 81, "name": "wrapper",
               "line": "return func(*args, **kwargs)"}]
    places = [at("rank0", 9, REDUCE), at("rank1", 12, BARRIER, frames), at("rank2", 9, REDUCE)]
    lines = render(places, name_for=lambda f: "Cell In[3]" if f == CELL else None)
    text = "\n".join(lines)
    assert lines[0] == "rank1 is not where the others are."
    assert "  rank0,2: line 9 dist.all_reduce(t)" in lines
    assert "  rank1: line 12 dist.barrier()" in lines
    assert "--- rank1 ---" in lines
    assert "  Cell In[3], line 12\n    dist.barrier()" in text
    assert 'c10d_logger.py", line 81, in wrapper' in text


def test_render_a_tie_says_so():
    lines = render([at("rank0", 9, REDUCE), at("rank1", 12, BARRIER)])
    assert lines[0] == "The ranks were not all at the same place."


def test_a_label_of_many_ranks_reads_like_the_output_tags():
    assert label([f"rank{r}" for r in range(32)]) == "rank0-31"
    assert label(["rank0", "rank1", "rank3"]) == "rank0-1,3"


def test_a_rank_in_the_debugger_is_never_the_odd_one_and_the_others_waited_for_it():
    from taas.io import hang as h

    places = [h.Place("rank0", 9, "dist.all_reduce(t)"), h.Place("rank1", 5, "breakpoint()", debugger=True),
              h.Place("rank2", 9, "dist.all_reduce(t)")]
    assert h.odd_ones(places) == []
    lines = h.render(places)
    assert lines[0] == "rank1 was in the debugger; the others waited for it."
    assert "  rank1: in the debugger at line 5" in lines and "  rank0,2: line 9 dist.all_reduce(t)" in lines
    assert not any("not where the others are" in line or "not all at the same place" in line for line in lines)
