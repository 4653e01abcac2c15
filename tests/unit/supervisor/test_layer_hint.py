"""supervisor.diagnosis.layer_hint: after an attempt that did not succeed, what ranks > 0 wrote
into their layers (from the merge's report), in one line."""

from __future__ import annotations

from taas.supervisor import diagnosis
from taas.workdir.merge import merge_layers


def test_the_hint_names_what_reached_the_working_directory_or_was_set_aside(tmp_path):
    cwd, upper = tmp_path / "cwd", tmp_path / "layer1"
    cwd.mkdir()
    (upper / "sub").mkdir(parents=True)
    (upper / "sub" / "ready.flag").write_text("1")
    (cwd / "same.txt").write_text("x")
    (upper / "same.txt").write_text("x")  # what the working directory has: changes nothing
    report = merge_layers(str(cwd), [("rank1", str(upper))], 0, str(cwd / ".taas" / "c"))
    assert report.written == {"same.txt": ["rank1"], "sub/ready.flag": ["rank1"]}
    hint = diagnosis.layer_hint(report)
    assert hint is not None and hint.startswith("taas: rank1 wrote sub/ready.flag into a layer")
    assert "same.txt" not in hint and "--storage shared" in hint


def test_no_hint_without_a_merge_or_files(tmp_path):
    assert diagnosis.layer_hint(None) is None
    empty = tmp_path / "layer1"
    empty.mkdir()
    assert diagnosis.layer_hint(merge_layers(str(tmp_path), [("rank1", str(empty))], 0,
                                             str(tmp_path / "c"))) is None
