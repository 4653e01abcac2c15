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


def test_files_written_in_the_working_directory_during_the_attempt_are_listed(tmp_path):
    from taas.workdir.merge import Layers, clock_mark

    (tmp_path / "before.txt").write_text("old")
    (tmp_path / "data").mkdir()
    # The file system's clock ticks coarsely: "before" is before the mark once it has ticked.
    before = (tmp_path / "before.txt").stat().st_ctime_ns
    while clock_mark(str(tmp_path)) <= before:
        pass
    layers = Layers(str(tmp_path), active=True)
    layers.mark()
    (tmp_path / "ready.flag").write_text("1")  # what rank 0 or the notebook writes meanwhile
    (tmp_path / "data" / "part-0.bin").write_bytes(b"0")
    for quiet in (".taas/conflicts/x", "__pycache__/m.pyc", ".ipynb_checkpoints/a.ipynb", "run.ipynb"):
        (tmp_path / quiet).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / quiet).write_text("")
    assert layers.written() == ["data/part-0.bin", "ready.flag"]
    assert Layers(str(tmp_path), active=False).written() == []


def test_the_unseen_hint_names_the_files_and_storage_shared():
    from taas.io.failure import unseen_hint

    assert unseen_hint([]) is None
    hint = unseen_hint(["ready.flag"])
    assert hint.startswith("taas: ready.flag was written in the working directory while the job ran: ")
    assert "after it first looked for it" in hint and "--storage shared" in hint and "\n" not in hint
    many = unseen_hint([f"f{i}" for i in range(5)])
    assert many.startswith("taas: f0, f1, f2 and 2 more were written"), many
