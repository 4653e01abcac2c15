"""The kernel's working directory is checked before a job starts (taas.session.working_directory)."""

from __future__ import annotations

import os

import pytest

from taas.errors import LaunchError
from taas.session import working_directory


@pytest.fixture
def back_home():
    home = os.getcwd()
    yield
    os.chdir(home)


def test_the_working_directory_is_returned(tmp_path, back_home):
    os.chdir(tmp_path)
    assert working_directory() == str(tmp_path)


def test_a_deleted_working_directory_is_one_line(tmp_path, back_home):
    gone = tmp_path / "gone"
    gone.mkdir()
    os.chdir(gone)
    gone.rmdir()
    with pytest.raises(LaunchError) as info:
        working_directory()
    message = str(info.value)
    assert "\n" not in message
    assert f"working directory {gone} no longer exists" in message and "%cd" in message


def test_a_working_directory_made_again_is_not_the_same(tmp_path, back_home):
    again = tmp_path / "again"
    again.mkdir()
    os.chdir(again)
    again.rmdir()
    again.mkdir()
    with pytest.raises(LaunchError, match="not the same one"):
        working_directory()


@pytest.mark.skipif(os.geteuid() == 0, reason="root enters any directory")
def test_a_working_directory_that_cannot_be_entered(tmp_path, back_home):
    shut = tmp_path / "shut"
    shut.mkdir()
    os.chdir(shut)
    shut.chmod(0o600)
    try:
        with pytest.raises(LaunchError, match="cannot be entered"):
            working_directory()
    finally:
        shut.chmod(0o700)


def _no_space(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["mkdtemp", "write"])
def test_no_space_for_the_job_files_is_one_line(monkeypatch, tmp_path, where):
    """The local launcher cannot create the job's directory, or write the payload into it:
    one line, and no directory or process is left."""
    import builtins
    import glob
    import tempfile

    from taas.launch.local import jobdir
    from taas.launch.api import LaunchSpec, ProcessSpec
    from taas.launch.local.launcher import LocalLauncher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if where == "mkdtemp":
        monkeypatch.setattr(jobdir.tempfile, "mkdtemp", _no_space)
    else:
        real_open = builtins.open
        monkeypatch.setattr(builtins, "open", lambda path, mode="r", *a, **k: _no_space()
                            if str(path).endswith("payload.pkl") else real_open(path, mode, *a, **k))
    launcher = LocalLauncher()
    try:
        with pytest.raises(LaunchError) as info:
            launcher.start(LaunchSpec("nospace", str(tmp_path), (ProcessSpec("rank0", "x:y", rank=0),),
                                      files={"payload.pkl": b"x"}))
    finally:
        monkeypatch.undo()
        launcher.shutdown()
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message and "TMPDIR" in message
    assert glob.glob(str(tmp_path / "taas-*")) == []
