"""taas.workdir.merge on plain directories: what ranks > 0 wrote comes back unless it conflicts."""

from __future__ import annotations

import os
import pytest

from taas.workdir.merge import clock_mark, merge_layers


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def read(path) -> str:
    with open(path) as f:
        return f.read()


@pytest.fixture
def tree(tmp_path):
    """(working directory, layers root, conflicts dir); ``before.txt`` and ``sub/kept.txt``
    predate the job."""
    work = tmp_path / "work"
    write(work / "before.txt", "old")
    write(work / "sub" / "kept.txt", "kept")
    return work, tmp_path / "layers", work / ".taas" / "conflicts" / "job1"


def start_of_job(work) -> int:
    """The job's clock mark, once the file system clock has moved past the files made before
    (its ticks are coarse: a mark in the same tick would count them as written during the job)."""
    before = max(os.lstat(os.path.join(d, n)).st_ctime_ns
                 for d, _, names in os.walk(work) for n in names)
    while True:
        mark = clock_mark(str(work))
        if mark > before:
            return mark


def upper(root, name: str):
    path = root / name / "upper"
    path.mkdir(parents=True, exist_ok=True)
    return path


def whiteout(path) -> bool:
    """An overlay whiteout (char device 0:0); False where this user may not make one."""
    try:
        os.mknod(path, 0o600 | 0o020000, 0)
        return True
    except PermissionError:
        return False


def merge(work, layers_root, conflicts, since):
    names = sorted(os.listdir(layers_root)) if layers_root.exists() else []
    return merge_layers(str(work), [(n, str(layers_root / n / "upper")) for n in names], since,
                        str(conflicts))


def test_new_files_of_each_rank_come_back_and_rank_zero_keeps_its_own(tree):
    work, layers, conflicts = tree
    since = start_of_job(work)
    write(work / "checkpoint-2" / "rng_state_0.pth", "rank0")  # rank 0 writes directly
    write(upper(layers, "rank1") / "checkpoint-2" / "rng_state_1.pth", "rank1")
    write(upper(layers, "rank2") / "checkpoint-2" / "rng_state_2.pth", "rank2")
    (upper(layers, "rank1") / "empty-dir").mkdir()
    report = merge(work, layers, conflicts, since)
    assert sorted(report.applied) == ["checkpoint-2/rng_state_1.pth", "checkpoint-2/rng_state_2.pth"]
    assert [read(work / "checkpoint-2" / f"rng_state_{r}.pth") for r in range(3)] == ["rank0", "rank1", "rank2"]
    assert (work / "empty-dir").is_dir()
    assert report.notes() == [] and not conflicts.exists()


def test_a_file_from_before_the_job_changed_by_one_rank_is_updated(tree):
    work, layers, conflicts = tree
    since = start_of_job(work)
    write(upper(layers, "rank1") / "before.txt", "new")
    report = merge(work, layers, conflicts, since)
    assert read(work / "before.txt") == "new" and report.applied == ["before.txt"]


def test_rank_zero_and_another_rank_writing_one_path_is_a_conflict(tree):
    work, layers, conflicts = tree
    since = start_of_job(work)
    write(work / "log.txt", "rank0")
    write(upper(layers, "rank1") / "log.txt", "rank1")
    report = merge(work, layers, conflicts, since)
    assert read(work / "log.txt") == "rank0"
    assert read(conflicts / "rank1" / "log.txt") == "rank1"
    assert report.conflicts == {"log.txt": ["rank1"]}
    [note] = report.notes()
    assert "log.txt" in note and ".taas/conflicts/job1/" in note and "rank1" in note


def test_two_ranks_writing_different_contents_keep_the_original_and_set_both_aside(tree):
    work, layers, conflicts = tree
    since = start_of_job(work)
    write(upper(layers, "rank1") / "out.txt", "one")
    write(upper(layers, "rank2") / "out.txt", "two")
    write(upper(layers, "rank1") / "before.txt", "one")
    write(upper(layers, "rank2") / "before.txt", "old")  # the same as before: rank1 still differs
    report = merge(work, layers, conflicts, since)
    assert not (work / "out.txt").exists() and read(work / "before.txt") == "old"
    assert read(conflicts / "rank1" / "out.txt") == "one" and read(conflicts / "rank2" / "out.txt") == "two"
    assert report.conflicts == {"before.txt": ["rank1"], "out.txt": ["rank1", "rank2"]}
    assert len(report.notes()) == 1 and "rank1 and rank2" in report.notes()[0]


def test_identical_content_is_no_conflict(tree):
    work, layers, conflicts = tree
    since = start_of_job(work)
    write(work / "same.txt", "x")  # rank 0
    write(upper(layers, "rank1") / "same.txt", "x")
    write(upper(layers, "rank1") / "both.txt", "y")
    write(upper(layers, "rank2") / "both.txt", "y")
    os.symlink("same.txt", upper(layers, "rank2") / "link")
    report = merge(work, layers, conflicts, since)
    assert report.conflicts == {} and report.notes() == []
    assert read(work / "both.txt") == "y" and os.readlink(work / "link") == "same.txt"


def test_rank_zero_writing_during_the_job_is_judged_by_ctime(tree):
    """A file older than the mark counts as untouched; one written after it as rank 0's."""
    work, layers, conflicts = tree
    since = start_of_job(work)
    write(work / "sub" / "kept.txt", "rank0")
    write(upper(layers, "rank1") / "sub" / "kept.txt", "rank1")
    report = merge(work, layers, conflicts, since)
    assert read(work / "sub" / "kept.txt") == "rank0" and "sub/kept.txt" in report.conflicts
    assert os.stat(work / "sub" / "kept.txt").st_ctime_ns >= since


def test_file_against_directory_is_a_conflict(tree):
    work, layers, conflicts = tree
    since = start_of_job(work)
    write(upper(layers, "rank1") / "sub", "a file where a directory is")
    write(upper(layers, "rank1") / "before.txt" / "inner", "a directory where a file is")
    report = merge(work, layers, conflicts, since)
    assert (work / "sub").is_dir() and read(work / "before.txt") == "old"
    assert set(report.conflicts) == {"sub", "before.txt/inner"}
    assert read(conflicts / "rank1" / "before.txt" / "inner") == "a directory where a file is"


def test_deletions_are_not_applied_and_named(tree):
    work, layers, conflicts = tree
    if not whiteout(upper(layers, "rank1") / "before.txt"):
        pytest.skip("cannot make a character device here")
    report = merge(work, layers, conflicts, start_of_job(work))
    assert read(work / "before.txt") == "old"
    assert report.deleted == {"before.txt": ["rank1"]}
    assert report.notes() == ["taas: rank1 deleted before.txt: deletions by ranks other than 0 "
                              "are not applied to the working directory"]


def test_python_caches_are_never_conflicts(tree):
    work, layers, conflicts = tree
    since = start_of_job(work)
    write(work / "__pycache__" / "m.pyc", "rank0")
    write(upper(layers, "rank1") / "__pycache__" / "m.pyc", "rank1")
    write(upper(layers, "rank1") / "__pycache__" / "n.pyc", "rank1")
    report = merge(work, layers, conflicts, since)
    assert report.notes() == [] and read(work / "__pycache__" / "m.pyc") == "rank0"
    assert read(work / "__pycache__" / "n.pyc") == "rank1"


def test_a_note_names_a_few_paths_then_counts(tree):
    work, layers, conflicts = tree
    since = start_of_job(work)
    for i in range(6):
        write(work / f"f{i}", "0")
        write(upper(layers, "rank1") / f"f{i}", "1")
    [note] = merge(work, layers, conflicts, since).notes()
    assert "f0, f1, f2, f3 and 2 more" in note and "\n" not in note


class _Sink:
    def __init__(self):
        self.lines: list[str] = []

    def write(self, stream, text):
        self.lines.append(text)


def test_layers_merge_in_rank_order_and_notes_name_ranks_by_number(tree):
    from taas.workdir.merge import Layers

    work, layers_root, _ = tree
    layers = Layers(str(work), active=True)
    layers.mark()
    for name in ("rank10", "rank2", "loader:data:0"):
        write(upper(layers_root, name) / "out.txt", f"from {name}")
    sink = _Sink()
    given = [(n, str(layers_root / n / "upper")) for n in ("rank10", "loader:data:0", "rank2")]
    report = layers.merge(given, "job1", sink)
    assert report is not None and report.conflicts
    assert "rank2, rank10 and loader:data:0 wrote out.txt differently" in "".join(sink.lines), sink.lines
    assert layers.merge(given, "job1", sink) is None  # once per attempt


def test_a_ctrl_c_as_the_clock_is_read_leaves_no_file_in_the_folder(tmp_path, monkeypatch, python_sigint):
    """The clock file is made and removed as one step: an interrupt fuzz's Ctrl-Cs had left
    36 of them in the notebook's folder."""
    import os
    import signal
    import tempfile

    made = tempfile.mkstemp

    def interrupted(*args, **kwargs):
        fd, name = made(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # the user's Ctrl-C, as the file is made
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", interrupted)
    with pytest.raises(KeyboardInterrupt):
        clock_mark(str(tmp_path))
    assert os.listdir(tmp_path) == []
